"""The other devices of a small local batch, filtered from threads of the command's own
process (`DeviceThreads`): no process to start, no module to import again, the plan of every
input made once here. Each thread makes its device's context and programs (from the binary
cache: the first device's, where the devices are alike), then takes inputs from the batch's
queue (volconv.run.pool's `Pending`) as this process's own runner does, and records each.

The threads share one `Pool`'s surface (`feed`, `ready_seconds`, `stop_tasks`, `close`), so
that volconv.run.batch gives a batch either. Worker processes pay where the batch is long
(each has its own host, its own GIL); threads where it is short (`volconv.run.model`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pyopencl as cl

from volconv.config import Config
from volconv.device.devices import device_name
from volconv.device.programs import start_context
from volconv.report import VolumeReport
from volconv.run.convolvers import Convolvers, RunResult, peaks
from volconv.run.interrupts import Interrupted
from volconv.run.jobs import Job
from volconv.run.pipeline import run_overlapped
from volconv.run.pool import STOP_WAIT, Pending, Record


class _Stopped(Interrupted):
    """The batch was stopped (Ctrl-C): this thread's input stops at its next slab, keeping its
    complete slabs for a rerun, as a one-device run's Ctrl-C does."""


class DeviceThread:
    """One device filtered from a thread of this process; its context starts at once."""

    def __init__(self, name: str, spec: str, device: cl.Device) -> None:
        self.name, self.spec, self.device = name, spec, device
        self.started_at = time.perf_counter()
        self.ready_seconds: float | None = None  # from its start to its programs made
        self.in_flight: list[Job] = []  # taken, not yet recorded
        start_context(device)


class DeviceThreads:
    """Threads of this process, one per device of ``devices`` (spec, device), warmed up from
    the moment it is made for ``warm`` (a job: its convolver, programs and first pinned
    buffer); `feed` has them take inputs from ``pending`` once ready."""

    def __init__(self, devices: list[tuple[str, cl.Device]], cfg: Config, warm: Job) -> None:
        self.specs = tuple(spec for spec, _ in devices)
        self.began = time.perf_counter()
        self.workers = [DeviceThread(f"thread {i + 1}", s, d)
                        for i, (s, d) in enumerate(devices)]  # fmt: skip
        self.stopping = threading.Event()
        self._ready = threading.Condition()
        self._warm: dict[str, tuple[Convolvers, RunResult] | BaseException] = {}
        for w in self.workers:
            threading.Thread(target=self._warm_up, args=(w, cfg, warm), daemon=True,
                             name=f"volconv-{w.name}-warm").start()  # fmt: skip

    def _warm_up(self, w: DeviceThread, cfg: Config, job: Job) -> None:
        try:
            convolvers = Convolvers(cfg, w.device)
            _, slabs = convolvers.get(job)
            slabs.put(slabs.get())  # the first pinned buffer made
            made: tuple[Convolvers, RunResult] | BaseException = (
                convolvers, RunResult(w.device, *peaks(w.device)))  # fmt: skip
            w.ready_seconds = time.perf_counter() - w.started_at
        except Exception as e:  # this device cannot filter: the others take its share
            made = e
        with self._ready:
            self._warm[w.name] = made
            self._ready.notify_all()

    def feed(self, cfg: Config, pending: Pending, overwrite: bool, batch: str, record: Record,
             say: Callable[[str], None] | None,
             on_ready: Callable[[DeviceThread], None] | None = None) -> None:  # fmt: skip
        """Each thread, once ready (``on_ready`` sees it), takes inputs from ``pending`` and
        ``record``s each (``batch`` is a process worker's; a thread stops on `stop_tasks`)."""
        for w in self.workers:
            threading.Thread(
                target=self._serve,
                daemon=True,
                name=f"volconv-{w.name}",
                args=(w, cfg, pending, overwrite, record, say, on_ready),
            ).start()

    def _serve(self, w: DeviceThread, cfg: Config, pending: Pending, overwrite: bool,
               record: Record, say: Callable[[str], None] | None,
               on_ready: Callable[[DeviceThread], None] | None) -> None:  # fmt: skip
        with self._ready:
            self._ready.wait_for(lambda: w.name in self._warm)
        made = self._warm[w.name]
        if isinstance(made, BaseException):
            if say:
                say(
                    f"{w.name} ({device_name(w.device)}) could not start "
                    f"({type(made).__name__}: {made}); the other devices take its inputs"
                )
            return
        convolvers, run = made
        if on_ready:
            on_ready(w)
        who = f"this process (pid {os.getpid()}), {w.name}"
        where = device_name(w.device)

        def taken() -> Iterator[Job]:
            while not self.stopping.is_set() and (job := pending.take(True)) is not None:
                w.in_flight.append(job)
                yield job

        def seen(r: VolumeReport) -> None:
            job = w.in_flight.pop(0)
            if not self.stopping.is_set():  # an input stopped by Ctrl-C is not a record
                record(job, replace(r, worker=who, device=where))
            pending.ended(job)

        def on_slab(job: Job) -> None:
            if self.stopping.is_set():
                raise _Stopped  # the writer keeps its complete slabs (volconv.run.resume)

        try:
            run_overlapped(cfg, taken(), convolvers, run, overwrite=overwrite,
                           on_volume=seen, on_slab=on_slab)  # fmt: skip
        except BaseException as e:  # its inputs go back: this process or another device runs them
            if say and not self.stopping.is_set():
                say(f"{w.name} ({where}) stopped ({type(e).__name__}: {e}); its inputs run "
                    "again on the other devices")  # fmt: skip
            for job in w.in_flight:
                pending.ended(job, back=not self.stopping.is_set())
            w.in_flight.clear()

    def ready_seconds(self) -> list[float]:
        """Seconds from each thread's start to its warm-up done, for those ready."""
        return [w.ready_seconds for w in self.workers if w.ready_seconds is not None]

    def stop_tasks(self, batch: str) -> None:
        """Ctrl-C: the threads' inputs stop at their next slab, keeping their complete slabs
        for a rerun (with --overwrite: their files removed after); nothing more is taken."""
        self.stopping.set()
        deadline = time.monotonic() + STOP_WAIT
        while any(w.in_flight for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.stopping.set()
