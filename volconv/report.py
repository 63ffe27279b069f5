"""The throughput record (docs/contract.md), per-stage seconds and how a run shows them.

`work_gflop` is the one definition of work (run, bench, validate and the record use it);
`throughput` makes the record stored on every output's root; `VolumeReport` is one input's
record plus seconds per stage; `summary_line`, `summary_table` and `report_json` show the
same numbers on a terminal and in ``--report FILE``. An unknown peak is NaN in the file, null in
JSON and "unknown" on screen, never a guess.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from volconv.errors import one_line

# Seconds per stage: host reading, the device's five (OpenCL profiling; convert: to the stored
# type), host writing, wall.
STAGES = ("read", "upload", "pad", "kernel", "convert", "download", "write", "wall")


def work_gflop(extents: Iterable[Sequence[int]], voxels: int) -> float:
    """The useful work of a bank over ``voxels`` output voxels, in GFLOP (docs/contract.md
    "Throughput"): 2 flops per multiply-add of each filter's own taps, ``2 * voxels *
    sum_k prod(extent_k)``, where ``extent_k`` is the filter's own extent before any padding
    to a common one. The same whatever path computes it."""
    taps = sum(math.prod(int(e) for e in extent) for extent in extents)
    return 2.0 * float(voxels) * taps / 1e9


def throughput(
    gflop: float,
    kernel_seconds: float,
    wall_seconds: float,
    peak_gflops: float | None,
    measured_peak_gflops: float | None = None,
    *,
    executed_gflop: float | None = None,
    engine: str = "fp32",
    kernel_bytes: float = 0.0,
    measured_bandwidth_gbps: float | None = None,
    unit_gflop: float = 0.0,
    unit_peak_gflops: float | None = None,
) -> dict[str, Any]:
    """The record the contract stores.

    ``gflop`` is the useful work (`work_gflop`) and ``gflops`` how fast it came; the fractions
    of peak count ``executed_gflop``, what the kernels actually computed (the padded bank on
    the direct path, fewer flops on a separable one), so they say how well the hardware was
    used. ``executed_gflop`` defaults to ``gflop``. Passes bound by memory (the separable
    ones) move ``kernel_bytes``: the record then holds the bandwidth they reached and its
    fraction of the device's measured copy bandwidth (NaN where none ran, or unknown).
    Tensor-core engines execute ``unit_gflop`` on those units (every MMA slot): beside the FP32
    peak, the record holds their peak and the fraction of it reached (NaN where none ran).
    """
    executed = float(gflop if executed_gflop is None else executed_gflop)
    gflops = gflop / kernel_seconds if kernel_seconds > 0 else math.nan
    executed_rate = executed / kernel_seconds if kernel_seconds > 0 else math.nan
    peak = math.nan if peak_gflops is None else float(peak_gflops)
    # beside it, as the contract says: what an FMA probe reached on this device (NaN: unknown)
    measured = math.nan if measured_peak_gflops is None else float(measured_peak_gflops)
    bandwidth = (
        kernel_bytes / kernel_seconds / 1e9 if kernel_bytes and kernel_seconds > 0 else math.nan
    )
    copy = math.nan if measured_bandwidth_gbps is None else float(measured_bandwidth_gbps)
    unit_peak = math.nan if unit_peak_gflops is None else float(unit_peak_gflops)
    unit_rate = unit_gflop / kernel_seconds if unit_gflop and kernel_seconds > 0 else math.nan
    return {
        "gflop": float(gflop),
        "executed_gflop": executed,
        "kernel_seconds": float(kernel_seconds),
        "wall_seconds": float(wall_seconds),
        "gflops": float(gflops),
        "peak_gflops": peak,
        "fraction_of_peak": executed_rate / peak if peak > 0 else math.nan,
        "measured_peak_gflops": measured,
        "fraction_of_measured_peak": executed_rate / measured if measured > 0 else math.nan,
        "engine": engine,
        "bandwidth_gbps": bandwidth,
        "fraction_of_bandwidth": bandwidth / copy if copy > 0 else math.nan,
        "unit_peak_gflops": unit_peak,
        "fraction_of_unit_peak": unit_rate / unit_peak if unit_peak > 0 else math.nan,
    }


def format_gflops(gflops: float | None) -> str:
    """``66.9 TFLOP/s``, ``332.8 GFLOP/s`` or ``unknown``: the one way volconv shows a rate."""
    if gflops is None or not math.isfinite(gflops):
        return "unknown"
    if gflops >= 1000:
        return f"{gflops / 1000:.1f} TFLOP/s"
    return f"{gflops:.1f} GFLOP/s"


def format_gflop(gflop: float) -> str:
    """An amount of work with three significant digits, so small volumes do not show 0.0."""
    if not math.isfinite(gflop):
        return "-"
    return f"{gflop:.3g}" if abs(gflop) < 1000 else f"{gflop:.0f}"  # never 1.23e+03


def write_json(doc: Any, path: str | Path) -> None:
    """Write ``doc`` as JSON to ``path`` atomically: a reader never sees half a file. The
    temporary file is created exclusively under a name nobody can predict."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_report(path: str | Path) -> bool:
    """Whether the regular file ``path`` holds a volconv report (`report_json`): a JSON
    document with ``volconv_version`` and ``inputs``, which a rerun may replace."""
    try:
        with open(path, "rb") as f:
            if f.read(1) != b"{":  # not JSON: a binary file is not parsed whole
                return False
            f.seek(0)
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "volconv_version" in doc and "inputs" in doc


