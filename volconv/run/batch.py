"""Batch: one pipeline's inputs over several devices and machines, on Dask distributed
(SPEC.md "Batch: several devices, several machines").

One input is one task, `process`: in a worker process it takes that worker's device
(``VOLCONV_DEVICE``, else the pipeline's ``run.device``), plans its one input and runs
`volconv.run.pipeline.run_one`, returning the input's record. The worker makes its OpenCL context
and convolvers on its first task and keeps them for the next. A local worker runs two tasks
at a time: one on its device while the other's last slabs are written (`Turns`). `run_batch`
plans and checks the whole pipeline once in the client, so a user's mistake exits 2 before
any task starts. On one machine (``devices = "all"`` or a list of specs) this process then
filters on the first device from the start, taking the inputs largest first from one queue
(`_Pending`), while one worker process per other device starts in the background (from
before the plan) and makes its context, programs and first pinned buffer for the first input
(`warm_up`); each worker, once ready, is fed from the same queue (`_Submitter`). With an
existing scheduler (``scheduler = ADDRESS``) every input is submitted, largest first. Every
record is gathered: done, skipped or failed. How many workers start is a model's choice
(`workers_for`): a batch too small to pay for starting them runs in this process alone, as one
device would.

Tasks are safe to run twice: an output is written under a temporary name and renamed when
complete, so the scheduler's rerun of a task whose worker died is correct by construction.
"""

from __future__ import annotations

import base64
import collections
import glob
import json
import logging
import math
import os
import pickle
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.config import Config, PipelineError
from volconv.device.cache import cache_folder, read_cached, write_cached
from volconv.device.devices import NoDeviceError, device_name, list_devices, select_device
from volconv.device.programs import context_for, start_context
from volconv.output import remove_stale_temps
from volconv.report import VolumeReport
from volconv.run.convolvers import Convolvers, RunResult, peaks
from volconv.run.inputs import InputError, expand_inputs, split_spec
from volconv.run.interrupts import Interrupted, interruptible, stop_on_ctrl_c
from volconv.run.jobs import Job, choose_device, plan_jobs
from volconv.run.pipeline import run_one, run_overlapped

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
# A scheduler that has not answered within this many seconds is taken as not there (Dask's
# own connect can wait forever on a port that accepts and never answers).
CONNECT_SECONDS = 10.0
STOP_WAIT = 10.0  # seconds Ctrl-C waits for the running tasks to stop at a slab's end
# The model that sizes a local batch (`workers_for`): what starting the workers costs until
# this machine has measured it (`start_cost`), and what one input costs on one device: a
# fixed share of host work, the output's bytes at a local disk's rate, the filtering at a
# fraction of the device's peak.
WORKER_START_SECONDS = 2.0
INPUT_SECONDS = 0.03
WRITE_BYTES_PER_SECOND = 2e9
PEAK_SHARE = 0.3
# Worker processes per device (more where the host, not the device, is what limits).
PROCESSES_ENV = "VOLCONV_PROCESSES_PER_DEVICE"
# The start cost the model assumes, in seconds, over the measured one (0: always workers).
START_ENV = "VOLCONV_WORKER_START_SECONDS"
# Why a task finds its output complete though the client planned it: a run of it on a worker
# lost after finishing it (a cancelled job), the scheduler's rerun of it, or another command.
MEANWHILE = "a lost worker finished it, or another run"
# What a local worker warms up for (a pickled (Config, input spec)), set by `run_batch`.
WARM_ENV = "VOLCONV_WARM"


# -- in the worker --------------------------------------------------------------------------
class _Stopped(Interrupted):
    """The client of this task's batch was interrupted (Ctrl-C). An `Interrupted`, so that the
    writer keeps its complete slabs for a rerun to resume, as a one-device run's Ctrl-C does."""


