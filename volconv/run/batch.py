"""Batch: one pipeline's inputs over several devices of this machine (``--devices``), or
over a Dask cluster (``--scheduler``: volconv.run.cluster).

`run_batch` plans and checks the whole pipeline once here, so a user's mistake exits 2 before
any work. On one machine this process then filters on the first device from the start, taking
the inputs largest first from one queue (volconv.run.pool's `Pending`), while a plain worker
process per other device (volconv.run.pool, volconv.run.workers), started before the plan,
warms up for the first input and, once ready, takes inputs from the same queue. How many
workers start is a model's choice (volconv.run.model): a batch too small to pay for starting
them runs in this process alone, as one device would; where writing an input takes longer
than its device's work (the host, not the device, limits), each device gets two processes.
Every record is gathered: done, skipped or failed.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyopencl as cl

from volconv.config import Config, PipelineError
from volconv.device.devices import (
    NoDeviceError,
    device_name,
    every_device,
    list_devices,
    select_device,
)
from volconv.device.programs import start_context
from volconv.output import remove_stale_temps
from volconv.report import VolumeReport
from volconv.run.convolvers import Convolvers, RunResult, peaks
from volconv.run.inputs import expand_inputs
from volconv.run.interrupts import Interrupted, interruptible, stop_on_ctrl_c
from volconv.run.jobs import Job, plan_jobs
from volconv.run.model import (
    START_ENV,
    input_seconds,
    pace,
    pool_cost,
    processes_asked,
    processes_for,
    remember_pace,
    remember_start,
    start_cost,
    workers_for,
)
from volconv.run.pipeline import run_overlapped
from volconv.run.pool import Pending, Pool
from volconv.run.spawn import Worker, close_early, early_workers
from volconv.run.volume import InputError
from volconv.run.workers import plan_one


@dataclass
class BatchResult:
    """Every input's record, in the pipeline's order, and where and how fast they ran."""

    workers: list[str]  # each worker's device, in words ([] where none started)
    reports: list[VolumeReport] = field(default_factory=list)
    start_seconds: float = 0.0  # to start the local workers, or to connect to the scheduler
    seconds: float = 0.0  # from the first task submitted to the last record
    ready_seconds: float | None = None  # until the last local worker was warm (`warm_up`)
    devices: list[str] = field(default_factory=list)  # the devices the batch could use
    n_devices: int = 0  # distinct devices among them (processes may share one)
    in_process: bool = False  # run in this process alone, on the first device (`workers_for`)
    here: bool = False  # this process filtered on the first device (a local batch)
    why: str = ""  # the model's reason for the workers used
    scheduler: str = ""  # the scheduler's address, where the batch went to one

    @property
    def failed(self) -> list[VolumeReport]:
        return [r for r in self.reports if r.status == "failed"]

    @property
    def label(self) -> str:
        """``2 worker(s): NVIDIA H200 (NVIDIA CUDA) x2``, or where the batch ran without."""
        if self.in_process or (self.here and len(self.workers) == 1):
            return f"this process: {self.workers[0]}"
        if self.here:
            on = f" on {self.n_devices} device(s)" if self.n_devices else ""
            return (f"this process and {len(self.workers) - 1} worker(s){on}: "
                    f"{_count(self.workers)}")  # fmt: skip
        if not self.workers and self.scheduler:
            return f"scheduler {self.scheduler}: no worker asked"
        if not self.workers:
            devices = _count(self.devices)
            return f"no worker started{f' (devices: {devices})' if devices else ''}"
        return f"{len(self.workers)} worker(s): {_count(self.workers)}"

    def summary(self) -> str:
        """The batch's last line: what became of every input, the time and the workers."""
        counts = collections.Counter(r.status for r in self.reports)
        parts = [f"{counts[s]} {s}" for s in ("done", "skipped", "failed") if counts[s]]
        head = f"{len(self.reports)} input(s): {', '.join(parts) or 'none'}"
        if not counts["done"] and not counts["failed"]:
            return f"{head}; nothing to run: {self.label}"
        line = f"{head} in {self.seconds:.1f} s on {self.label}"
        if counts["done"] and self.seconds > 0:
            line += f": {60 * counts['done'] / self.seconds:.1f} inputs/minute"
        if self.in_process:
            return f"{line} ({self.why})" if self.why else line
        if self.here and len(self.workers) == 1:  # its workers were not ready before the end
            return f"{line} (no worker ready before the last input)"
        ready = f", ready {self.ready_seconds:.1f} s" if self.ready_seconds is not None else ""
        return f"{line} (and {self.start_seconds:.1f} s to start{ready})"


