"""The local workers of a ``--devices`` batch: one plain process per device spec
(volconv.run.spawn's `Worker`: those the command started as it started, else started the
moment the batch knows it wants them), fed over pipes from the queue of pending inputs
(`Pending`) that the command's own process also takes from.

A worker imports only what filtering needs (no Dask), warms up for the batch's first input
(context, programs from the binary cache, first pinned buffer: `volconv.run.workers.serve`)
and says when it is ready; from then on it holds two inputs at most (one on its device, one
written), taking the next as one ends. A worker that dies gives its inputs back to the queue
and is started again; closing the pool closes the pipes, and each worker ends on its own.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from volconv.config import Config
from volconv.report import VolumeReport
from volconv.run.jobs import Job
from volconv.run.spawn import Worker, adopt

# How often one input may be lost with its worker before it is recorded as failed, and how
# often one worker is started again after dying.
RETRIES = 2
STOP_WAIT = 10.0  # seconds Ctrl-C waits for the running tasks to stop at a slab's end
# Why a task finds its output complete though the client planned it: a run of it on a worker
# lost after finishing it (a cancelled job), the scheduler's rerun of it, or another command.
MEANWHILE = "a lost worker finished it, or another run"


class Pending:
    """The inputs not yet taken by a device, in the order they are taken: this process's
    runner and the workers take from it; an input whose worker was lost comes back to its
    front. It counts the inputs out on workers: until those end, one may come back."""

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

    def waiting(self) -> int:
        with self._changed:
            return len(self._jobs)


def task_record(value: object, job: Job) -> VolumeReport:
    """A task's record, with the client's knowledge of the input where it failed."""
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


Record = Callable[[Job, VolumeReport], None]


class Pool:
    """Local workers, one per spec, started from the moment it is made and warmed up for
    ``warm`` (cfg, input spec); `feed` gives them inputs from ``pending`` as each is ready.
    """

    def __init__(self, specs: tuple[str, ...], warm: tuple[Config, str]) -> None:
        self.specs = specs
        self.warm = warm
        early = [adopt(s) for s in specs]  # those the command started as it started
        taken = {w.name for w in early if w}
        free = (f"volconv-{i}" for i in itertools.count(1) if f"volconv-{i}" not in taken)
        self.workers = [w or Worker(next(free), s) for w, s in zip(early, specs, strict=True)]
        # from the first start on: what the early ones have done counts
        self.began = time.perf_counter() - max(time.time() - w.started_at for w in self.workers)
        self.on_ready: Callable[[Worker], None] | None = None  # set by `feed`
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._losses: collections.Counter = collections.Counter()
        self._keys = iter(range(1 << 62))
        self._threads: list[threading.Thread] = []
        for w in self.workers:
            w.send(("warm", *warm))

    def feed(self, cfg: Config, pending: Pending, overwrite: bool, batch: str, record: Record,
             say: Callable[[str], None] | None,
             on_ready: Callable[[Worker], None] | None = None) -> None:  # fmt: skip
        """Give each worker, once ready (``on_ready`` sees it), inputs from ``pending`` and
        ``record`` what each returns, in background threads (one per worker)."""
        self._task = (cfg, overwrite, batch)
        self.pending, self.record, self.say, self.on_ready = pending, record, say, on_ready
        for w in self.workers:
            thread = threading.Thread(target=self._serve, args=(w,), daemon=True,
                                      name=f"volconv-{w.name}")  # fmt: skip
            thread.start()
            self._threads.append(thread)

    def _fill(self, w: Worker) -> None:
        cfg, overwrite, batch = self._task
        while not self.stopping.is_set() and len(w.in_flight) < 2:
            if (job := self.pending.take(for_worker=True)) is None:
                return
            key = next(self._keys)
            w.in_flight[key] = job
            if not w.send(("task", key, cfg, job.spec, overwrite, batch)):
                return  # its reader gives it back

    def _serve(self, w: Worker) -> None:
        while True:
            try:
                message = w.inbox.recv()
            except (EOFError, OSError):
                if self._lost(w):
                    continue
                return
            if message[0] == "ready":
                w.ready_at = message[1]
                if w.starts == 1:
                    w.ready_seconds = w.ready_at - w.started_at
                if self.on_ready and not self.stopping.is_set():  # a closed pool says nothing
                    self.on_ready(w)
            elif message[0] == "record":
                job = w.in_flight.pop(message[1])
                w.device = w.device or getattr(message[2], "device", "")
                if not self.stopping.is_set():  # a task stopped by Ctrl-C is not a record
                    self.record(job, task_record(message[2], job))
                self.pending.ended(job)
            self._fill(w)

    def _lost(self, w: Worker) -> bool:
        """``w`` died: its inputs go back to the queue (an input lost too often fails), and
        it starts again where it had been ready and inputs wait (True: serve it again)."""
        why = w.lost()
        was_ready = w.ready_at is not None
        for job in w.in_flight.values():
            self._losses[job.spec] += 1
            if self._losses[job.spec] > RETRIES or self.stopping.is_set():
                if not self.stopping.is_set():
                    died = RuntimeError(f"its worker died {self._losses[job.spec]} times ({why})")
                    self.record(job, replace(task_record(died, job), device=w.device,
                                             worker=f"{w.name} (pid {w.proc.pid})"))  # fmt: skip
                self.pending.ended(job)
            else:
                self.pending.ended(job, back=True)  # to this process or another worker
        w.in_flight.clear()
        again = (was_ready and w.starts <= RETRIES and not self.stopping.is_set()
                 and self.pending.waiting() > 0)  # fmt: skip
        if self.say and not self.stopping.is_set():
            self.say(f"worker {w.name} lost ({why}); its inputs run again"
                     + ("; it starts again" if again else ""))  # fmt: skip
        if again:
            w.restart()
            w.send(("warm", *self.warm))
        return again

    def ready_seconds(self) -> list[float]:
        """Seconds from each worker's first start to its warm-up done, for those ready."""
        return [w.ready_seconds for w in self.workers if w.ready_seconds is not None]

    def stop_tasks(self, batch: str) -> None:
        """Ctrl-C: the running tasks stop at their next slab, keeping their complete slabs
        for a rerun (with --overwrite: removing their files); nothing more is given out."""
        self.stopping.set()
        for w in self.workers:
            w.send(("stop", batch))
        deadline = time.monotonic() + STOP_WAIT
        while any(w.in_flight for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """The batch is done (or stopped): every worker's pipe closed; nobody waits for them."""
        self.stopping.set()
        for w in self.workers:
            w.close()