# Per worker process: the convolvers and peaks of the last (device, pipeline settings) seen,
# made on the first task (never in a parent before a fork); the batches stopped by Ctrl-C.
_RUNNER: dict[tuple[object, ...], tuple[Convolvers, RunResult]] = {}
_STOPPED: set[str] = set()
# The warm-up of this worker process (`warm_up`), and the Unix time it was done.
_WARM: list[Future[None]] = []
_READY_AT: list[float] = []


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
    """`volconv.run.jobs.plan_jobs` for the one input ``spec`` (as `plan_jobs` names it)."""
    name, dataset = split_spec(spec)
    literal = glob.escape(name) + (f":{dataset}" if dataset else "")  # a file, never a glob
    [job] = plan_jobs(replace(cfg, paths=(literal,)), device, overwrite=overwrite)
    return job


def _runner(cfg: Config, device: cl.Device) -> tuple[Convolvers, RunResult]:
    """This process's convolvers and peaks for ``cfg``'s settings on ``device``."""
    key = (device, cfg.boundary, cfg.cval, cfg.slab_depth, cfg.dtype, cfg.scale, cfg.offset)
    if key not in _RUNNER:
        _RUNNER.clear()  # the pinned buffers of another pipeline's convolvers go
        _RUNNER[key] = Convolvers(cfg, device), RunResult(device, *peaks(device))
    return _RUNNER[key]


def warm_up(cfg: Config, spec: str) -> None:
    """Make this worker ready for ``cfg``'s input ``spec`` before its first task: the
    device's context, the peaks, the programs of the input's plan (through volconv.device.programs'
    binary cache: a program another process built is loaded, not built) and its first
    page-locked slab buffer."""
    device = worker_device(cfg.device)
    convolvers, _ = _runner(cfg, device)
    job = plan_one(cfg, spec, device)
    context_for(device)
    with _one_builder():  # the local workers build in turn: the second loads the first's
        _, slabs = convolvers.get(job)
    slabs.put(slabs.get())  # the first pinned buffer made


@contextmanager
def _one_builder(wait: float = 60.0) -> Iterator[None]:
    """Hold the cache folder's build lock (at most ``wait`` seconds waited for it; then, or
    where it cannot be taken, build anyway): of workers warming up at once on a machine
    whose cache lacks the programs, one builds them and the others load its binaries."""
    import fcntl

    fd = -1
    with suppress(OSError):  # never through a link, never truncating what is there
        folder = cache_folder()  # made private where missing; the trust rule's
        fd = os.open(folder / "batch-build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + wait
    try:
        while fd >= 0 and time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.02)
            except OSError:
                break
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # and the lock with it


def _warm_from_env() -> None:
    try:
        cfg, spec = pickle.loads(base64.b64decode(os.environ[WARM_ENV]))
        warm_up(cfg, spec)
    except Exception:
        pass  # the first task makes what is missing, and reports why it cannot
    finally:
        _READY_AT.append(time.time())


def ready_at() -> float | None:
    """When this worker's warm-up was done, in Unix time (`Client.run`); None: none ran."""
    if _WARM:
        _WARM[0].exception()
    return _READY_AT[0] if _READY_AT else None


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
        if _WARM:
            _WARM[0].exception()  # the warm-up's programs and buffers, not a second build
        if batch in _STOPPED:
            raise _Stopped
        device = worker_device(cfg.device, device_spec)
        job = plan_one(cfg, spec, device, overwrite=overwrite)

        def on_slab(job: Job) -> None:
            if batch in _STOPPED:
                raise _Stopped  # the writer keeps its complete slabs (volconv.run.resume)

        with _TURNS.turn(Convolvers.key(job)) as left:
            convolvers, result = _runner(cfg, device)
            record = run_one(cfg, job, convolvers, result, overwrite=overwrite, on_slab=on_slab,
                             on_device_done=left)  # fmt: skip
            return replace(record, worker=_worker_name(), device=device_name(device))
    except _Stopped:
        return VolumeReport.failed(spec, "", (), 0, "stopped (Ctrl-C)")
    except Exception as e:
        return VolumeReport.failed(spec, "", (), 0, f"{type(e).__name__}: {e}")


