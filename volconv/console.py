"""What `volconv run` and `volconv validate` show: the plan, a progress bar, a line per
input and the final table (numbers from `volconv.report`, work from `volconv.pipeline`)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console

import volconv
from volconv.config import Config, PipelineError
from volconv.device import device_name
from volconv.pipeline import Job, RunResult, choose_device, peaks, plan_jobs, run
from volconv.report import (
    VolumeReport,
    format_gflop,
    format_gflops,
    report_json,
    summary_line,
    summary_table,
)
from volconv.resume import recorded_slabs
from volconv.separable import describe_plan

if TYPE_CHECKING:
    from rich.progress import Progress

    from volconv.batch import BatchResult


_stderr = Console(stderr=True)  # warnings: the output of a run is its files and stdout's lines


def run_and_report(
    cfg: Config, console: Console, *, overwrite: bool = False, report: str | Path | None = None
) -> RunResult | BatchResult:
    """`volconv.pipeline.run` with a progress bar (on a terminal only), a line per input and
    the final table; ``report`` also gets the table's numbers as JSON. With ``run.devices``
    or ``run.scheduler``, `volconv.batch.run_batch` runs it (`batch_and_report`)."""
    if report is not None and not Path(report).absolute().parent.is_dir():
        raise PipelineError(f"--report {report}: folder {Path(report).parent} does not exist")
    if cfg.devices != "one" or cfg.scheduler:
        return batch_and_report(cfg, console, overwrite=overwrite, report=report)
    progress = _progress(console) if console.is_terminal else None
    task = None

    def on_plan(jobs: list[Job]) -> None:
        nonlocal task
        if progress is not None:
            todo = sum(j.n_slabs for j in jobs if overwrite or not j.complete)
            task = progress.add_task("slabs", total=todo)

    announced: set[int] = set()

    def on_slab(job: Job) -> None:
        if job.resumed and id(job) not in announced:  # once, as its first slabs count
            announced.add(id(job))
            (progress.console if progress else console).print(
                f"resuming {job.output} at slab {job.resumed + 1}/{job.n_slabs} "
                f"({job.resumed} complete in an interrupted run's partial file)",
                highlight=False, markup=False, soft_wrap=True,
            )  # fmt: skip
        if progress is not None and task is not None:
            progress.update(task, advance=1, description=job.volume.stem)

    warned = False

    def on_volume(r: VolumeReport) -> None:
        nonlocal warned
        out = progress.console if progress else console
        out.print(summary_line(r), highlight=False, markup=False, soft_wrap=True)
        if r.clipped and not warned:  # once a run: the cure is the same for every input
            warned = True
            # on stderr; above the progress bar on a terminal, where both streams show
            (progress.console if progress else _stderr).print(
                f"warning: {r.clipped} voxels of {r.output} fall outside what uint8 holds "
                f"with scale {cfg.scale:g} and offset {cfg.offset:g} (saturated; NaN as 0); "
                "set output.scale and output.offset to the responses' range",
                highlight=False, markup=False, soft_wrap=True,
            )  # fmt: skip

    with progress or nullcontext():
        result = run(cfg, overwrite=overwrite, report=report, on_plan=on_plan,
                     on_slab=on_slab, on_volume=on_volume)  # fmt: skip
    name = device_name(result.device)
    table = summary_table(result.reports, name, result.peak_gflops, result.measured_peak_gflops)
    wide(console).print(table)
    if report is not None:
        meta = {
            "pipeline": str(cfg.source), "volconv_version": volconv.__version__,
            "device": name, "peak_gflops": result.peak_gflops, "peak_how": result.peak_how,
            "measured_peak_gflops": result.measured_peak_gflops,
            "run_seconds": result.seconds,
        }  # fmt: skip
        report_json(result.reports, meta, report)
    return result


def batch_and_report(
    cfg: Config, console: Console, *, overwrite: bool = False, report: str | Path | None = None
) -> BatchResult:
    """`volconv.batch.run_batch` with one progress bar over the inputs (on a terminal only),
    a line per input as it finishes and the final table of every input."""
    from volconv.batch import run_batch

    progress = _progress(console, "inputs") if console.is_terminal else None
    task = None

    def say(text: str) -> None:
        (progress.console if progress else console).print(
            text, highlight=False, markup=False, soft_wrap=True
        )

    def on_plan(jobs: list[Job]) -> None:
        nonlocal task
        if progress is not None:
            task = progress.add_task("inputs", total=len(jobs))

    def on_volume(r: VolumeReport) -> None:
        say(summary_line(r))
        if progress is not None and task is not None:
            progress.update(task, advance=1)

    with progress or nullcontext():
        result = run_batch(cfg, overwrite=overwrite, report=report, on_plan=on_plan,
                           on_volume=on_volume, say=say)  # fmt: skip
    done = [r for r in result.reports if r.status == "done"]
    peak = next((r.peak_gflops for r in done), None)
    measured = next((r.measured_peak_gflops for r in done), None)
    wide(console).print(summary_table(result.reports, result.label, peak, measured))
    if done:
        say(f"{len(done)} input(s) in {result.seconds:.1f} s on {result.label}: "
            f"{60 * len(done) / result.seconds:.1f} inputs/minute (and "
            f"{result.start_seconds:.1f} s to start)")  # fmt: skip
    if report is not None:
        meta = {
            "pipeline": str(cfg.source), "volconv_version": volconv.__version__,
            "device": result.label, "workers": result.workers, "peak_gflops": peak,
            "measured_peak_gflops": measured, "batch_seconds": result.seconds,
            "batch_start_seconds": result.start_seconds,
        }  # fmt: skip
        report_json(result.reports, meta, report)
    return result


def wide(console: Console) -> Console:
    """``console``, or off a terminal (logs, pipes), where rich assumes 80 columns, one as
    wide as the summary table needs."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=max(console.width, 200), color_system=None)


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
    peak, how, *_ = peaks(device)
    first = jobs[0]

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    say(f"pipeline {cfg.source}")
    say(f"device   {device_name(device)}, FP32 peak {format_gflops(peak)} ({how})")
    cval = f" (cval {cfg.cval:g})" if cfg.boundary == "constant" else ""
    say(f"bank     N = {len(first.outputs)}, boundary {cfg.boundary}{cval}")
    names = [f"{f.name} ({f.type})" for f in first.run_filters]
    say(describe_plan(first.plan.choices, names, first.plan.fused))
    for feature in first.expanded.features:  # volconv.features: each with its parameters
        say(f"feature  {feature.describe()}")
    scaled = f", value = stored * {cfg.scale:g} + {cfg.offset:g}" if cfg.dtype == "uint8" else ""
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
        say(
            f"  {job.spec}  {shape} {np.dtype(job.volume.dtype)}\n"
            f"    -> {job.output} ({state})\n"
            f"    kernels {extents}, {format_gflop(job.gflop)} GFLOP, slab depth "
            f"{job.plan.slab_depth} ({job.n_slabs} slabs), device memory "
            f"{job.device_bytes / 2**20:.1f} MiB, host memory "
            f"{job.host_bytes / 2**20:.1f} MiB of {cfg.host_memory / 2**20:.0f} MiB"
            f"{', frames read whole' if job.whole_frames else ''}"
        )
    return jobs