def _count(names: list[str]) -> str:
    return ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names)))


def local_devices(cfg: Config) -> tuple[str, ...]:
    """The device spec of each local worker: ``devices = "all"`` is every GPU or accelerator
    of this machine (every device where it has none), a list is taken as it is; each repeated
    ``$VOLCONV_PROCESSES_PER_DEVICE`` times (default 1), the devices' first workers first."""
    if cfg.devices == "all":
        specs = every_device()
    else:
        for spec in cfg.devices:
            try:
                select_device(spec)
            except NoDeviceError as e:
                if not list_devices():
                    raise
                raise PipelineError(f"{cfg.source}: devices: {spec!r}: {e}") from None
        specs = tuple(cfg.devices)
    return specs


def process_specs(cfg: Config, devices: tuple[str, ...], job: Job, device: cl.Device,
                  peak_gflops: float | None) -> tuple[Config, tuple[str, ...]]:  # fmt: skip
    """The device spec of each process of a local batch (this one first) for inputs like
    ``job``: ``devices``, each `processes_for` times, the devices' first processes first; and
    the pipeline each process runs, its ``host_memory`` shared among a device's processes (one
    process per device where a share holds no slab of ``job``: planned again to tell)."""
    per = processes_for(cfg, devices, job, peak_gflops)
    if per == 1:
        return cfg, devices
    shared = replace(cfg, host_memory=cfg.host_memory // per)
    try:
        plan_one(shared, job.spec, device)
    except (PipelineError, OSError, ValueError):
        return cfg, devices
    return shared, devices * per


def starts(specs: tuple[str, ...], cost: float, early: list[Worker]) -> list[float]:
    """Seconds until each worker for ``specs`` after the first is ready: ``cost`` less what
    an early worker on its spec (one each) has done already."""
    now, unclaimed, left = time.time(), list(early), []
    for spec in specs[1:]:
        w = next((w for w in unclaimed if w.spec == spec), None)
        if w is not None:
            unclaimed.remove(w)
        left.append(max(0.0, cost - (now - w.started_at if w is not None else 0.0)))
    return left


def _input_specs(cfg: Config) -> list[str]:
    """The inputs' names, without opening them ([] where they are wrong: planning says)."""
    try:
        return expand_inputs(list(cfg.paths), cfg.base_dir)
    except (InputError, OSError, ValueError):
        return []


class _Signal(KeyboardInterrupt):
    """SIGTERM (or SIGINT) in the batch's client: stop as Ctrl-C does, exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signal.Signals(signum)


@contextmanager
def _signals() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise `_Signal` in the main thread while the batch runs (a second
    one falls back to the handler before)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        for s, old in zip(signums, previous, strict=True):
            signal.signal(s, old)
        raise _Signal(signum)

    previous = [signal.signal(s, handler) for s in signums]
    try:
        yield
    finally:
        for s, old in zip(signums, previous, strict=True):
            signal.signal(s, old)


def run_batch(
    cfg: Config,
    *,
    overwrite: bool = False,
    report: str | Path | None = None,
    on_plan: Callable[[list[Job]], None] | None = None,
    on_volume: Callable[[VolumeReport], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> BatchResult:
    """Filter every input of ``cfg`` on several devices or on a Dask cluster.

    The whole pipeline is planned and checked here first (a `PipelineError` before any task);
    complete outputs are skipped without a task; the others are submitted largest first, one
    task each. On this machine this process filters on the first device and the other
    devices' workers, started while it plans, as many as `workers_for` finds worth their
    start, take inputs from the same queue once ready. ``on_plan`` sees the jobs,
    ``on_volume`` each record as it comes (skipped ones first), ``say`` a line about the
    workers.
    """
    with _signals():
        if cfg.scheduler:
            from volconv.run.cluster import remote_batch

            return remote_batch(cfg, overwrite, report, on_plan, on_volume, say)
        return _local_batch(cfg, overwrite, report, on_plan, on_volume, say)


def to_run(jobs: list[Job], overwrite: bool) -> bool:
    """Whether any of ``jobs`` is not skipped as complete (`skip_complete`)."""
    return any(overwrite or not job.complete for job in jobs)


def skip_complete(
    jobs: list[Job], overwrite: bool, on_volume: Callable[[VolumeReport], None] | None
) -> dict[str, VolumeReport]:
    records: dict[str, VolumeReport] = {}
    for job in jobs:
        if job.complete and not overwrite:
            records[job.spec] = job.skipped()
            if on_volume:
                on_volume(records[job.spec])
    return records


OnPlan = Callable[[list[Job]], None] | None
OnVolume = Callable[[VolumeReport], None] | None
Say = Callable[[str], None] | None


def _local_batch(
    cfg: Config,
    overwrite: bool,
    report: str | Path | None,
    on_plan: OnPlan,
    on_volume: OnVolume,
    say: Say,
) -> BatchResult:
    devices = local_devices(cfg)
    processes_asked()  # a wrong count: exit 2 before any work
    planner = select_device(devices[0])  # this process plans, and filters, on the first device
    with suppress(Exception):  # its context made meanwhile (the command started it sooner)
        start_context(planner)
    device_names = {s: device_name(select_device(s)) for s in dict.fromkeys(devices)}
    cost, pool_seconds, my_pace = start_cost(), pool_cost(), pace()
    peak = peaks(planner)[0]
    early = early_workers()  # started as the command started (volconv.run.spawn)
    # Before planning, from the first input alone: start the other processes now, if worth it.
    pool: Pool | None = None
    specs: tuple[str, ...] | None = None
    inputs = _input_specs(cfg)
    if len(inputs) >= 2:
        with suppress(Exception):  # a mistake: the whole plan below says it
            first = plan_one(cfg, inputs[0], planner, overwrite=overwrite)
            seconds = [input_seconds(first, cfg, peak, my_pace)] * len(inputs)
            if first.complete and not overwrite:
                seconds = [0.0] * len(inputs)
            every = devices * processes_for(cfg, devices, first, peak)
            if workers_for(seconds, len(every), starts(every, cost, early), pool_seconds):
                cfg, specs = process_specs(cfg, devices, first, planner, peak)
                if w := workers_for(seconds, len(specs), starts(specs, cost, early),
                                    pool_seconds):  # fmt: skip
                    pool = Pool(specs[1 : 1 + w], (cfg, inputs[0]))
    try:
        jobs = plan_jobs(cfg, planner, overwrite=overwrite, report=report)
        if on_plan:
            on_plan(jobs)
        records = skip_complete(jobs, overwrite, on_volume)
        todo = [j for j in jobs if j.spec not in records]  # the pipeline's order
        result = BatchResult(workers=[], devices=[device_names[s] for s in devices],
                             n_devices=len(set(devices)))  # fmt: skip
        specs = specs or devices  # decided with the first input (and its plan)
        now = time.time()
        left = ([cost - (now - w.started_at) for w in pool.workers] if pool else
                starts(specs, cost, early))  # fmt: skip
        seconds = [input_seconds(j, cfg, peak, my_pace) for j in todo]
        w = workers_for(seconds, len(specs), left, pool_seconds)
        if pool and w == 0:
            pool.close()  # while this process runs the batch
            pool = None
        elif w and pool is None:
            pool = Pool(specs[1 : 1 + w], (cfg, todo[0].spec))
        close_early()  # those the batch did not take end on their own
        if todo:
            names = [device_names[s] for s in specs]
            result.workers, result.here = names[:1], True
            if pool is None:
                result.in_process = True
                alone = sum(seconds)
                result.why = (
                    f"{len(todo)} input(s), about {alone:.1f} s on one device: less than "
                    f"workers ready in {cost:.1f} s would save" if len(specs) > 1 else
                    "one device"
                )  # fmt: skip
            else:  # largest first: the last input to start is a small one
                todo.sort(key=lambda j: -j.gflop)
            _run_shared(cfg, todo, planner, records, overwrite, on_volume, say, pool, names,
                        result)  # fmt: skip
            if result.in_process:  # this process alone: the machine's pace, for the next
                remember_pace(cfg, [records[j.spec] for j in todo], result.seconds, peak)
        result.reports = [records[j.spec] for j in jobs]
        return result
    finally:
        close_early()
        if pool:
            pool.close()  # the pipes closed: each worker ends on its own; nobody waits


def _run_shared(
    cfg: Config,
    todo: list[Job],
    device: cl.Device,
    records: dict[str, VolumeReport],
    overwrite: bool,
    on_volume: OnVolume,
    say: Say,
    pool: Pool | None,
    names: list[str],
    result: BatchResult,
) -> None:
    """The inputs of ``todo``, taken in order by this process on ``device`` (from the start,
    as a one-device run: Ctrl-C and SIGTERM keep the partials) and by ``pool``'s workers
    as each is ready, each record naming the process or worker and its device."""
    pending = Pending(todo)
    lock = threading.Lock()  # records and on_volume: this process's runner and the workers'
    here, name = f"this process (pid {os.getpid()})", device_name(device)
    mine: list[Job] = []  # the inputs this process took, in order
    batch = uuid.uuid4().hex[:12]

    def record(job: Job, r: VolumeReport) -> None:
        with lock:
            records[job.spec] = r
            if on_volume:
                on_volume(r)

    def taken() -> Iterator[Job]:
        while (job := pending.take()) is not None:
            mine.append(job)
            yield job

    def seen(r: VolumeReport) -> None:
        record(mine[len(run.reports) - 1], replace(r, worker=here, device=name))

    def ready(worker: Worker) -> None:
        assert pool is not None
        with lock:
            if result.start_seconds:
                return
            result.start_seconds = time.perf_counter() - pool.began
            result.workers = names[: 1 + len(pool.specs)]
            if say:
                say(f"started {len(pool.specs)} worker(s), the first ready in "
                    f"{result.start_seconds:.1f} s, beside this process: "
                    f"{result.label}")  # fmt: skip

    if pool is not None:
        pool.feed(cfg, pending, overwrite, batch, record, say, ready)
    run = RunResult(device, *peaks(device))
    convolvers = Convolvers(cfg, device)
    start = time.perf_counter()
    try:
        while True:
            with stop_on_ctrl_c(run.reports, resumable=not overwrite):
                interruptible(run_overlapped, cfg, taken(), convolvers, run,
                              overwrite=overwrite, on_volume=seen)  # fmt: skip
            if not pending.more():
                break  # nothing pending or out on a worker: the batch is done
    except BaseException as e:
        if pool is not None:
            pool.stop_tasks(batch)
        if not isinstance(e, KeyboardInterrupt):
            raise
        done = sum(r.status != "failed" for r in records.values())
        error = Interrupted(
            f"interrupted: {done} output(s) complete and kept; those in progress keep their "
            "complete slabs (hidden partial files); run the same command again to resume"
            if not overwrite else
            f"interrupted: {done} output(s) complete and kept; those in progress were "
            "removed (--overwrite)"
        )  # fmt: skip
        error.signum = getattr(e, "signum", signal.SIGINT)  # exit 130, or 143 for SIGTERM
        raise error from e
    finally:
        if pool is not None:
            pool.close()
            _measure_ready(pool, result)
            # Files of workers lost: with --overwrite nothing resumes them; otherwise their
            # complete slabs are kept for the rerun (which removes a stale one).
            if overwrite:
                for job in todo:
                    if job.spec not in records:
                        remove_stale_temps(job.output)
    result.seconds = time.perf_counter() - start


def _measure_ready(pool: Pool, result: BatchResult) -> None:
    """The seconds until the last worker was ready, kept as this machine's start cost for
    the model's next batch where every worker became ready (a measurement, not a bound)."""
    ready = pool.ready_seconds()
    if ready and len(ready) == len(pool.workers):
        result.ready_seconds = max(ready)
        if START_ENV not in os.environ:
            remember_start(result.ready_seconds)