def _worker_name() -> str:
    """This Dask worker's name, and its address where the name is not it."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return f"pid {os.getpid()}"
    name, address = str(worker.name), str(worker.address)
    return address if name == address else f"{name} ({address})"


def dask_setup(worker: object) -> None:
    """Preloaded in the worker processes of a local cluster: Ctrl-C at the terminal reaches
    the whole process group, and the client alone answers it, stopping the tasks in order;
    the warm-up for the batch's first input starts at once, in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if WARM_ENV in os.environ and not _WARM:
        future: Future[None] = Future()

        def warm() -> None:
            _warm_from_env()
            future.set_result(None)

        _WARM.append(future)
        threading.Thread(target=warm, name="volconv-warm-up", daemon=True).start()


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

    workers: list[str]  # each worker's device, in words ([] where none started)
    reports: list[VolumeReport] = field(default_factory=list)
    start_seconds: float = 0.0  # to start the local workers, or to connect to the scheduler
    seconds: float = 0.0  # from the first task submitted to the last record
    ready_seconds: float | None = None  # until the last local worker was warm (`warm_up`)
    devices: list[str] = field(default_factory=list)  # the devices the batch could use
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
            return f"this process and {len(self.workers) - 1} worker(s): {_count(self.workers)}"
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
        found = list_devices()
        if not found:
            select_device("auto")  # raises NoDeviceError with what to install
        gpus = [d for d in found if d.kind in ("GPU", "accelerator")]
        specs = tuple(d.spec for d in gpus or found)
    else:
        for spec in cfg.devices:
            try:
                select_device(spec)
            except NoDeviceError as e:
                if not list_devices():
                    raise
                raise PipelineError(f"{cfg.source}: devices: {spec!r}: {e}") from None
        specs = tuple(cfg.devices)
    text = os.environ.get(PROCESSES_ENV, "1")
    if not text.isdigit() or int(text) < 1:
        raise PipelineError(f"{PROCESSES_ENV}={text!r}: give a whole number of 1 or more")
    return specs * int(text)


def first_device(cfg: Config) -> cl.Device:
    """The device this process filters a local batch on: the first of `local_devices`."""
    return select_device(local_devices(cfg)[0])


# -- how many workers: the model --------------------------------------------------------------
def input_seconds(job: Job, cfg: Config, peak_gflops: float | None) -> float:
    """What one input costs on one device, as the model sees it (`workers_for`)."""
    voxels = math.prod(int(s) for s in job.volume.shape)
    stored = np.dtype(cfg.dtype).itemsize
    seconds = INPUT_SECONDS + voxels * len(job.filters) * stored / WRITE_BYTES_PER_SECOND
    if peak_gflops:
        seconds += job.gflop / (PEAK_SHARE * peak_gflops)
    return seconds


def workers_for(seconds: list[float], devices: int, start: float) -> int:
    """How many local worker processes a batch of inputs costing ``seconds`` each on one
    device should start besides this process, which filters on the first device from the
    start, when they are ready ``start`` seconds from now: the count whose batch ends first
    (this process's share of the work from time 0, each worker's from ``start``: the sum plus
    ``start`` per worker, shared out; at least the largest input), or 0 where no count ends
    before this process alone would (the sum of ``seconds``) -- so a batch is never slower
    than one device by the model."""
    best, best_seconds = 0, sum(seconds)
    for w in range(1, min(devices, len(seconds))):
        ends = max(max(seconds), (sum(seconds) + w * start) / (w + 1))
        if ends < best_seconds:
            best, best_seconds = w, ends
    return best


START_FILE = "batch_start.json"  # in the cache folder (volconv.device.cache: its trust rule)


