"""The direct kernel's knobs: their ranges, the check of those given to a plan, and the knobs
`volconv bench --tune` (`volconv.plan.tune`) measured fastest, cached per device.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv.checks import check_positive_int
from volconv.device.cache import cache_folder, device_key, read_cached, say_once
from volconv.device.programs import kernel_source
from volconv.engines.registry import ENGINES, engine_candidates

VECTOR_WIDTHS = (1, 2, 4, 8, 16)
MAX_UNROLL = 32
MAX_ROWS = 8  # bank_conv.cl's ROWS: outputs per work-item along axis 1


def check_knobs(
    device: cl.Device,
    unroll: object,
    vector_width: object,
    local_size: object,
    rows: object = None,
) -> None:
    """The expert knobs given to a plan, checked: a ValueError naming the knob, not a
    KeyError or an OpenCL error from deep inside the build."""
    if unroll is not None:
        check_positive_int(unroll, "unroll")
    if rows is not None and check_positive_int(rows, "rows") > MAX_ROWS:
        raise ValueError(f"rows must be 1..{MAX_ROWS}; got {rows!r}")
    if vector_width is not None and vector_width not in VECTOR_WIDTHS:
        raise ValueError(f"vector_width must be one of {VECTOR_WIDTHS}; got {vector_width!r}")
    if local_size is not None:
        if not isinstance(local_size, (tuple, list)) or len(local_size) != 2:
            raise ValueError(f"local_size must be two positive integers; got {local_size!r}")
        lz, ly = (check_positive_int(v, "local_size") for v in local_size)
        if lz * ly > device.max_work_group_size:
            most = device.max_work_group_size
            raise ValueError(f"local_size {tuple(local_size)} has {lz * ly} work-items; "
                             f"{device.name.strip()} takes at most {most}")  # fmt: skip


# -- the tuning cache -----------------------------------------------------------------------
# `volconv bench --tune` (volconv.plan.tune) writes the knobs that ran fastest for a bank shape on
# a device to tune.json beside the FMA probe's peak.json: {device key: {bank key: entry}}.
# An entry made for other kernels (any engine's), or of another format, is stale.

TUNE_FILE = "tune.json"
TUNE_FORMAT = 1


def kernel_hash() -> str:
    """The first 12 hex digits of the SHA-256 of every engine's kernels: tuned knobs and the
    engine chosen hold for these sources."""
    sources = "".join(kernel_source(f) for e in ENGINES for f in e.sources)
    return hashlib.sha256(sources.encode()).hexdigest()[:12]


def tune_keys(
    device: cl.Device, extents: tuple[int, int, int], n_filters: int, src_dtype: np.dtype
) -> tuple[str, str]:
    """The cache's keys: the device key (platform, device, driver); the bank's extents, N and
    type."""
    bank = f"{'x'.join(map(str, extents))} N={n_filters} {np.dtype(src_dtype).name}"
    return device_key(device), bank


def tune_path(cache_dir: Path | None = None) -> Path:
    """tune.json in the cache folder (`volconv.device.cache.cache_folder`: under its trust rule)."""
    return cache_folder(cache_dir) / TUNE_FILE


def tuned_knobs(
    device: cl.Device,
    extents: tuple[int, int, int],
    n_filters: int,
    src_dtype: np.dtype,
    cache_dir: Path | None = None,
) -> dict[str, object] | None:
    """The knobs cached for this device, driver and bank shape: ``unroll``, ``rows``,
    ``input_local`` (None: the plan's), ``local_size``, ``vector_width`` (None: the plan
    splits the bank), ``engine``; None when there are none.
    An unreadable file, or an entry that is stale (another kernel source or format) or
    invalid, is ignored with a warning: the plan falls back to its defaults."""
    path = tune_path(cache_dir)
    text = read_cached(path.parent, TUNE_FILE, "the plan takes its defaults")
    if text is None:  # none, or one that fails the cache's trust rule (warned)
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return ignored_entry(path, "not JSON")
    dev_key, bank_key = tune_keys(device, extents, n_filters, src_dtype)
    entry = doc.get(dev_key, {}) if isinstance(doc, dict) else None
    entry = entry.get(bank_key) if isinstance(entry, dict) else None
    if entry is None:
        return None
    if not isinstance(entry, dict):
        return ignored_entry(path, f"its entry for {bank_key} is not an object")
    if entry.get("format") != TUNE_FORMAT or entry.get("kernel") != kernel_hash():
        return ignored_entry(path, f"its entry for {bank_key} is stale (other kernels)")
    try:
        knobs = {
            "unroll": int(entry["unroll"]),
            "rows": None if entry.get("rows") is None else int(entry["rows"]),
            "input_local": None if entry.get("input_local") is None else bool(entry["input_local"]),
            "local_size": tuple(int(v) for v in entry["local_size"]),
            "vector_width": None if entry["vector_width"] is None else int(entry["vector_width"]),
            "engine": str(entry["engine"]),
        }
    except (KeyError, TypeError, ValueError):
        return ignored_entry(path, f"its entry for {bank_key} lacks a knob")
    if not (
        1 <= knobs["unroll"] <= MAX_UNROLL
        and knobs["rows"] in (None, *range(1, MAX_ROWS + 1))
        and len(knobs["local_size"]) == 2
        and min(knobs["local_size"]) >= 1
        and knobs["vector_width"] in (None, *VECTOR_WIDTHS)
    ):
        return ignored_entry(path, f"its entry for {bank_key} holds an invalid knob")
    if knobs["engine"] not in [e.name for e in engine_candidates(device)]:
        engine = knobs["engine"]
        return ignored_entry(path, f"its entry for {bank_key} names engine {engine!r}, which does "
                              f"not run on {device.name.strip()}")  # fmt: skip
    lz, ly = knobs["local_size"]
    if lz * ly > device.max_work_group_size:
        return ignored_entry(path, f"its entry for {bank_key} has a work-group of {lz}x{ly}; "
                              f"{device.name.strip()} takes at most "
                              f"{device.max_work_group_size} work-items")  # fmt: skip
    return knobs


def ignored_entry(path: Path, why: str) -> None:
    message = (f"{path}: {why}; ignored, the plan takes its defaults (volconv bench --tune "
               "measures again)")  # fmt: skip
    say_once(message, message, stacklevel=4)  # once a run, not once a plan
    return None
