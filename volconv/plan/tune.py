"""Autotuning, cached per device: `volconv bench --tune`.

`tune_bank` times candidate knobs of the direct path for one bank shape on one device (the
engine, from `volconv.engines.registry.ENGINES`: the FP32 kernel, and the tensor cores where the
device has them; for the FP32 kernel the vector width, the outputs per work-item along z (unroll)
and y (rows), whether the input planes are staged in local memory (input_local) and the
work-group shape),
re-times the best few side by side with the untuned plan, which a winner
must beat by `MARGIN`, and caches the winner in ``tune.json`` beside the FMA probe's
``peak.json`` (`volconv.plan.knobs.tuned_knobs` reads it: every later plan of that bank shape on
that device and driver takes it).

The search is by coordinate: the width at the plan's own block and work-group, then the
unroll at the best width, then the rows at both, then input_local at all three, then the
work-group at all four; a full product would take minutes per bank. Every timing is the
fastest of ``repeats`` launches (`BankConvolver.time_kernel`): other work on a shared machine
only ever slows a launch down.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv import __version__
from volconv.bench import Work, device_record
from volconv.device.cache import read_cached, write_cached
from volconv.device.devices import select_device
from volconv.device.peak import measured_peak
from volconv.engines.choose import auto_engine
from volconv.engines.registry import ENGINES, engine_candidates
from volconv.plan.knobs import TUNE_FORMAT, kernel_hash, tune_keys, tune_path

# The candidates: what won somewhere (benchmarks/README.md, "The measurements behind the defaults").
TUNE_UNROLL = (4, 8, 12, 16, 24)
# Rows per work-item (measured: benchmarks/README.md).
TUNE_ROWS = (1, 2, 4)
TUNE_LOCAL = ((1, 128), (2, 32), (4, 8), (8, 16), (16, 8), (32, 4))
# Input planes staged in local memory (bank_conv.cl's INPUT_LOCAL) or read from global.
TUNE_INPUT_LOCAL = (False, True)
TUNE_WIDTHS = (4, 8, 16)
FINALISTS = 3  # the best points re-timed side by side, in turns
# How much faster than the untuned plan a winner must run side by side to replace it: a burst
# of other work on a shared machine can make a worse candidate look faster (benchmarks/README.md).
MARGIN = 1.05

Progress = Callable[[dict], None]


@dataclass(frozen=True)
class Candidates:
    """What `tune_bank` tries. ``engines`` None: every engine that runs on the device."""

    engines: tuple[str, ...] | None = None
    vector_widths: tuple[int, ...] = TUNE_WIDTHS
    unrolls: tuple[int, ...] = TUNE_UNROLL
    rows: tuple[int, ...] = TUNE_ROWS
    input_local: tuple[bool, ...] = TUNE_INPUT_LOCAL
    local_sizes: tuple[tuple[int, int], ...] = TUNE_LOCAL


def _knobs(point: dict) -> tuple:
    """What ran, as the plan resolved it: equal knobs time once."""
    return (
        point["engine"],
        tuple(point["passes"]),
        point["unroll"],
        point["rows"],
        point.get("input_local"),
        tuple(point["local_size"]),
    )


class _Timer:
    """Builds and times one candidate at a time over the first slab of ``work``."""

    def __init__(self, work: Work, device: cl.Device, repeats: int) -> None:
        self.work, self.device, self.repeats = work, device, repeats
        self.volume = work.volume()
        self.kernels = work.kernels()
        self.points: list[dict] = []

    def build(self, engine: str, **knobs: object):
        """The candidate's convolver with its first slab computed (the padded slab on the
        device), the slab, and the plan's resolved knobs."""
        cls = next(e for e in engine_candidates(self.device) if e.name == engine).load()
        w = self.work
        conv = cls(self.kernels, w.shape, self.volume.dtype, w.mode, w.cval, device=self.device,
                   engine=engine, tuned=False, **knobs)  # fmt: skip
        a, b = next(conv.slabs())
        conv.convolve_slab(a, b, self.volume[conv.source_rows(a, b)])
        conv.time_kernel(a, b, 1)  # warm-up: the driver's first-launch work, clocks
        plan = conv.plan
        point = {
            "engine": engine,
            "path": conv.engine,  # what ran, as the record names it (e.g. tensor-int8x3)
            "vector_width": knobs.get("vector_width"),  # None: the plan's own passes
            "unroll": plan.unroll,
            "rows": plan.rows,
            "input_local": bool(getattr(plan, "input_local", False)),
            "local_size": list(plan.local_size[:2]),
            "passes": [p.width for p in plan.passes],
            "slab_rows": b - a,
        }
        return conv, (a, b), point

    def time(self, conv, rows: tuple[int, int], repeats: int) -> float:
        return float(np.min(conv.time_kernel(*rows, repeats)))

    def rate(self, point: dict, seconds: float) -> dict:
        gflop = self.work.gflop(shape=(point["slab_rows"], *self.work.shape[1:]))
        return {**point, "seconds": seconds, "gflops": gflop / seconds}

    def measure(self, engine: str, progress: Progress | None, **knobs: object) -> dict | None:
        """Time one candidate (once per resolved knobs); None when the device cannot run it."""
        requested = {k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()}
        try:
            conv, rows, point = self.build(engine, **knobs)
        except (cl.Error, ValueError) as e:  # OUT_OF_RESOURCES for a wide unroll; a refusal
            self.points.append({"engine": engine, **requested, "error": f"{e}"})
            if progress:
                progress(self.points[-1])
            return None
        seen = next((p for p in self.points if "error" not in p and _knobs(p) == _knobs(point)),
                    None)  # fmt: skip
        if seen is not None:
            return seen
        point = self.rate(point, self.time(conv, rows, self.repeats))
        del conv  # one candidate's buffers at a time
        self.points.append(point)
        if progress:
            progress(point)
        return point