def start_cost() -> float:
    """Seconds until local workers are ready: ``$VOLCONV_WORKER_START_SECONDS``, else what
    this machine's last batch measured (cached), else `WORKER_START_SECONDS`."""
    if (text := os.environ.get(START_ENV)) is not None:
        try:
            return max(0.0, float(text))
        except ValueError:
            raise PipelineError(f"{START_ENV}={text!r}: give seconds, e.g. 1.5") from None
    try:
        data = read_cached(cache_folder(), START_FILE, "the default start cost applies")
        value = float(json.loads(data)["ready_seconds"]) if data and len(data) < 4096 else None
    except (OSError, ValueError, KeyError, TypeError):
        value = None
    if value is not None and math.isfinite(value) and 0 <= value < 600:
        return value
    return WORKER_START_SECONDS


def _remember_start(seconds: float) -> None:
    with suppress(OSError):  # a read-only cache: the next batch assumes the default
        write_cached(cache_folder(), START_FILE,
                     json.dumps({"ready_seconds": round(seconds, 3)}).encode())  # fmt: skip


class _LocalStart:
    """A cluster of this machine, one worker process per spec, started in a background
    thread (`_local_cluster`) from the moment it is made; ``warm`` (cfg, input spec) is
    what each worker makes ready before its first task."""

    def __init__(self, specs: tuple[str, ...], warm: tuple[Config, str] | None) -> None:
        self.specs = specs
        self.began = time.perf_counter()
        self.began_at = time.time()
        self._future: Future = Future()
        self._stack: list[object] = []
        self._closing: threading.Thread | None = None
        env = {WARM_ENV: base64.b64encode(pickle.dumps(warm)).decode()} if warm else {}

        def start() -> None:
            try:
                cm = _local_cluster(specs, env)
                self._stack.append(cm)
                self._future.set_result(cm.__enter__())
            except BaseException as e:
                self._future.set_exception(e)

        threading.Thread(target=start, name="volconv-cluster", daemon=True).start()

    def client(self) -> Client:
        return self._future.result()

    def close(self, wait: bool = True) -> None:
        """Close the cluster, once; without ``wait``, in the background (nothing runs on it),
        and a later ``close()`` waits for that. A worker left when the command exits exits
        with it, but says so on stderr: the cluster is closed before."""
        if self._closing is None:

            def close() -> None:
                with suppress(BaseException):
                    self._future.exception()
                    if self._stack:
                        self._stack.pop().__exit__(None, None, None)

            self._closing = threading.Thread(target=close, name="volconv-cluster-close",
                                             daemon=True)  # fmt: skip
            self._closing.start()
        if wait:
            self._closing.join()


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
            return _remote_batch(cfg, overwrite, report, on_plan, on_volume, say)
        return _local_batch(cfg, overwrite, report, on_plan, on_volume, say)


def _to_run(jobs: list[Job], overwrite: bool) -> bool:
    """Whether any of ``jobs`` is not skipped as complete (`_skip_complete`)."""
    return any(overwrite or not job.complete for job in jobs)


