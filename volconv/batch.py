"""Batch: one pipeline's inputs over several devices and machines, on Dask distributed
(SPEC.md "Batch: several devices, several machines").

One input is one task, `process`: in a worker process it takes that worker's device
(``VOLCONV_DEVICE``, else the pipeline's ``run.device``), plans its one input and runs
`volconv.pipeline.run_one`, returning the input's record. The worker makes its OpenCL context
and convolvers on its first task and keeps them for the next. A local worker runs two tasks
at a time: one on its device while the other's last slabs are written (`Turns`). `run_batch`
plans and checks the whole pipeline once in the client, so a user's mistake exits 2 before
any task starts; then it starts one worker process per device of this machine (``devices =
"all"`` or a list of specs) or connects to an existing scheduler (``scheduler = ADDRESS``),
submits the inputs largest first and gathers every record: done, skipped or failed.

Tasks are safe to run twice: an output is written under a temporary name and renamed when
complete, so the scheduler's rerun of a task whose worker died is correct by construction.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyopencl as cl

from volconv.config import Config, PipelineError
from volconv.device import NoDeviceError, device_name, list_devices, select_device
from volconv.io import split_spec
from volconv.pipeline import (
    Convolvers,
    Interrupted,
    Job,
    RunResult,
    choose_device,
    peaks,
    plan_jobs,
    run_one,
)
from volconv.report import VolumeReport
from volconv.writer import remove_stale_temps

if TYPE_CHECKING:
    from distributed import Client

# The device a worker owns, as --device takes it; set per worker process.
DEVICE_ENV = "VOLCONV_DEVICE"
# Every task holds one "GPU" of its worker. A local worker has two, and two threads: one
# input on the device while the one before is written (`Turns` orders them); a worker
# started by hand with --resources GPU=1 runs one input at a time.
RESOURCES = {"GPU": 1}
LOCAL_WORKER = {"nthreads": 2, "resources": {"GPU": 2}}
# Reruns of a task whose worker died (beyond the scheduler's own allowed-failures).
RETRIES = 2
CONNECT_TIMEOUT = "20s"
STOP_WAIT = 10.0  # seconds Ctrl-C waits for the running tasks to stop at a slab's end


# -- in the worker --------------------------------------------------------------------------
class _Stopped(Interrupted):
    """The client of this task's batch was interrupted (Ctrl-C). An `Interrupted`, so that the
    writer keeps its complete slabs for a rerun to resume, as a one-device run's Ctrl-C does."""


# Per worker process: the convolvers and peaks of the last (device, pipeline settings) seen,
# made on the first task (never in a parent before a fork); the batches stopped by Ctrl-C.
_RUNNER: dict[tuple[object, ...], tuple[Convolvers, RunResult]] = {}
_STOPPED: set[str] = set()


