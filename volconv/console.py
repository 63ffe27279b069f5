"""What `volconv run` and `volconv validate` show: the plan, a progress bar, a line per
input and the final table (numbers from `volconv.report`, work from `volconv.run.jobs`)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console

import volconv
from volconv.config import Config, PipelineError
from volconv.device.devices import device_name
from volconv.errors import MidRunError, one_line
from volconv.plan.separable import describe_plan
from volconv.report import (
    VolumeReport,
    fmt_seconds,
    format_gflop,
    format_gflops,
    report_json,
    summary_line,
    summary_table,
)
from volconv.run.convolvers import RunResult, peaks
from volconv.run.jobs import USER_ERRORS, Job, choose_device, plan_jobs
from volconv.run.pipeline import run
from volconv.run.resume import recorded_slabs

if TYPE_CHECKING:
    from collections.abc import Iterator

    from rich.progress import Progress

    from volconv.run.batch import BatchResult


_stderr = Console(stderr=True)  # warnings: the output of a run is its files and stdout's lines


@contextmanager
def _mid_run(planned: list[bool]) -> Iterator[None]:
    """Mistakes raised once ``planned[0]`` (the work began) become `MidRunError`."""
    try:
        yield
    except USER_ERRORS as e:
        if not planned[0]:
            raise
        raise MidRunError(str(e)) from e


def table_width(console: Console) -> int:
    """The columns the final table may take: the terminal's, or rich's 80 (``COLUMNS`` where
    set) off a terminal; never under 80."""
    return max(console.width, 80)


def run_and_report(
    cfg: Config,
    console: Console,
    *,
    overwrite: bool = False,
    report: str | Path | None = None,
    since: float | None = None,
) -> RunResult | BatchResult:
    """`volconv.run.pipeline.run` with a progress bar (on a terminal only), a line per input and
    the final table; ``report`` also gets the table's numbers as JSON. With ``run.devices``
    or ``run.scheduler``, `volconv.run.batch.run_batch` runs it (`batch_and_report`). ``since``,
    the `time.perf_counter` the command started at, gives the table's ``start`` line."""
    if report is not None and not Path(report).absolute().parent.is_dir():
        raise PipelineError(f"--report {report}: folder {Path(report).parent} does not exist")
    if cfg.devices != "one" or cfg.scheduler:
        return batch_and_report(cfg, console, overwrite=overwrite, report=report, since=since)
    progress = _progress(console) if console.is_terminal else None
    task = None
    planned = [False]

    def on_plan(jobs: list[Job]) -> None:
        nonlocal task
        planned[0] = True
        if progress is not None:
            todo = sum(j.n_slabs for j in jobs if overwrite or not j.complete)
            task = progress.add_task("slabs", total=todo)

    announced: set[int] = set()

    def on_slab(job: Job) -> None:
        if job.resumed and id(job) not in announced:  # once, as its first slabs count
            announced.add(id(job))
            (progress.console if progress else console).print(
                f"resuming {one_line(str(job.output))} at slab {job.resumed + 1}/{job.n_slabs} "
                f"({job.resumed} complete in an interrupted run's partial file)",
                highlight=False, markup=False, soft_wrap=True,
            )  # fmt: skip
        if progress is not None and task is not None:
            progress.update(task, advance=1, description=one_line(job.volume.stem))

    warned = False

    def on_volume(r: VolumeReport) -> None:
        nonlocal warned
        out = progress.console if progress else console
        out.print(summary_line(r), highlight=False, markup=False, soft_wrap=True)
        if r.clipped and not warned:  # once a run: the cure is the same for every input
            warned = True
            # on stderr; above the progress bar on a terminal, where both streams show
            why = (f"with scale {cfg.scale:g} and offset {cfg.offset:g} (saturated; NaN as 0); "
                   "set output.scale and output.offset to the responses' range, or "
                   'output.scale = "auto"')  # fmt: skip
            if cfg.scale_auto:  # its bound holds every finite response: these are inf or NaN
                why = "(saturated; NaN as 0): the input holds infinite or NaN values"
            (progress.console if progress else _stderr).print(
                f"warning: {r.clipped} voxels of {one_line(r.output)} fall outside what uint8 "
                f"holds {why}",
                highlight=False, markup=False, soft_wrap=True,
            )  # fmt: skip

    with progress or nullcontext(), _mid_run(planned):
        result = run(cfg, overwrite=overwrite, report=report, on_plan=on_plan,
                     on_slab=on_slab, on_volume=on_volume)  # fmt: skip
    start = _start_seconds(since, result.seconds)
    name = device_name(result.device)
    table = summary_table(result.reports, name, result.peak_gflops, result.measured_peak_gflops,
                          width=table_width(console), run_seconds=result.seconds,
                          start_seconds=start)  # fmt: skip
    console.print(table, highlight=False, markup=False, soft_wrap=True)
    if report is not None:
        meta = {
            "pipeline": str(cfg.source), "volconv_version": volconv.__version__,
            "device": name, "peak_gflops": result.peak_gflops, "peak_how": result.peak_how,
            "measured_peak_gflops": result.measured_peak_gflops,
            "run_seconds": result.seconds, "start_seconds": start,
        }  # fmt: skip
        report_json(result.reports, meta, report)
    return result