def _skip_complete(
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
    specs = local_devices(cfg)
    planner = select_device(specs[0])  # this process plans, and filters, on the first device
    with suppress(Exception):  # its context made meanwhile (the command started it sooner)
        start_context(planner)
    names = [device_name(select_device(s)) for s in specs]
    cost = start_cost()
    peak = peaks(planner)[0]
    # Before planning, from the first input alone: start the other devices' workers now, if
    # worth it.
    starter: _LocalStart | None = None
    inputs = _input_specs(cfg)
    if len(inputs) >= 2 and len(specs) >= 2:
        with suppress(Exception):  # a mistake: the whole plan below says it
            first = plan_one(cfg, inputs[0], planner, overwrite=overwrite)
            seconds = input_seconds(first, cfg, peak)
            if first.complete and not overwrite:
                seconds = 0.0
            if w := workers_for([seconds] * len(inputs), len(specs), cost):
                starter = _LocalStart(specs[1 : 1 + w], (cfg, inputs[0]))
    try:
        jobs = plan_jobs(cfg, planner, overwrite=overwrite, report=report)
        if on_plan:
            on_plan(jobs)
        records = _skip_complete(jobs, overwrite, on_volume)
        todo = [j for j in jobs if j.spec not in records]  # the pipeline's order
        result = BatchResult(workers=[], devices=names)
        left = cost - (time.perf_counter() - starter.began) if starter else cost
        w = workers_for([input_seconds(j, cfg, peak) for j in todo], len(specs), max(0, left))
        if starter and w == 0:
            starter.close(wait=False)  # while this process runs the batch
            starter = None
        elif w and starter is None:
            starter = _LocalStart(specs[1 : 1 + w], (cfg, todo[0].spec))
        if todo:
            result.workers, result.here = names[:1], True
            if starter is None:
                result.in_process = True
                alone = sum(input_seconds(j, cfg, peak) for j in todo)
                result.why = (
                    f"{len(todo)} input(s), about {alone:.1f} s on one device: less than "
                    f"workers ready in {cost:.1f} s would save" if len(specs) > 1 else
                    "one device"
                )  # fmt: skip
            else:  # largest first: the last input to start is a small one
                todo.sort(key=lambda j: -j.gflop)
            _run_shared(cfg, todo, planner, records, overwrite, on_volume, say, starter, names,
                        result)  # fmt: skip
        result.reports = [records[j.spec] for j in jobs]
        return result
    finally:
        if starter:
            starter.close()  # or the wait for the one closing meanwhile (`_LocalStart.close`)


class _Pending:
    """The inputs not yet taken by a device, in the order they are taken: this process's
    runner and the workers' submitter take from it; an input whose worker was lost comes
    back to its front. It counts the inputs out on workers: until those end, one may come
    back."""

    def __init__(self, jobs: list[Job]) -> None:
        self._jobs = collections.deque(jobs)
        self._changed = threading.Condition()
        self._out = 0  # inputs taken for a worker, not yet ended

    def take(self, for_worker: bool = False) -> Job | None:
        with self._changed:
            if not self._jobs:
                return None
            self._out += for_worker
            return self._jobs.popleft()

    def ended(self, job: Job, back: bool = False) -> None:
        """A worker's input ended: recorded, or (``back``) to be taken again."""
        with self._changed:
            if back:
                self._jobs.appendleft(job)
            self._out -= 1
            self._changed.notify_all()

    def more(self) -> bool:
        """Wait until an input is pending (True) or none can come back (False)."""
        with self._changed:
            while not self._jobs and self._out:
                self._changed.wait(0.05)  # Ctrl-C reaches this (the main) thread meanwhile
            return bool(self._jobs)


class _Submitter(threading.Thread):
    """Feeds the local workers from the pending inputs as each becomes ready: at most two
    tasks in flight per worker (one on its device, one written), the next taken as one
    ends; a task whose worker was lost too often goes back to the pending inputs, once."""

    def __init__(self, cfg: Config, pending: _Pending, starter: _LocalStart, overwrite: bool,
                 record: Callable[[Job, VolumeReport], None], say: Say, names: list[str],
                 result: BatchResult) -> None:  # fmt: skip
        super().__init__(name="volconv-submitter", daemon=True)
        self.cfg, self.pending, self.starter, self.overwrite = cfg, pending, starter, overwrite
        self.record, self.say, self.names, self.result = record, say, names, result
        self.batch = uuid.uuid4().hex[:12]
        self.stopping = threading.Event()
        self.in_flight: dict[object, Job] = {}
        self._lock = threading.Lock()
        self.client: Client | None = None

    def run(self) -> None:
        try:
            self._feed()
        except BaseException as e:  # workers that did not start: this process runs the rest
            with self._lock:
                lost, self.in_flight = list(self.in_flight.values()), {}
            for job in lost:
                self.pending.ended(job, back=True)
            if self.say and not self.stopping.is_set():
                self.say(f"workers lost ({type(e).__name__}: {e}); this process goes on")

    def _feed(self) -> None:
        from distributed import as_completed

        self.client = client = self.starter.client()
        result, starter = self.result, self.starter
        result.start_seconds = time.perf_counter() - starter.began
        result.workers = self.names[: 1 + len(starter.specs)]
        if self.say:
            self.say(f"started {len(starter.specs)} worker(s) in {result.start_seconds:.1f} s "
                     f"beside this process: {result.label}")  # fmt: skip
        finished = as_completed()
        given_back: set[str] = set()
        n = 0

        def fill() -> None:
            nonlocal n
            while not self.stopping.is_set() and len(self.in_flight) < 2 * len(starter.specs):
                if (job := self.pending.take(for_worker=True)) is None:
                    return
                future = client.submit(process, self.cfg, job.spec, None, self.overwrite,
                                       self.batch, key=f"volconv-{self.batch}-{n}",
                                       resources=RESOURCES, retries=RETRIES)  # fmt: skip
                n += 1
                with self._lock:
                    self.in_flight[future] = job
                finished.add(future)

        fill()
        for future in finished:
            with self._lock:
                job = self.in_flight.pop(future)
            try:
                value: object = future.result()
            except BaseException as e:  # lost more often than the scheduler allows
                value = e
            back = (not isinstance(value, VolumeReport) and not self.stopping.is_set()
                    and job.spec not in given_back)  # fmt: skip
            if back:  # to this process or another worker
                given_back.add(job.spec)
            elif not self.stopping.is_set():
                self.record(job, _record(value, job))
            self.pending.ended(job, back)
            fill()
        with suppress(Exception):
            ready = [t for t in client.run(ready_at).values() if t is not None]
            if ready:
                result.ready_seconds = max(ready) - starter.began_at
                if START_ENV not in os.environ:  # the model's input, for this machine's next
                    _remember_start(result.ready_seconds)

    def stop_tasks(self) -> None:
        """Ctrl-C: the running tasks stop at their next slab, keeping their complete slabs
        for a rerun (with --overwrite: removing their files); nothing more is submitted."""
        from distributed import wait

        self.stopping.set()
        with self._lock:
            futures = list(self.in_flight)
        if self.client is None or not futures:
            return
        with suppress(Exception):
            self.client.run(stop, self.batch, on_error="ignore")
        with suppress(Exception):
            wait(futures, timeout=STOP_WAIT)
        with suppress(Exception):
            self.client.cancel(futures)


def _run_shared(
    cfg: Config,
    todo: list[Job],
    device: cl.Device,
    records: dict[str, VolumeReport],
    overwrite: bool,
    on_volume: OnVolume,
    say: Say,
    starter: _LocalStart | None,
    names: list[str],
    result: BatchResult,
) -> None:
    """The inputs of ``todo``, taken in order by this process on ``device`` (from the start,
    as a one-device run: Ctrl-C and SIGTERM keep the partials) and by ``starter``'s workers
    as each is ready, each record naming the process or worker and its device."""
    pending = _Pending(todo)
    lock = threading.Lock()  # records and on_volume: this process's runner and the submitter
    here, name = f"this process (pid {os.getpid()})", device_name(device)
    mine: list[Job] = []  # the inputs this process took, in order

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

    submitter = None
    if starter is not None:
        submitter = _Submitter(cfg, pending, starter, overwrite, record, say, names, result)
        submitter.start()
    run = RunResult(device, *peaks(device))
    convolvers = Convolvers(cfg, device)
    start = time.perf_counter()
    try:
        while True:
            with stop_on_ctrl_c(run.reports, resumable=not overwrite):
                interruptible(run_overlapped, cfg, taken(), convolvers, run,
                              overwrite=overwrite, on_volume=seen)  # fmt: skip
            if not pending.more():
                break
        # nothing pending or out on a worker: the batch is done; a submitter still waiting
        # for its workers submits nothing, one with workers measures when they were ready
        if submitter is not None:
            submitter.stopping.set()
            while submitter.client is not None and submitter.is_alive():
                submitter.join(0.05)  # Ctrl-C reaches this (the main) thread meanwhile
    except BaseException as e:
        if submitter is not None:
            submitter.stop_tasks()
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
        # Files of workers killed with the cluster: with --overwrite nothing resumes them;
        # otherwise their complete slabs are kept for the rerun (which removes a stale one).
        if overwrite and submitter is not None:
            for job in todo:
                if job.spec not in records:
                    remove_stale_temps(job.output)
    result.seconds = time.perf_counter() - start


def _remote_batch(
    cfg: Config,
    overwrite: bool,
    report: str | Path | None,
    on_plan: OnPlan,
    on_volume: OnVolume,
    say: Say,
) -> BatchResult:
    # The client plans on any device, only to check: each worker plans again for its own.
    jobs = plan_jobs(cfg, choose_device(cfg), overwrite=overwrite, report=report)
    result = BatchResult(workers=[], scheduler=cfg.scheduler)
    start = time.perf_counter()
    with ExitStack() as stack:
        # a wrong address is found before any work (exit 2): connect first, then begin
        client = stack.enter_context(connect(cfg)) if _to_run(jobs, overwrite) else None
        if on_plan:
            on_plan(jobs)
        records = _skip_complete(jobs, overwrite, on_volume)
        todo = sorted((j for j in jobs if j.spec not in records), key=lambda j: -j.gflop)
        if client is not None:
            result.workers = _remote_workers(client, cfg, say)
            result.start_seconds = time.perf_counter() - start
            _gather(client, cfg, todo, records, overwrite, on_volume)
            result.seconds = time.perf_counter() - start - result.start_seconds
    result.reports = [records[j.spec] for j in jobs]
    return result


def connect_seconds() -> float:
    """How long a scheduler may take to answer: Dask's connect timeout
    (``distributed.comm.timeouts.connect``), at most `CONNECT_SECONDS`."""
    import dask.config
    from dask.utils import parse_timedelta

    try:
        dask_seconds = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
    except (KeyError, TypeError, ValueError):
        return CONNECT_SECONDS
    return min(CONNECT_SECONDS, float(dask_seconds))


@contextmanager
def connect(cfg: Config) -> Iterator[Client]:
    """A client of the scheduler at ``cfg.scheduler``, within `connect_seconds`.

    Nothing listening there (refused, an unknown host, no route: perhaps a scheduler not up
    yet) is a `ConnectionError` (exit 1); something that accepts the connection but does not
    answer as a Dask scheduler within the bound is the address's mistake (`PipelineError`,
    exit 2); both name the address in one line."""
    from distributed import Client
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    address = cfg.scheduler
    bound = connect_seconds()
    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location) if scheme in ("tcp", "tls") else (None, None)
    except ValueError as e:  # an address it cannot parse
        raise PipelineError(f"{cfg.source}: scheduler {address!r}: {e}") from None
    if host is not None:
        try:
            socket.create_connection((host, port), timeout=bound).close()
        except OSError as e:
            raise ConnectionError(f"cannot reach the scheduler {address}: {e}") from None
    made: Future = Future()

    def make() -> None:
        try:
            made.set_result(Client(address, timeout=f"{bound}s"))
        except BaseException as e:
            made.set_exception(e)

    threading.Thread(target=make, name="volconv-connect", daemon=True).start()
    try:
        client = made.result(timeout=bound + 2)
    except TimeoutError:
        if made.done():  # Dask's own timeout
            raise ConnectionError(f"cannot reach the scheduler {address}: timed out") from None
        raise PipelineError(
            f"{cfg.source}: scheduler {address}: accepts connections but no Dask scheduler "
            f"answered within {bound:g} s; check the address (the scheduler's "
            "port, 8786 by default, not its dashboard's)"
        ) from None
    except OSError as e:
        raise ConnectionError(f"cannot reach the scheduler {address}: {e}") from None
    except ValueError as e:
        raise PipelineError(f"{cfg.source}: scheduler {address!r}: {e}") from None
    with client:
        yield client