class Turns:
    """Whose turn it is on this worker's device: an input takes it when nobody holds it and
    every input still being written shares its convolver (so only that convolver's pinned
    buffers are in use: host_memory holds); it gives the device up once its last slab is
    handed to its writer (``left()``), and leaves the writing at the end of the block."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._on_device = False
        self._writing: collections.Counter = collections.Counter()

    @contextmanager
    def turn(self, key: object) -> Iterator[Callable[[], None]]:
        with self._changed:
            self._changed.wait_for(lambda: not self._on_device and set(self._writing) <= {key})
            self._on_device = True
        state = {"on_device": True}

        def left() -> None:
            with self._changed:
                if state["on_device"]:
                    state["on_device"] = self._on_device = False
                    self._writing[key] += 1
                    self._changed.notify_all()

        try:
            yield left
        finally:
            with self._changed:
                if state["on_device"]:
                    self._on_device = False
                else:
                    self._writing[key] -= 1
                    if not self._writing[key]:
                        del self._writing[key]
                self._changed.notify_all()


_TURNS = Turns()


def worker_device(default: str, device_spec: str | None = None) -> cl.Device:
    """The device of this worker: ``device_spec``, else ``$VOLCONV_DEVICE``, else
    ``default`` (the pipeline's ``run.device``)."""
    return select_device(device_spec or os.environ.get(DEVICE_ENV) or default)


def plan_one(cfg: Config, spec: str, device: cl.Device, *, overwrite: bool = False) -> Job:
    """`volconv.pipeline.plan_jobs` for the one input ``spec`` (as `plan_jobs` names it)."""
    name, dataset = split_spec(spec)
    literal = glob.escape(name) + (f":{dataset}" if dataset else "")  # a file, never a glob
    [job] = plan_jobs(replace(cfg, paths=(literal,)), device, overwrite=overwrite)
    return job


def process(
    cfg: Config,
    spec: str,
    device_spec: str | None = None,
    overwrite: bool = False,
    batch: str = "",
) -> VolumeReport:
    """Run the input ``spec`` of ``cfg`` end to end on this worker's device: the task.

    Never raises for the input's sake: whatever stops this input (a file corrupt mid-read, a
    device error, an input changed since the client planned) comes back as a failed record
    with its reason, so that the other inputs go on. ``batch`` names the client's run, which
    can stop its tasks at their next slab (`stop`).
    """
    try:
        if batch in _STOPPED:
            raise _Stopped
        device = worker_device(cfg.device, device_spec)
        job = plan_one(cfg, spec, device, overwrite=overwrite)

        def on_slab(job: Job) -> None:
            if batch in _STOPPED:
                raise _Stopped  # the writer keeps its complete slabs (volconv.resume)

        with _TURNS.turn(Convolvers.key(job)) as left:
            key = (device, cfg.boundary, cfg.cval, cfg.slab_depth, cfg.dtype, cfg.scale,
                   cfg.offset)  # fmt: skip
            if key not in _RUNNER:
                _RUNNER.clear()  # the pinned buffers of another pipeline's convolvers go
                _RUNNER[key] = Convolvers(cfg, device), RunResult(device, *peaks(device))
            convolvers, result = _RUNNER[key]
            return run_one(cfg, job, convolvers, result, overwrite=overwrite, on_slab=on_slab,
                           on_device_done=left)  # fmt: skip
    except _Stopped:
        return VolumeReport.failed(spec, "", (), 0, "stopped (Ctrl-C)")
    except Exception as e:
        return VolumeReport.failed(spec, "", (), 0, f"{type(e).__name__}: {e}")


def dask_setup(worker: object) -> None:
    """Preloaded in the worker processes of a local cluster: Ctrl-C at the terminal reaches
    the whole process group, and the client alone answers it, stopping the tasks in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop(batch: str) -> None:
    """Stop the tasks of ``batch`` on this worker at their next slab (`Client.run`)."""
    _STOPPED.add(batch)


def describe(default: str = "auto") -> str:
    """This worker's device, in words (`Client.run`)."""
    return device_name(worker_device(default))


# -- in the client ------------------------------------------------------------------------
@dataclass
class BatchResult:
    """Every input's record, in the pipeline's order, and where and how fast they ran."""

    workers: list[str]  # each worker's device, in words
    reports: list[VolumeReport] = field(default_factory=list)
    start_seconds: float = 0.0  # to start the local workers, or to connect to the scheduler
    seconds: float = 0.0  # from the first task submitted to the last record

    @property
    def failed(self) -> list[VolumeReport]:
        return [r for r in self.reports if r.status == "failed"]

    @property
    def label(self) -> str:
        """``2 workers: NVIDIA H200 (NVIDIA CUDA) x2``."""
        names = sorted(set(self.workers))
        each = ", ".join(f"{n} x{self.workers.count(n)}" for n in names)
        return f"{len(self.workers)} worker(s): {each or 'none'}"


def local_devices(cfg: Config) -> tuple[str, ...]:
    """The device spec of each local worker: ``devices = "all"`` is every GPU or accelerator
    of this machine (every device where it has none), a list is taken as it is."""
    if cfg.devices == "all":
        found = list_devices()
        if not found:
            select_device("auto")  # raises NoDeviceError with what to install
        gpus = [d for d in found if d.kind in ("GPU", "accelerator")]
        return tuple(d.spec for d in gpus or found)
    for spec in cfg.devices:
        try:
            select_device(spec)
        except NoDeviceError as e:
            if not list_devices():
                raise
            raise PipelineError(f"{cfg.source}: devices: {spec!r}: {e}") from None
    return tuple(cfg.devices)


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
    task each. ``on_plan`` sees the jobs, ``on_volume`` each record as it comes (skipped ones
    first), ``say`` a line about the workers.
    """
    specs = () if cfg.scheduler else local_devices(cfg)
    # The client plans on any device, only to check: each worker plans again for its own.
    planner = select_device(specs[0]) if specs else choose_device(cfg)
    jobs = plan_jobs(cfg, planner, overwrite=overwrite, report=report)
    if on_plan:
        on_plan(jobs)
    records: dict[str, VolumeReport] = {}
    for job in jobs:
        if job.complete and not overwrite:
            records[job.spec] = job.skipped()
            if on_volume:
                on_volume(records[job.spec])
    todo = sorted((j for j in jobs if j.spec not in records), key=lambda j: -j.gflop)
    result = BatchResult(workers=[device_name(select_device(s)) for s in specs[: len(todo)]])
    if todo:
        start = time.perf_counter()
        try:
            with _client(cfg, specs[: len(todo)]) as client:
                if cfg.scheduler:
                    result.workers = _remote_workers(client, cfg, say)
                elif say:
                    say(f"started {result.label}")
                result.start_seconds = time.perf_counter() - start
                _gather(client, cfg, todo, records, overwrite, on_volume)
                result.seconds = time.perf_counter() - start - result.start_seconds
        finally:
            # Files of workers killed with the cluster: with --overwrite nothing resumes them;
            # otherwise their complete slabs are kept for the rerun (which removes a stale one).
            if not cfg.scheduler and overwrite:
                for job in todo:
                    if job.spec not in records:
                        remove_stale_temps(job.output)
    result.reports = [records[j.spec] for j in jobs]
    return result


@contextmanager
def _client(cfg: Config, specs: tuple[str, ...]) -> Iterator[Client]:
    """A client of the scheduler at ``cfg.scheduler``, or of a cluster of this machine with
    one worker process per spec (spawned: each makes its own OpenCL context)."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    if cfg.scheduler:
        try:
            client = Client(cfg.scheduler, timeout=CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as e:
            raise ConnectionError(f"cannot reach the scheduler {cfg.scheduler}: {e}") from None
        except ValueError as e:  # an address it cannot parse
            raise PipelineError(f"{cfg.source}: scheduler {cfg.scheduler!r}: {e}") from None
        with client:
            yield client
        return
    quiet = logging.ERROR
    workers = {
        f"volconv-{i}": {
            "cls": Nanny,
            "options": {
                **LOCAL_WORKER, "env": {DEVICE_ENV: spec},
                # volconv bounds its host memory itself (host_memory per device)
                "memory_limit": 0, "silence_logs": quiet, "host": "127.0.0.1",
                "preload": [__name__],  # dask_setup: Ctrl-C is the client's
            },
        }
        for i, spec in enumerate(specs)
    }  # fmt: skip
    # no dashboard; its HTTP server (health checks) on any free port of this host only
    options = {"host": "127.0.0.1", "dashboard": False, "dashboard_address": "127.0.0.1:0"}
    scheduler = {"cls": Scheduler, "options": options}
    with (
        SpecCluster(workers=workers, scheduler=scheduler, silence_logs=quiet) as cluster,
        Client(cluster) as client,
    ):
        yield client


def _remote_workers(client: Client, cfg: Config, say: Callable[[str], None] | None) -> list[str]:
    """The devices of the scheduler's workers with a GPU resource, said in a line."""
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # distributed before 2025 lists every worker without being asked
        workers = client.scheduler_info()["workers"]
    gpus = [a for a, w in workers.items() if w.get("resources", {}).get("GPU")]
    names: list[str] = []
    if gpus:
        found = client.run(describe, cfg.device, workers=gpus, on_error="return")
        names = [v if isinstance(v, str) else f"unknown ({v})" for v in found.values()]
    if say:
        label = BatchResult(names).label
        say(
            f"scheduler {cfg.scheduler}: {label}" if gpus else
            f"scheduler {cfg.scheduler}: no worker with the resource GPU yet; tasks wait for "
            f"one (start each with: {DEVICE_ENV}=0:0 dask worker {cfg.scheduler} "
            "--nworkers 1 --nthreads 2 --resources GPU=2)"
        )  # fmt: skip
    return names


def _gather(
    client: Client,
    cfg: Config,
    todo: list[Job],
    records: dict[str, VolumeReport],
    overwrite: bool,
    on_volume: Callable[[VolumeReport], None] | None,
) -> None:
    """Submit one task per job, largest first, and record each as it finishes."""
    from distributed import as_completed, wait

    batch = uuid.uuid4().hex[:12]
    futures = {
        client.submit(
            process, cfg, job.spec, None, overwrite, batch, key=f"volconv-{batch}-{i}",
            resources=RESOURCES, retries=RETRIES, priority=len(todo) - i,
        ): job
        for i, job in enumerate(todo)
    }  # fmt: skip
    try:
        for future in as_completed(futures):
            job = futures[future]
            records[job.spec] = record = _record(future, job)
            if on_volume:
                on_volume(record)
    except KeyboardInterrupt as e:
        # Every running task stops at its next slab, keeping its complete slabs for a rerun
        # (with --overwrite: removing its file); the queued ones are dropped. Then the
        # cluster (or this client) closes.
        with suppress(Exception):
            client.run(stop, batch, on_error="ignore")
        with suppress(Exception):
            wait(list(futures), timeout=STOP_WAIT)
        with suppress(Exception):
            client.cancel(list(futures))
        done = sum(r.status != "failed" for r in records.values())
        raise Interrupted(
            f"interrupted: {done} output(s) complete and kept; those in progress keep their "
            "complete slabs (hidden partial files); run the same command again to resume"
        ) from e


def _record(future: object, job: Job) -> VolumeReport:
    """The task's record, with the client's knowledge of the input where it failed."""
    try:
        record = future.result()  # type: ignore[attr-defined]
    except Exception as e:  # the task was lost more often than allowed (KilledWorker)
        record = VolumeReport.failed(job.spec, "", (), 0, f"{type(e).__name__}: {e}")
    if record.status == "failed":
        record = replace(
            record, output=str(job.output), shape=tuple(int(s) for s in job.volume.shape),
            n_filters=len(job.outputs),
        )  # fmt: skip
    return record
