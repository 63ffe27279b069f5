"""The batch's worker side: what runs one input in a worker process, on the worker's device.

One input is one task, `process`: it takes the worker's device (``VOLCONV_DEVICE``, else the
pipeline's ``run.device``), plans its one input and runs `volconv.run.pipeline.run_one`,
returning the input's record. The worker makes its OpenCL context and convolvers once
(`warm_up`, or its first task) and keeps them for the next. Two tasks run at a time: one on
the device while the other's last slabs are written (`Turns`).

A Dask worker (``--scheduler``, SLURM) runs `process` as a task. A local worker of
``--devices`` is a plain process, `serve`, fed over a pipe by `volconv.run.pool`: it imports
only what filtering needs, warms up for the batch's first input and says when it is ready.
"""

from __future__ import annotations

import collections
import glob
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace

import pyopencl as cl

from volconv.config import Config
from volconv.device.cache import cache_folder
from volconv.device.devices import device_name, select_device
from volconv.device.programs import context_for, start_context
from volconv.report import VolumeReport
from volconv.run.convolvers import Convolvers, RunResult, peaks
from volconv.run.inputs import split_spec
from volconv.run.interrupts import Interrupted
from volconv.run.jobs import Job, plan_jobs
from volconv.run.pipeline import run_one
from volconv.run.spawn import DEVICE_ENV, NAME_ENV

# Every batch's tasks stop at their next slab: the client of a local worker is gone.
EVERY_BATCH = "*"


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
    device's context, the peaks, the programs of the input's plan (through
    volconv.device.programs' binary cache: a program another process built is loaded, not
    built) and its first page-locked slab buffer."""
    device = worker_device(cfg.device)
    start_context(device)  # made while the input is planned
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


def _stopped(batch: str) -> bool:
    return batch in _STOPPED or EVERY_BATCH in _STOPPED


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
    device: cl.Device | None = None
    try:
        if _stopped(batch):
            raise _Stopped
        device = worker_device(cfg.device, device_spec)
        job = plan_one(cfg, spec, device, overwrite=overwrite)

        def on_slab(job: Job) -> None:
            if _stopped(batch):
                raise _Stopped  # the writer keeps its complete slabs (volconv.run.resume)

        with _TURNS.turn(Convolvers.key(job)) as left:
            convolvers, result = _runner(cfg, device)
            record = run_one(cfg, job, convolvers, result, overwrite=overwrite, on_slab=on_slab,
                             on_device_done=left)  # fmt: skip
    except _Stopped:
        record = VolumeReport.failed(spec, "", (), 0, "stopped (Ctrl-C)")
    except Exception as e:
        record = VolumeReport.failed(spec, "", (), 0, f"{type(e).__name__}: {e}")
    # every record names who ran it, a failed one too
    where = device_name(device) if device is not None else record.device
    return replace(record, worker=_worker_name(), device=where)


def _worker_name() -> str:
    """This worker's name: a local worker's (``volconv-1 (pid 123)``), else the Dask
    worker's, and its address where the name is not it."""
    if name := os.environ.get(NAME_ENV):
        return f"{name} (pid {os.getpid()})"
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return f"pid {os.getpid()}"
    name, address = str(worker.name), str(worker.address)
    return address if name == address else f"{name} ({address})"


def stop(batch: str) -> None:
    """Stop the tasks of ``batch`` on this worker at their next slab (`Client.run`)."""
    _STOPPED.add(batch)


def describe(default: str = "auto") -> str:
    """This worker's device, in words (`Client.run`)."""
    return device_name(worker_device(default))


def serve(inbox_fd: int, outbox_fd: int, threads: int = 2) -> None:
    """A local worker's life (``python -c``, started by volconv.run.pool): messages from the
    client on ``inbox_fd``, answers on ``outbox_fd``.

    ``("warm", cfg, spec)``: `warm_up`, then ``("ready", unix time)``. ``("task", key, cfg,
    spec, overwrite, batch)``: `process` it, two at a time, then ``("record", key, record)``.
    ``("stop", batch)``: `stop`. The end of the inbox (the batch is done, or its client gone):
    what still runs stops at its next slab, and the process ends. Ctrl-C is the client's.
    """
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = Connection(inbox_fd, writable=False)
    outbox = Connection(outbox_fd, readable=False)
    lock = threading.Lock()
    tasks: queue.Queue = queue.Queue()

    def send(message: tuple) -> None:
        with lock, suppress(OSError):  # the client gone: nobody to tell
            outbox.send(message)

    def work() -> None:
        while (task := tasks.get()) is not None:
            key, *args = task
            send(("record", key, process(args[0], args[1], None, *args[2:])))

    workers = [threading.Thread(target=work, name=f"volconv-task-{i}") for i in range(threads)]
    for thread in workers:
        thread.start()
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):
            break
        if message[0] == "warm":
            with suppress(Exception):  # the first task makes what is missing, and says why
                warm_up(*message[1:])
            send(("ready", time.time()))
        elif message[0] == "task":
            tasks.put(message[1:])
        elif message[0] == "stop":
            stop(message[1])
    stop(EVERY_BATCH)  # at a batch's end nothing runs; a client gone: stop what does
    for _ in workers:
        tasks.put(None)
    for thread in workers:
        thread.join()
    os._exit(0)  # no interpreter teardown: the command waits for nothing