def slurm_cluster(
    *,
    device: str = "gpu",
    gres: str | None = "gpu:1",
    partition: str | None = None,
    account: str | None = None,
    cpus: int = 8,
    memory: str = "32GB",
    walltime: str = "02:00:00",
    interface: str | None = None,
    host: str | None = None,
    python: str | None = None,
    log_directory: str | None = None,
) -> object:
    """A dask-jobqueue ``SLURMCluster`` whose every job is one volconv worker owning one
    device: ``gres`` (one GPU, so ``CUDA_VISIBLE_DEVICES`` shows it alone; None: no gres),
    ``VOLCONV_DEVICE=device``, two threads and the resource ``GPU=2`` (one input on the
    device while the one before is written). ``cluster.scale(jobs=n)`` submits n jobs;
    `volconv run --scheduler cluster.scheduler_address` sends them the inputs.
    ``scripts/slurm_dask_example.py`` runs it; tests/test_slurm.py against a real SLURM."""
    from dask_jobqueue import SLURMCluster

    return SLURMCluster(
        queue=partition, account=account,
        cores=2,  # worker threads: two inputs, one on the device, one written
        processes=1,  # one worker per job, so one per device
        job_cpu=cpus, memory=memory, walltime=walltime, interface=interface,
        scheduler_options={"host": host} if host else {},
        python=python or sys.executable, log_directory=log_directory,
        job_extra_directives=[f"--gres={gres}"] if gres else [],
        job_script_prologue=[f"export {DEVICE_ENV}={device}"],
        worker_extra_args=["--resources", "GPU=2"],
    )  # fmt: skip