@dataclass
class VolumeReport:
    """One input of a run: where it went, the throughput record and seconds per stage."""

    source: str
    output: str
    shape: tuple[int, ...]
    n_filters: int
    status: str  # "done" | "skipped" | "failed"
    dtype: str = ""
    extents: tuple[int, ...] = ()
    slab_depth: int = 0
    n_slabs: int = 0
    gflop: float = math.nan
    executed_gflop: float = math.nan
    kernel_seconds: float = math.nan
    wall_seconds: float = math.nan
    gflops: float = math.nan
    peak_gflops: float = math.nan
    fraction_of_peak: float = math.nan
    measured_peak_gflops: float = math.nan
    fraction_of_measured_peak: float = math.nan
    engine: str = ""
    bandwidth_gbps: float = math.nan
    fraction_of_bandwidth: float = math.nan
    unit_peak_gflops: float = math.nan
    fraction_of_unit_peak: float = math.nan
    reason: str = ""  # why an input was skipped or failed
    clipped: int = 0  # voxels a uint8 output could not hold (saturated, or NaN stored as 0)
    resumed_slabs: int = 0  # slabs kept from an interrupted run's partial output (not computed)
    stages: dict[str, float] = field(default_factory=dict)
    # Unix time the input's reading began; its wall (`wall_seconds`, ``stages["wall"]``) runs
    # from then to its last slab written. Inputs of a run overlap (one is read and computed
    # while the one before is written), so walls overlap; the run's own is `run_seconds`.
    started_at: float = math.nan
    worker: str = ""  # in a batch: the worker that ran it
    device: str = ""  # in a batch: that worker's device, in words

    @classmethod
    def skipped(
        cls, source: str, output: str, shape: tuple[int, ...], n: int, reason: str = ""
    ) -> VolumeReport:
        return cls(source, output, tuple(int(s) for s in shape), n, "skipped", reason=reason)

    @classmethod
    def failed(
        cls, source: str, output: str, shape: tuple[int, ...], n: int, reason: str
    ) -> VolumeReport:
        return cls(source, output, tuple(int(s) for s in shape), n, "failed", reason=reason)


def fmt_fraction(v: float) -> str:
    return f"{100 * v:.1f} %" if math.isfinite(v) else "unknown"