def _start_seconds(since: float | None, run_seconds: float) -> float | None:
    """Seconds from the command's start to the run's first input (it ended just now)."""
    if since is None:
        return None
    return max(time.perf_counter() - run_seconds - since, 0.0)


def batch_and_report(
    cfg: Config,
    console: Console,
    *,
    overwrite: bool = False,
    report: str | Path | None = None,
    since: float | None = None,
) -> BatchResult:
    """`volconv.run.batch.run_batch` with one progress bar over the inputs (on a terminal only),
    a line per input as it finishes and the final table of every input."""
    from volconv.run.batch import run_batch

    progress = _progress(console, "inputs") if console.is_terminal else None
    task = None

    def say(text: str) -> None:
        (progress.console if progress else console).print(
            text, highlight=False, markup=False, soft_wrap=True
        )

    planned = [False]

    def on_plan(jobs: list[Job]) -> None:
        nonlocal task
        planned[0] = True
        if progress is not None:
            task = progress.add_task("inputs", total=len(jobs))

    def on_volume(r: VolumeReport) -> None:
        say(summary_line(r))
        if progress is not None and task is not None:
            progress.update(task, advance=1)

    with progress or nullcontext(), _mid_run(planned):
        result = run_batch(cfg, overwrite=overwrite, report=report, on_plan=on_plan,
                           on_volume=on_volume, say=say)  # fmt: skip
    start = _start_seconds(since, result.seconds)
    done = [r for r in result.reports if r.status == "done"]
    peak = next((r.peak_gflops for r in done), None)
    measured = next((r.measured_peak_gflops for r in done), None)
    table = summary_table(result.reports, result.label, peak, measured,
                          width=table_width(console), run_seconds=result.seconds,
                          start_seconds=start)  # fmt: skip
    say(table)
    say(result.summary())  # what became of every input, the time and the workers
    if report is not None:
        meta = {
            "pipeline": str(cfg.source), "volconv_version": volconv.__version__,
            "device": result.label, "workers": result.workers, "peak_gflops": peak,
            "measured_peak_gflops": measured, "batch_seconds": result.seconds,
            "batch_start_seconds": result.start_seconds, "start_seconds": start,
            "worker_ready_seconds": result.ready_seconds, "in_process": result.in_process,
        }  # fmt: skip
        report_json(result.reports, meta, report)
    return result


def _progress(console: Console, unit: str = "slabs") -> Progress:
    from rich.progress import (  # on a terminal only
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn(unit), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, transient=True,
        # volconv's console writes to sys.stdout itself: a redirect would loop back into it
        redirect_stdout=False, redirect_stderr=False,
    )  # fmt: skip