@contextmanager
def _local_cluster(specs: tuple[str, ...], env: dict[str, str]) -> Iterator[Client]:
    """A client of a cluster of this machine with one worker process per spec (spawned:
    each makes its own OpenCL context), ``env`` in each worker's environment."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    # what goes wrong reaches the records (a task's failure, a lost worker); a worker's log
    # lines about the connection closed under it as the batch stops are noise on stderr
    quiet = logging.CRITICAL
    workers = {
        f"volconv-{i + 1}": {  # this process filters on device 0
            "cls": Nanny,
            "options": {
                **LOCAL_WORKER, "env": {DEVICE_ENV: spec, **env},
                # volconv bounds its host memory itself (host_memory per device)
                "memory_limit": 0, "silence_logs": quiet, "host": "127.0.0.1",
                "preload": [__name__],  # dask_setup: Ctrl-C is the client's; the warm-up
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
        # each record fetched as its task ends: a worker lost after that (a cancelled job)
        # does not make the scheduler's rerun of the task the record the batch reports
        for future, value in as_completed(futures, with_results=True, raise_errors=False):
            job = futures[future]
            records[job.spec] = record = _record(value, job)
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
        error = Interrupted(
            f"interrupted: {done} output(s) complete and kept; those in progress keep their "
            "complete slabs (hidden partial files); run the same command again to resume"
        )
        error.signum = getattr(e, "signum", signal.SIGINT)  # exit 130, or 143 for SIGTERM
        raise error from e


def _record(value: object, job: Job) -> VolumeReport:
    """The task's record, with the client's knowledge of the input where it failed."""
    if isinstance(value, VolumeReport):
        record = value
    else:  # the task was lost more often than allowed (KilledWorker), or its result
        e = value if isinstance(value, BaseException) else TypeError(repr(value))
        record = VolumeReport.failed(job.spec, "", (), 0, f"{type(e).__name__}: {e}")
    if record.status == "skipped" and not record.reason:  # planned as to do: done since
        record = replace(record, reason=f"became complete meanwhile ({MEANWHILE})")
    if record.status == "failed":
        record = replace(
            record, output=str(job.output), shape=tuple(int(s) for s in job.volume.shape),
            n_filters=len(job.outputs),
        )  # fmt: skip
    return record