def fmt_seconds(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def summary_line(r: VolumeReport) -> str:
    """One line per volume: path, shape, N, seconds, useful GFLOP/s, fraction of peak of the
    executed work. Names are escaped (`one_line`): a newline in one never splits the line."""
    shape = "x".join(map(str, r.shape))
    source, output = one_line(r.source), one_line(r.output)
    if r.status == "skipped":
        why = one_line(r.reason or "is complete")
        return f"skipped {source}: {output} {why} (--overwrite recomputes it)"
    if r.status == "failed":
        return f"failed {source}: {one_line(r.reason)}"
    resumed = f", {r.resumed_slabs}/{r.n_slabs} slabs resumed" if r.resumed_slabs else ""
    return (
        f"done {source} ({shape} {r.dtype}, N={r.n_filters}, "
        f"{'x'.join(map(str, r.extents))}) -> {output}: {r.wall_seconds:.2f} s, "
        f"{format_gflops(r.gflops)} useful, {fmt_fraction(r.fraction_of_peak)} of peak "
        f"executed{resumed}"
    )


def _labels(reports: list[VolumeReport]) -> list[str]:
    """File names where they tell the inputs apart, else the paths as given (escaped)."""
    names = [Path(r.source).name for r in reports]
    names = names if len(set(names)) == len(names) else [r.source for r in reports]
    return [one_line(n) for n in names]


# The stages the table shows: the device's five (OpenCL profiling) summed as one column
DEVICE_STAGES = ("upload", "pad", "kernel", "convert", "download")
GAP = "  "


def other_seconds(stages: dict[str, float], wall: float) -> float:
    """The wall less reading, the device's stages and writing (0 where they overlapped more
    than the rest took): building kernels on a first run, opening, hashing and finishing the
    file, waiting for the input before."""
    busy = stages.get("read", 0.0) + stages.get("write", 0.0)
    busy += sum(stages.get(s, 0.0) for s in DEVICE_STAGES)
    return max(wall - busy, 0.0) if math.isfinite(wall) else math.nan


def _grid(head: list[tuple[str, str]], rows: list[tuple[str, list[str]]], width: int) -> list[str]:
    """Rows of a name and right-aligned cells under two-line headers, within ``width``
    columns: the name column takes what the numbers leave; a longer name gets a line of its
    own above its numbers (names are never cut or split, numbers never shortened)."""
    cells = [max(len(a), len(b), *(len(r[1][i]) for r in rows if i < len(r[1])))
             for i, (a, b) in enumerate(head)]  # fmt: skip
    numbers = sum(w + len(GAP) for w in cells)
    name_w = max(5, min(max(len(r[0]) for r in rows), width - numbers))

    def line(name: str, values: list[str]) -> str:
        values = values + [""] * (len(cells) - len(values))
        padded = "".join(GAP + v.rjust(w) for v, w in zip(values, cells, strict=True))
        return (name.ljust(name_w) + padded).rstrip()

    out = [line("", [a for a, _ in head])] if any(a for a, _ in head) else []
    out.append(line("input", [b for _, b in head]))
    out.append("-" * min(width, name_w + numbers))
    for name, values in rows:
        if len(name) > name_w:  # its own line, the numbers below it
            out.append(name)
            name = ""
        if values and len(values) < len(cells):  # a status word: left in the first cell
            out.append((name.ljust(name_w) + GAP + values[0]).rstrip())
        else:
            out.append(line(name, values))
    return out


def summary_table(
    reports: list[VolumeReport],
    device: str,
    peak_gflops: float | None,
    measured_peak_gflops: float | None = None,
    *,
    width: int = 80,
    run_seconds: float | None = None,
    start_seconds: float | None = None,
) -> str:
    """The run's table as text within ``width`` columns (80 and up; the name column gives
    way first): per input, the work (useful and executed) and the seconds per stage, which
    add up to the wall with ``other``; then what the columns count, the start before the
    first input (``start_seconds``) and the device with its peak."""
    peak = format_gflops(math.nan if peak_gflops is None else peak_gflops)
    measured = any(math.isfinite(r.measured_peak_gflops) for r in reports)
    done = [r for r in reports if r.status == "done"]
    # a total for several inputs, or for one where the run's wall is known: it holds what
    # no input's does (making the convolvers: a first run's kernel builds)
    total = totals(done) if len(done) > 1 or (done and run_seconds is not None) else None
    if total is not None and run_seconds is not None:
        total["stages"]["wall"] = run_seconds  # the run's own: inputs overlap
    labels = _labels(reports)

    work_head = [("GFLOP", "useful"), ("GFLOP/s", "useful"), ("GFLOP/s", "executed"),
                 ("of peak", "executed")]  # fmt: skip
    if measured:
        work_head.append(("of probe", "executed"))

    def work(rec: dict[str, Any] | VolumeReport) -> list[str]:
        get = rec.get if isinstance(rec, dict) else lambda k: getattr(rec, k)
        kernel = get("kernel_seconds")
        executed = get("executed_gflop") / kernel if kernel and kernel > 0 else math.nan
        row = [format_gflop(get("gflop")), _gflops_cell(get("gflops")), _gflops_cell(executed),
               fmt_fraction(get("fraction_of_peak"))]  # fmt: skip
        if measured:
            row.append(fmt_fraction(get("fraction_of_measured_peak")))
        return row

    time_head = [("", "read"), ("", "device"), ("", "write"), ("", "other"), ("", "wall")]

    def seconds(stages: dict[str, float]) -> list[str]:
        device_s = sum(stages.get(s, 0.0) for s in DEVICE_STAGES)
        return [fmt_seconds(stages.get("read", math.nan)), fmt_seconds(device_s),
                fmt_seconds(stages.get("write", math.nan)),
                fmt_seconds(other_seconds(stages, stages.get("wall", math.nan))),
                fmt_seconds(stages.get("wall", math.nan))]  # fmt: skip

    work_rows: list[tuple[str, list[str]]] = []
    time_rows: list[tuple[str, list[str]]] = []
    for r, label in zip(reports, labels, strict=True):
        if r.status != "done":
            work_rows.append((label, [r.status]))
            continue
        work_rows.append((label, work(r)))
        time_rows.append((label, seconds(r.stages)))
    if total is not None:
        work_rows.append(("total", work(total)))
        time_rows.append(("total", seconds(total["stages"])))

    lines = _grid(work_head, work_rows, width)
    if time_rows:
        lines += ["", *_grid(time_head, time_rows, width)]
    notes = [
        "useful: the bank's work as scipy.ndimage.convolve does it (2 x voxels x each "
        "filter's taps), over kernel time; executed: what the kernels ran (separable passes "
        "run fewer flops, padding more); of peak: executed GFLOP/s against the FP32 peak.",
    ]
    if time_rows:
        all_stages = total["stages"] if total is not None else done[0].stages
        parts = " + ".join(f"{s} {fmt_seconds(all_stages.get(s, 0.0))}" for s in DEVICE_STAGES)
        notes.append(
            f"device: {parts} (OpenCL profiling). read and write run beside the device; "
            "other is the wall less the three (building the kernels, on a first run, and the "
            "convolvers; opening, hashing and finishing files), 0 where they overlap."
        )
        if total is not None and run_seconds is not None:
            notes.append("total wall: the run's, from its start to its last input's end "
                         "(inputs overlap; making the convolvers included).")  # fmt: skip
    if start_seconds is not None and math.isfinite(start_seconds):
        notes.append(f"start: {fmt_seconds(start_seconds)} before the first input (imports, "
                     "the OpenCL driver and context, the pipeline and the inputs' headers "
                     "read, kernels planned).")  # fmt: skip
    for note in notes:
        lines += textwrap.wrap(note, width, break_long_words=False, break_on_hyphens=False)
    caption = f"on {one_line(device)}; FP32 peak {peak}"
    if measured_peak_gflops is not None:
        caption += f", measured by an FMA probe {format_gflops(measured_peak_gflops)}"
    lines += textwrap.wrap(caption, width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def _gflops_cell(v: float) -> str:
    return f"{v:.1f}" if math.isfinite(v) else "unknown"


def totals(done: list[VolumeReport]) -> dict[str, Any]:
    """The run's sums: GFLOP, seconds per stage; GFLOP/s over the summed kernel time."""
    gflop = sum(r.gflop for r in done)
    executed = sum(r.executed_gflop for r in done)
    stages = {s: sum(r.stages.get(s, 0.0) for r in done) for s in STAGES}
    peak = next((r.peak_gflops for r in done), math.nan)
    measured = next((r.measured_peak_gflops for r in done), math.nan)
    engines = sorted({r.engine for r in done if r.engine})
    record = throughput(gflop, stages["kernel"], stages["wall"], peak, measured,
                        executed_gflop=executed, engine=",".join(engines))  # fmt: skip
    return {**record, "stages": stages}


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def report_json(
    reports: list[VolumeReport], meta: dict[str, Any], path: str | Path | None = None
) -> dict[str, Any]:
    """The run as a JSON document (unknown numbers are null); written to ``path`` if given."""
    done = [r for r in reports if r.status == "done"]
    doc = {
        **meta,
        "stages": list(STAGES),
        "inputs": [asdict(r) for r in reports],
        "total": totals(done) if done else None,
    }
    doc = _jsonable(doc)
    if path is not None:
        write_json(doc, path)
    return doc