def _best(points: Sequence[dict | None]) -> dict | None:
    ok = [p for p in points if p is not None]
    return min(ok, key=lambda p: p["seconds"]) if ok else None


def tune_bank(
    work: Work,
    *,
    device: cl.Device | str | None = None,
    candidates: Candidates = Candidates(),
    repeats: int = 5,
    rounds: int = 3,
    cache_dir: Path | None = None,
    write: bool = True,
    progress: Progress | None = None,
) -> dict[str, object]:
    """Find the fastest knobs for ``work``'s bank shape on ``device`` and cache them.

    Returns the record: every point timed (``points``), the finalists re-timed in ``rounds``
    turns (``finalists``), the ``winner`` (the cache entry) and the ``cache`` file. With
    ``write`` False nothing is cached. ``progress(point)`` is called after each point.
    """
    device = device if isinstance(device, cl.Device) else select_device(device)
    available = [e.name for e in engine_candidates(device)]
    engines = [e for e in (candidates.engines or available) if e in available]
    if not engines:
        raise ValueError(f"no engine of {candidates.engines} runs on {device.name.strip()}")
    timer = _Timer(work, device, repeats)
    # the untuned plan's own choice: the engine by rule (`auto_engine`) at its defaults
    default = auto_engine(device, timer.kernels, np.dtype(work.dtype), work.mode, work.cval,
                          tuned=False)  # fmt: skip
    engines.sort(key=lambda e: e != default)
    untuned = None
    for engine in engines:
        base = timer.measure(engine, progress)
        untuned = untuned or base
        if not next(e for e in ENGINES if e.name == engine).knobs:
            continue  # none of the FP32 kernel's knobs to search
        widths = [timer.measure(engine, progress, vector_width=v)
                  for v in candidates.vector_widths]  # fmt: skip
        best = _best([base, *widths])
        if best is None:
            continue
        unrolls = [timer.measure(engine, progress, vector_width=best["vector_width"], unroll=u)
                   for u in candidates.unrolls]  # fmt: skip
        best = _best([best, *unrolls])
        rows = [timer.measure(engine, progress, vector_width=best["vector_width"],
                              unroll=best["unroll"], rows=r) for r in candidates.rows]  # fmt: skip
        best = _best([best, *rows])
        tiles = [timer.measure(engine, progress, vector_width=best["vector_width"],
                               unroll=best["unroll"], rows=best["rows"], input_local=t)
                 for t in candidates.input_local]  # fmt: skip
        best = _best([best, *tiles])
        for local in candidates.local_sizes:
            timer.measure(engine, progress, vector_width=best["vector_width"],
                          unroll=best["unroll"], rows=best["rows"],
                          input_local=best["input_local"], local_size=tuple(local))  # fmt: skip
    timed = sorted((p for p in timer.points if "error" not in p), key=lambda p: p["seconds"])
    if not timed:
        raise RuntimeError(f"no candidate ran on {device.name.strip()}: {timer.points}")
    # the untuned plan runs beside the best few: the winner has to beat it side by side
    best = timed[:FINALISTS]
    finalists = _retime(timer, best + ([untuned] if untuned and untuned not in best else []),
                        rounds)  # fmt: skip
    winner = min(finalists, key=lambda p: p["seconds"])
    untuned = next((f for f in finalists if untuned and _knobs(f) == _knobs(untuned)), None)
    if untuned and winner["seconds"] * MARGIN > untuned["seconds"]:
        winner = untuned  # not clearly faster: the defaults stay
    probe = measured_peak(device, probe=False, cache_dir=cache_dir)  # when measured: no wait
    dev_key, bank_key = tune_keys(device, work.extent, work.n, np.dtype(work.dtype))
    entry = {
        "format": TUNE_FORMAT,
        "kernel": kernel_hash(),
        **{
            k: winner.get(k)
            for k in ("engine", "vector_width", "unroll", "rows", "input_local", "local_size")
        },
        "path": winner.get("path"),
        "gflops": winner["gflops"],
        "untuned_gflops": untuned and untuned["gflops"],
        "measured_peak_gflops": probe,
        "fraction_of_measured_peak": winner["gflops"] / probe if probe else None,
        "shape": list(work.shape),
        "mode": work.mode,
        "points": len(timed),
        "volconv_version": __version__,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = tune_path(cache_dir)  # in the cache folder that passes the trust rule
    if write:
        doc = _read(path)  # re-read: another process may have tuned another bank
        if not isinstance(doc.get(dev_key), dict):
            doc[dev_key] = {}
        doc[dev_key][bank_key] = entry
        # atomic, through a private file renamed over it: a plan never reads half a file
        write_cached(path.parent, path.name, (json.dumps(doc, indent=1) + "\n").encode())
    return {
        "device": device_record(device),
        "work": {**asdict(work), "shape": list(work.shape), "extent": list(work.extent)},
        "points": timer.points,
        "finalists": finalists,
        "winner": entry,
        "cache": str(path) if write else None,
        "key": [dev_key, bank_key],
    }


def _retime(timer: _Timer, points: list[dict], rounds: int) -> list[dict]:
    """The ``points`` timed again in turns, ``rounds`` times, the fastest of each kept: a
    burst of other work on the machine then slows every finalist alike."""
    built = []
    for p in points:
        knobs = {
            "vector_width": p["vector_width"],
            "unroll": p["unroll"],
            "rows": p["rows"],
            "input_local": p.get("input_local"),
            "local_size": tuple(p["local_size"]),
        }
        knobs = {k: v for k, v in knobs.items() if v is not None}
        conv, rows, _ = timer.build(p["engine"], **knobs)
        built.append((p, conv, rows, []))
    for _ in range(rounds):
        for _, conv, rows, seconds in built:
            seconds.append(timer.time(conv, rows, max(1, timer.repeats // 2)))
    return [timer.rate({k: v for k, v in p.items() if k not in ("seconds", "gflops")},
                       min(seconds)) for p, _, _, seconds in built]  # fmt: skip


def _read(path: Path) -> dict:
    """The cache's contents, or an empty one when it is missing, unreadable or fails the
    cache's trust rule (`volconv.device.cache`): then replaced."""
    text = read_cached(path.parent, path.name, "replaced")
    try:
        doc = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _knob_text(p: dict) -> str:
    """The engine, and the FP32 kernel's knobs where they are the engine's."""
    engine = f"engine={p.get('path') or p['engine']}"
    if not next((e.knobs for e in ENGINES if e.name == p["engine"]), True):
        return engine
    lz, ly = p.get("local_size") or ("?", "?")
    passes = f" passes={'+'.join(map(str, p['passes']))}" if p.get("passes") else ""
    tiles = " input_local" if p.get("input_local") else ""
    return (f"{engine} width={p.get('vector_width') or 'auto'}{passes} unroll={p.get('unroll')} "
            f"rows={p.get('rows')}{tiles} work-group={lz}x{ly}")  # fmt: skip


def point_line(p: dict) -> str:
    """One timed candidate as a line of text."""
    if "error" in p:
        return f"{_knob_text(p)}: {p['error']}"
    return f"{_knob_text(p)}: {p['seconds'] * 1e3:.3f} ms, {p['gflops']:.1f} GFLOP/s"


def winner_line(record: dict) -> str:
    """The winner as a line of text."""
    w = record["winner"]
    untuned = w.get("untuned_gflops")
    gain = f", {w['gflops'] / untuned:.2f}x the untuned plan" if untuned else ""
    return f"{_knob_text(w)}: {w['gflops']:.1f} GFLOP/s{gain}"
