"""Pipeline files: TOML -> one validated `Config` -> runs (SPEC.md "Pipeline file").

Everything a user can get wrong in a pipeline file is checked here, in `validate_config`, with a
message that names the file, the key and the value; `volconv.bank` checks each filter itself.
`plan_jobs` then opens every input's header, builds its bank and plans its convolution without
computing anything (what `volconv validate` prints), and `run` streams each input slab by slab:
a reader thread fetches the next slab's rows while the device works on this one, and the
writer's thread writes the previous one.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import signal
import string
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import numpy as np
import pyopencl as cl
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import volconv
from volconv.bank import BankError, Filter, build_bank, stack_kernels
from volconv.boundary import MODES
from volconv.device import NoDeviceError, list_devices, select_device
from volconv.engine import BankConvolver, native_volume
from volconv.io import InputError, Volume, expand_inputs, open_volume
from volconv.peak import measured_peak, theoretical_peak
from volconv.plan import MAX_FILTERS, Plan, make_plan
from volconv.report import (
    VolumeReport,
    report_json,
    summary_line,
    summary_table,
    throughput,
)
from volconv.writer import OutputError, ResponseWriter, compression_options, is_complete


class PipelineError(ValueError):
    """A mistake in a pipeline file or a ``--set``: the message names the file, key and value."""


# The errors that are the user's: the CLI turns them into exit status 2 and one line.
USER_ERRORS = (PipelineError, BankError, InputError, OutputError)

# Every valid key of every section; `validate_config` suggests the closest for a typo.
SCHEMA: dict[str, tuple[str, ...]] = {
    "input": ("paths",),
    "bank": ("size", "boundary", "cval", "filter"),
    "output": ("path", "dtype", "compression", "scale", "offset"),
    "run": ("device", "slab_depth"),
}
REQUIRED_SECTIONS = ("input", "bank")
OUTPUT_DTYPES = ("float32", "float16", "uint8")
DEFAULT_OUTPUT = "{stem}.volconv.h5"
TEMPLATE_FIELDS = ("stem", "parent")


@dataclass(frozen=True)
class Config:
    """A validated pipeline: what the file (after ``--set``) asks for."""

    source: Path  # the pipeline file
    base_dir: Path  # relative paths resolve against it: the pipeline file's folder
    text: str  # the TOML text stored in every output (normalised where --set changed it)
    data: dict[str, Any]  # the parsed TOML after --set
    paths: tuple[str, ...]
    size: int | list[int]
    boundary: str
    cval: float
    filters: tuple[dict[str, Any], ...]
    output: str  # template with {stem} and {parent}
    dtype: str
    compression: str
    scale: float
    offset: float
    device: str
    slab_depth: int | None
    device_from_cli: bool = False


# -- reading and --set --------------------------------------------------------------------
def load(path: str | Path, sets: Sequence[str] = (), *, device: str | None = None) -> Config:
    """Read, override (``--set``) and validate the pipeline file at ``path``."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"pipeline file not found: {path}")
    if not path.is_file():
        raise PipelineError(f"pipeline file is not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: cannot read the pipeline file ({e})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PipelineError(f"{path}: not valid TOML: {e}") from None
    if sets:
        for item in sets:
            keys, value = parse_set(item)
            _apply_set(data, keys, value, item)
        text = f"# {path.name} with --set {' --set '.join(sets)}\n" + dump_toml(data)
    cfg = validate_config(data, path, text)
    if device is not None:  # --device outranks [run] device; the stored text keeps the file's
        cfg = replace(cfg, device=device.strip(), device_from_cli=True)
    return cfg


_SET_KEY = re.compile(r"^[A-Za-z0-9_-]+(\[\d+\])?$")


def parse_set(item: str) -> tuple[list[str | int], Any]:
    """``section.key=value`` -> (key path, value); ``bank.filter[2].sigma`` indexes a filter.

    The value is read as a TOML value (``3``, ``1.5``, ``[1, 2, 3]``, ``"text"``, ``true``),
    else taken as the string it is (``--set input.paths=scan.nii.gz``).
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) < 2 or not all(_SET_KEY.match(p) for p in parts):
        raise PipelineError(
            f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. --set bank.boundary=nearest"
        )
    path: list[str | int] = []
    for p in parts:
        name, _, index = p.partition("[")
        path.append(name)
        if index:
            path.append(int(index[:-1]))
    return path, parse_value(raw.strip())


def parse_value(raw: str) -> Any:
    """A TOML value, else the string itself."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_set(data: dict[str, Any], keys: list[str | int], value: Any, item: str) -> None:
    node: Any = data
    for i, k in enumerate(keys[:-1]):
        where = _dotted(keys[: i + 1])
        if isinstance(k, int):
            if not isinstance(node, list) or not 0 <= k < len(node):
                size = len(node) if isinstance(node, list) else 0
                raise PipelineError(f"--set {item!r}: {where} does not exist ({size} entries)")
            node = node[k]
        else:
            if not isinstance(node, dict):
                raise PipelineError(f"--set {item!r}: {_dotted(keys[:i])} is not a table")
            node = node.setdefault(k, {})
    last = keys[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or not 0 <= last < len(node):
            raise PipelineError(f"--set {item!r}: {_dotted(keys)} does not exist")
        node[last] = value
    elif not isinstance(node, dict):
        raise PipelineError(f"--set {item!r}: {_dotted(keys[:-1])} is not a table")
    else:
        node[last] = value


def _dotted(keys: Iterable[str | int]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


# -- validation: the one place ------------------------------------------------------------
def _unknown(key: str, valid: Iterable[str], prefix: str = "") -> str:
    valid = list(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"valid: {', '.join(valid)}"
    return f"unknown key {prefix}{key} ({hint})"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_config(data: dict[str, Any], source: Path, text: str = "") -> Config:
    """Check every section and key of a parsed pipeline; `PipelineError` names what is wrong."""

    def fail(msg: str) -> PipelineError:
        return PipelineError(f"{source}: {msg}")

    for section, body in data.items():
        if section not in SCHEMA:
            close = difflib.get_close_matches(section, SCHEMA, n=1, cutoff=0.5)
            hint = f"did you mean [{close[0]}]?" if close else f"valid: {', '.join(SCHEMA)}"
            raise fail(f"unknown section [{section}] ({hint})")
        if not isinstance(body, dict):
            raise fail(f"{section} must be a table [{section}]; got {body!r}")
        for key in body:
            if key not in SCHEMA[section]:
                raise fail(_unknown(key, SCHEMA[section], f"{section}."))
    for section in REQUIRED_SECTIONS:
        if section not in data:
            raise fail(f"missing section [{section}]")
    inp, bank = data["input"], data["bank"]
    out, run = data.get("output", {}), data.get("run", {})

    # [input]
    if "paths" not in inp:
        raise fail('input.paths is missing: give files or globs, e.g. paths = ["scans/*.nii.gz"]')
    paths = inp["paths"]
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not all(isinstance(p, str) and p.strip() for p in paths):
        raise fail(f"input.paths must be a path or a list of paths; got {inp['paths']!r}")
    if not paths:
        raise fail("input.paths is empty")

    # [bank]; each filter is checked by volconv.bank.build_bank
    size = bank.get("size", 7)  # checked by build_bank, with the filters
    boundary = bank.get("boundary", "reflect")
    if boundary not in MODES:
        close = difflib.get_close_matches(str(boundary), MODES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise fail(f"bank.boundary = {boundary!r} is not one of {', '.join(MODES)}{hint}")
    cval = bank.get("cval", 0.0)
    if not _is_number(cval) or not math.isfinite(cval):
        raise fail(f"bank.cval must be a finite number; got {cval!r}")
    filters = bank.get("filter", [])
    if not isinstance(filters, list) or not all(isinstance(f, dict) for f in filters):
        raise fail("bank.filter must be an array of tables: [[bank.filter]]")
    if not filters:
        raise fail("bank.filter: the bank is empty; add at least one [[bank.filter]] table")
    try:  # every filter, at unit voxel size (inputs in mm are built again by plan_jobs)
        build_bank([dict(f) for f in filters], size, base_dir=source.resolve().parent)
    except BankError as e:
        raise fail(str(e)) from None

    # [output]
    template = out.get("path", DEFAULT_OUTPUT)
    if not isinstance(template, str) or not template.strip():
        raise fail(f"output.path must be a file path; got {template!r}")
    _check_template(template, fail)
    dtype = out.get("dtype", "float32")
    if dtype not in OUTPUT_DTYPES:
        raise fail(f"output.dtype = {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    compression = out.get("compression", "none")
    if not isinstance(compression, str):
        raise fail(f"output.compression must be a name such as gzip or lzf; got {compression!r}")
    try:
        compression_options(compression)
    except OutputError as e:
        raise fail(f"output.compression: {e}") from None
    for key in ("scale", "offset"):
        if key in out:
            v = out[key]
            if dtype != "uint8":
                raise fail(f'output.{key} applies to dtype = "uint8" only (dtype is {dtype!r})')
            if not _is_number(v) or not math.isfinite(v) or (key == "scale" and v == 0):
                what = "a finite non-zero number" if key == "scale" else "a finite number"
                raise fail(f"output.{key} must be {what}; got {v!r}")

    # [run]
    device = run.get("device", "auto")
    if not isinstance(device, str) or not device.strip():
        raise fail(f"run.device must be auto, gpu, cpu, a name fragment or 'p:d'; got {device!r}")
    slab_depth = run.get("slab_depth")
    if slab_depth is not None and (not _is_int(slab_depth) or slab_depth < 1):
        raise fail(f"run.slab_depth must be a positive integer; got {slab_depth!r}")

    return Config(
        source=source, base_dir=source.resolve().parent, text=text or dump_toml(data),
        data=data, paths=tuple(paths), size=size, boundary=boundary, cval=float(cval),
        filters=tuple(filters), output=template, dtype=dtype, compression=compression,
        scale=float(out.get("scale", 1.0)), offset=float(out.get("offset", 0.0)),
        device=device.strip(), slab_depth=slab_depth,
    )  # fmt: skip


def _check_template(template: str, fail: Callable[[str], PipelineError]) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise fail(f"output.path = {template!r}: {e} (write {{{{ and }}}} for braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            raise fail(
                f"output.path = {template!r}: unknown field {{{name}}}; "
                f"use {{stem}} (input file name without extensions) or {{parent}} (its folder)"
            )


# -- TOML out (the `pipeline` attribute after --set) ---------------------------------------
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k, ensure_ascii=False)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are TOML's too
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))  # dates and times: TOML's own, kept as text


def dump_toml(data: dict[str, Any]) -> str:
    """TOML text that `tomllib` reads back as ``data`` (tables, arrays of tables, values)."""
    lines: list[str] = []

    def table(prefix: str, body: dict[str, Any], header: str | None) -> None:
        scalars = {k: v for k, v in body.items() if not _is_table(v) and not _is_table_array(v)}
        if header is not None and (scalars or not body):
            lines.extend(["", header] if lines else [header])
        lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
        for k, v in body.items():
            name = f"{prefix}{_toml_key(k)}"
            if _is_table(v):
                table(f"{name}.", v, f"[{name}]")
            elif _is_table_array(v):
                for item in v:
                    table(f"{name}.", item, f"[[{name}]]")
                    if not item:
                        lines.extend(["", f"[[{name}]]"])

    table("", data, None)
    return "\n".join(lines) + "\n"


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


# -- planning: headers, banks, plans, outputs; no compute ---------------------------------
@dataclass
class Job:
    """One input: its volume (header open), bank, plan and output."""

    spec: str
    volume: Volume
    filters: list[Filter]
    kernels: np.ndarray  # (N, sx, sy, sz) float64, as applied
    plan: Plan
    output: Path
    complete: bool  # the output exists and is a complete volconv file

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.filters]

    @property
    def shape3(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.volume.shape[:3])  # type: ignore[return-value]

    @property
    def n_slabs(self) -> int:
        return self.plan.n_slabs * self.volume.n_frames


def choose_device(cfg: Config) -> cl.Device:
    """The device ``run.device`` (or ``--device``) names; naming one that is not there is
    the user's mistake, having no OpenCL device at all is not."""
    try:
        return select_device(cfg.device)
    except NoDeviceError as e:
        if cfg.device.lower() != "auto" and list_devices():
            where = "--device" if cfg.device_from_cli else f"{cfg.source}: run.device ="
            raise PipelineError(f"{where} {cfg.device!r}: {e}") from None
        raise


def output_path(cfg: Config, volume: Volume) -> Path:
    """``output.path`` for ``volume``, relative to the pipeline file's folder."""
    name = cfg.output.format(stem=volume.stem, parent=volume.parent)
    path = Path(name).expanduser()
    # normpath folds "pipelines/../out" into "out" for the messages (links are not resolved)
    return Path(os.path.normpath(path if path.is_absolute() else cfg.base_dir / path))


# Slabs per frame the pipeline aims for: with one slab nothing overlaps (read, then compute,
# then write); with several, reading slab i + 1, computing slab i and writing slab i - 1 run
# at once. Smaller slabs cost only the halo rows read twice and more launches.
STREAM_SLABS = 4
MIN_STREAM_DEPTH = 32


def streaming_depth(rows: int) -> int:
    """The slab depth the pipeline streams ``rows`` rows in (the plan's, where shallower)."""
    return max(MIN_STREAM_DEPTH, math.ceil(rows / STREAM_SLABS))


def plan_jobs(cfg: Config, device: cl.Device, *, overwrite: bool = False) -> list[Job]:
    """Open every input's header, build its bank, plan it and check its output path."""
    try:
        specs = expand_inputs(list(cfg.paths), cfg.base_dir)
    except InputError as e:
        raise PipelineError(f"{cfg.source}: input.paths: {e}") from None
    banks: dict[tuple[float, ...], tuple[list[Filter], np.ndarray]] = {}
    jobs: list[Job] = []
    seen: dict[Path, str] = {}
    for spec in specs:
        volume = open_volume(spec)
        voxel = tuple(float(v) for v in volume.voxel_size[:3])
        if voxel not in banks:  # sigma in mm depends on the voxel size
            try:
                filters = build_bank([dict(f) for f in cfg.filters], cfg.size, voxel_size=voxel,
                                     base_dir=cfg.base_dir)  # fmt: skip
            except BankError as e:
                raise PipelineError(f"{cfg.source}: {e} (for {spec})") from None
            if len(filters) > MAX_FILTERS:  # gabor entries count twice
                raise PipelineError(
                    f"{cfg.source}: bank.filter: {len(filters)} filters; one run takes at most "
                    f"{MAX_FILTERS} (a gabor entry makes two): split the bank into two pipelines"
                )
            banks[voxel] = filters, stack_kernels(filters)
        filters, kernels = banks[voxel]
        shape3 = tuple(int(s) for s in volume.shape[:3])
        try:
            plan = make_plan(
                shape3, native_volume(np.empty(0, volume.dtype)).dtype, kernels.shape[1:],
                kernels.shape[0], cfg.boundary, cfg.cval, device, slab_depth=cfg.slab_depth,
            )  # fmt: skip
            if cfg.slab_depth is None and plan.slab_depth > streaming_depth(plan.shape[0]):
                plan = replace(plan, slab_depth=streaming_depth(plan.shape[0]))
        except ValueError as e:
            raise PipelineError(f"{spec}: {e}") from None
        out = output_path(cfg, volume)
        if out in seen:
            raise PipelineError(
                f"{cfg.source}: output.path = {cfg.output!r} gives {out} for both {seen[out]} "
                f"and {spec}; use {{stem}} (and {{parent}})"
            )
        seen[out] = spec
        if out.resolve() == Path(volume.file).resolve():
            raise PipelineError(f"{cfg.source}: output.path = {cfg.output!r} is the input {spec}")
        if out.is_dir():
            raise PipelineError(f"output {out} is a folder (output.path = {cfg.output!r})")
        complete = out.exists() and is_complete(out)
        if out.exists() and not complete and not overwrite:
            raise PipelineError(
                f"output {out} exists and is not a complete volconv output; "
                "move it away or pass --overwrite"
            )
        jobs.append(Job(spec, volume, filters, kernels, plan, out, complete))
    return jobs


# -- running ------------------------------------------------------------------------------
@dataclass
class RunResult:
    device: cl.Device
    peak_gflops: float | None
    peak_how: str
    measured_peak_gflops: float | None
    reports: list[VolumeReport] = field(default_factory=list)


# Page-locked slab buffers per convolver: one the device downloads into while the writer
# holds up to two (its queue), so downloads run at the bus's speed rather than page-faulting
# fresh memory (2.5 GB/s on the H100 node).
PINNED_BUFFERS = 3


class _Convolvers:
    """One BankConvolver per (shape, dtype, bank), with its pinned slab buffers: reused for
    every frame and file."""

    def __init__(self, cfg: Config, device: cl.Device) -> None:
        self.cfg, self.device = cfg, device
        self._cache: dict[tuple[object, ...], tuple[BankConvolver, SimpleQueue]] = {}

    def get(self, job: Job) -> tuple[BankConvolver, SimpleQueue]:
        key = (job.shape3, np.dtype(job.volume.dtype).str, job.kernels.shape,
               job.kernels.tobytes())  # fmt: skip
        if key not in self._cache:
            conv = BankConvolver(
                job.kernels, job.shape3, job.volume.dtype, self.cfg.boundary, self.cfg.cval,
                device=self.device, slab_depth=job.plan.slab_depth,
            )  # fmt: skip
            buffers: SimpleQueue = SimpleQueue()
            for _ in range(PINNED_BUFFERS):
                buffers.put(conv.pinned_slab())
            self._cache[key] = conv, buffers
        return self._cache[key]


def run(
    cfg: Config,
    *,
    overwrite: bool = False,
    on_plan: Callable[[list[Job]], None] | None = None,
    on_slab: Callable[[Job], None] | None = None,
    on_volume: Callable[[VolumeReport], None] | None = None,
) -> RunResult:
    """Filter every input of ``cfg`` into its output file.

    ``on_plan`` sees the jobs before any compute (for a progress total), ``on_slab`` is called
    after each slab and ``on_volume`` with each input's report, skipped ones included.
    """
    device = choose_device(cfg)
    jobs = plan_jobs(cfg, device, overwrite=overwrite)
    peak = theoretical_peak(device)
    result = RunResult(device, peak.gflops, peak.how, measured_peak(device))  # probe: cached
    if on_plan:
        on_plan(jobs)
    convolvers = _Convolvers(cfg, device)
    with _ctrl_c_between_slabs(), ThreadPoolExecutor(2, thread_name_prefix="volconv-read") as pool:
        for job in jobs:
            if job.complete and not overwrite:
                report = VolumeReport.skipped(job.spec, str(job.output), job.volume.shape,
                                              len(job.filters))  # fmt: skip
            else:
                report = _run_job(cfg, job, overwrite, *convolvers.get(job), pool, result, on_slab)
            result.reports.append(report)
            if on_volume:
                on_volume(report)
    return result


_STOP = threading.Event()


@contextmanager
def _ctrl_c_between_slabs() -> Iterator[None]:
    """Ctrl-C stops the run at the next slab, where the writer removes its temporary file.

    Raised wherever Python happens to be, KeyboardInterrupt can be lost (inside a finaliser,
    which swallows it: seen with pyopencl's event and mapping finalisers) or land before the
    writer's clean-up is armed. A second Ctrl-C interrupts at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        _STOP.set()
        signal.signal(signal.SIGINT, previous)

    _STOP.clear()
    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if _STOP.is_set():  # after the last slab, before the next input: still an interruption
        raise KeyboardInterrupt


def device_name(device: cl.Device) -> str:
    return f"{device.name.strip()} ({device.platform.name.strip()})"


def _run_job(
    cfg: Config,
    job: Job,
    overwrite: bool,
    conv: BankConvolver,
    buffers: SimpleQueue,
    pool: ThreadPoolExecutor,
    peaks: RunResult,
    on_slab: Callable[[Job], None] | None,
) -> VolumeReport:
    t_start = time.perf_counter()
    volume = job.volume
    before = dict(conv.timings)
    sha: Future[str] = pool.submit(volume.sha256)  # the whole file once, beside the work
    frames = volume.n_frames
    four_d = len(volume.shape) == 4
    work = [(t, a, b) for t in range(frames) for a, b in conv.slabs()]
    read_seconds = 0.0

    def read(t: int, a: int, b: int) -> np.ndarray:
        nonlocal read_seconds
        t0 = time.perf_counter()
        rows = volume.read_rows(conv.source_rows(a, b), t)
        read_seconds += time.perf_counter() - t0
        return rows

    writer = ResponseWriter(
        job.output, tuple(volume.shape), job.names, job.kernels, dtype=cfg.dtype,
        compression=cfg.compression, scale=cfg.scale, offset=cfg.offset, boundary=cfg.boundary,
        cval=cfg.cval, slab_depth=conv.plan.slab_depth, overwrite=overwrite,
    )  # fmt: skip
    with writer:
        pending = pool.submit(read, *work[0])
        try:
            for i, (t, a, b) in enumerate(work):
                if _STOP.is_set():
                    raise KeyboardInterrupt
                rows = pending.result()
                if i + 1 < len(work):  # prefetch the next slab while the device works
                    pending = pool.submit(read, *work[i + 1])
                buffer = buffers.get()  # free once the writer has written it
                responses = conv.convolve_slab(a, b, rows, out=buffer[:, : b - a])
                del rows
                writer.write_slab(a, b, responses, frame=t if four_d else None,
                                  release=partial(buffers.put, buffer))  # fmt: skip
                if on_slab:
                    on_slab(job)
        finally:
            pending.cancel()
        stages = {k: conv.timings[k] - before[k] for k in ("upload", "pad", "kernel", "download")}
        record = throughput(
            gflop=conv.gflop * frames,
            kernel_seconds=stages["kernel"],
            wall_seconds=time.perf_counter() - t_start,
            peak_gflops=peaks.peak_gflops,
            measured_peak_gflops=peaks.measured_peak_gflops,
        )
        attrs = {
            "affine": np.asarray(volume.affine, np.float64),
            "voxel_size": np.asarray(volume.voxel_size, np.float64),
            "source": job.spec,
            "source_sha256": sha.result(),
            "pipeline": cfg.text,
            "volconv_version": volconv.__version__,
            "device": device_name(conv.device),
            **record,
        }
        path = writer.finish(attrs)
    wall = time.perf_counter() - t_start
    stages = {"read": read_seconds, **stages, "write": writer.write_seconds, "wall": wall}
    return VolumeReport(
        source=job.spec, output=str(path), shape=tuple(int(s) for s in volume.shape),
        dtype=str(np.dtype(volume.dtype)), n_filters=len(job.filters),
        extents=tuple(int(e) for e in job.kernels.shape[1:]), slab_depth=conv.plan.slab_depth,
        n_slabs=job.n_slabs, status="done", stages=stages, **{**record, "wall_seconds": wall},
    )  # fmt: skip


# -- what `volconv run` and `volconv validate` show ----------------------------------------
def run_and_report(
    cfg: Config, console: Console, *, overwrite: bool = False, report: str | Path | None = None
) -> RunResult:
    """`run` with a progress bar (on a terminal only), a line per volume and the final table;
    ``report`` also gets the table's numbers as JSON."""
    if report is not None and not Path(report).absolute().parent.is_dir():
        raise PipelineError(f"--report {report}: folder {Path(report).parent} does not exist")
    progress = _progress(console) if console.is_terminal else None
    task = None

    def on_plan(jobs: list[Job]) -> None:
        nonlocal task
        if progress is not None:
            todo = sum(j.n_slabs for j in jobs if overwrite or not j.complete)
            task = progress.add_task("slabs", total=todo)

    def on_slab(job: Job) -> None:
        if progress is not None and task is not None:
            progress.update(task, advance=1, description=job.volume.stem)

    def on_volume(r: VolumeReport) -> None:
        (progress.console if progress else console).print(
            summary_line(r), highlight=False, soft_wrap=True
        )

    with progress or nullcontext():
        result = run(cfg, overwrite=overwrite, on_plan=on_plan, on_slab=on_slab,
                     on_volume=on_volume)  # fmt: skip
    name = device_name(result.device)
    table = summary_table(result.reports, name, result.peak_gflops, result.measured_peak_gflops)
    _wide(console).print(table)
    if report is not None:
        meta = {
            "pipeline": str(cfg.source), "volconv_version": volconv.__version__,
            "device": name, "peak_gflops": result.peak_gflops, "peak_how": result.peak_how,
            "measured_peak_gflops": result.measured_peak_gflops,
        }  # fmt: skip
        report_json(result.reports, meta, report)
    return result


def _wide(console: Console) -> Console:
    """``console``, or off a terminal (logs, pipes), where rich assumes 80 columns, one as
    wide as the summary table needs."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=max(console.width, 150), color_system=None)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("slabs"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    )  # fmt: skip


def show_plan(cfg: Config, console: Console, *, overwrite: bool = False) -> list[Job]:
    """Check the pipeline, its bank and every input (headers only) and print the plan."""
    device = choose_device(cfg)
    jobs = plan_jobs(cfg, device, overwrite=overwrite)
    peak = theoretical_peak(device)
    first = jobs[0]
    console.print(f"[bold]pipeline[/bold] {cfg.source}", highlight=False)
    console.print(f"[bold]device[/bold]   {device_name(device)}, FP32 peak {peak}",
                  highlight=False, soft_wrap=True)  # fmt: skip
    console.print(
        f"[bold]bank[/bold]     N = {len(first.filters)}, boundary {cfg.boundary}"
        + (f" (cval {cfg.cval:g})" if cfg.boundary == "constant" else "")
        + f": {', '.join(first.names)}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"[bold]output[/bold]   {cfg.dtype}, compression {cfg.compression}"
        + (f", value = stored * {cfg.scale:g} + {cfg.offset:g}" if cfg.dtype == "uint8" else ""),
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"[bold]inputs[/bold]   {len(jobs)}", highlight=False)
    for job in jobs:
        if job.complete:
            state = "complete: recomputed" if overwrite else "complete: skipped"
        elif job.output.exists():
            state = "exists: replaced"
        else:
            state = "new"
        shape = "x".join(map(str, job.volume.shape))
        extents = "x".join(map(str, job.kernels.shape[1:]))
        gflop = (
            2 * len(job.filters) * math.prod(job.kernels.shape[1:]) * math.prod(job.volume.shape)
        )
        console.print(
            f"  {job.spec}  {shape} {np.dtype(job.volume.dtype)}\n"
            f"    -> {job.output} ({state})\n"
            f"    kernels {extents}, {gflop / 1e9:.1f} GFLOP, slab depth {job.plan.slab_depth} "
            f"({job.n_slabs} slabs), device memory {job.plan.device_bytes / 2**20:.1f} MiB",
            highlight=False, soft_wrap=True,
        )  # fmt: skip
    return jobs