def show_plan(cfg: Config, console: Console, *, overwrite: bool = False) -> list[Job]:
    """Check the pipeline, its bank and every input (headers only) and print the plan."""
    device = choose_device(cfg)
    jobs = plan_jobs(cfg, device, overwrite=overwrite)
    peak, how, measured, *_ = peaks(device)
    first = jobs[0]
    total_bytes, total_kernel, total_write, computed = 0, 0.0, 0.0, 0

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    say(f"pipeline {cfg.source}")
    say(f"device   {device_name(device)}, FP32 peak {format_gflops(peak)} ({how})")
    cval = f" (cval {cfg.cval:g})" if cfg.boundary == "constant" else ""
    say(f"bank     N = {len(first.outputs)}, boundary {cfg.boundary}{cval}")
    names = [f"{f.name} ({f.type})" for f in first.run_filters]
    say(describe_plan(first.plan.choices, names, first.plan.fused))
    for feature in first.expanded.features:  # volconv.bank.features: each with its parameters
        say(f"feature  {feature.describe()}")
    scaled = f", value = stored * {cfg.scale:g} + {cfg.offset:g}" if cfg.dtype == "uint8" else ""
    if cfg.scale_auto:  # each input's own, from its type's range and the bank
        scaled = ", scale auto (each input's below)"
    say(f"output   {cfg.dtype}, compression {cfg.compression}{scaled}")
    say(f"inputs   {len(jobs)}")
    for job in jobs:
        if job.complete:
            state = "complete: recomputed" if overwrite else "complete: skipped"
        elif job.output.exists():
            state = "exists: replaced"
        else:
            state = "new"
        if not job.complete and not overwrite and (slabs := recorded_slabs(job.output)):
            state += f"; an interrupted run's partial with {slabs} slabs resumes if it matches"
        shape = "x".join(map(str, job.volume.shape))
        extents = "x".join(map(str, job.kernels.shape[1:]))
        size = output_bytes(job, cfg.dtype) if overwrite or not job.complete else 0
        if size:
            computed += 1
            total_bytes += size
            total_kernel += kernel_seconds(job, measured or peak)
            total_write += size / DISK_BYTES_PER_S
        say(
            f"  {one_line(job.spec)}  {shape} {np.dtype(job.volume.dtype)}\n"
            f"    -> {one_line(str(job.output))} ({state}), writes {_bytes(size)}\n"
            f"    kernels {extents}, {format_gflop(job.gflop)} GFLOP, slab depth "
            f"{job.plan.slab_depth} ({job.n_slabs} slabs), device memory "
            f"{job.device_bytes / 2**20:.1f} MiB, host memory "
            f"{job.host_bytes / 2**20:.1f} MiB of {cfg.host_memory / 2**20:.0f} MiB"
            f"{', frames read whole' if job.whole_frames else ''}"
            + (f", value = stored * {job.scale:g} + {job.offset:g}" if cfg.scale_auto else "")
        )
    packed = "" if cfg.compression == "none" else f", before {cfg.compression} compression"
    say(f"writes   {_bytes(total_bytes)} in all for {computed} output(s){packed}")
    if computed:
        rate = format_gflops(measured or peak)
        source = "the FMA probe's, cached" if measured else how
        say(
            f"estimate about {fmt_seconds(max(total_kernel, total_write))}: writing at "
            f"{DISK_BYTES_PER_S / 1e6:.0f} MB/s (assumed: a SATA SSD; NVMe and the page cache "
            f"are faster, a network disk slower) {fmt_seconds(total_write)}, beside kernels at "
            f"{rate} ({source}) {fmt_seconds(total_kernel)}; not counting reading the inputs, "
            "compression, or building the kernels on a first run"
        )
    return jobs


# The disk rate `volconv validate` assumes for its estimate: a SATA SSD's sequential write
DISK_BYTES_PER_S = 500e6


def output_bytes(job: Job, dtype: str) -> int:
    """The bytes of an input's outputs as stored, uncompressed: N (the responses and the
    features' volumes) x voxels x the type's."""
    return len(job.outputs) * math.prod(job.volume.shape) * np.dtype(dtype).itemsize


def kernel_seconds(job: Job, gflops: float | None) -> float:
    """The kernels' time for an input at ``gflops``: the plan's cost per voxel of each
    filter's chosen path (in direct taps, two flops each) and the stages' beside it
    (`Expanded.stage_taps`), over every voxel; 0 if unknown."""
    if not gflops or not math.isfinite(gflops):
        return 0.0
    taps = sum(c.direct_cost if c.path == "direct" else c.separable_cost
               for c in job.plan.choices) + job.expanded.stage_taps()  # fmt: skip
    return 2.0 * taps * math.prod(job.volume.shape) / (gflops * 1e9)


def _bytes(n: int) -> str:
    """``3,271,557,120 bytes (3.05 GiB)``: exact, and at a glance."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} bytes ({n / size:.2f} {unit})"
    return f"{n:,} bytes"
