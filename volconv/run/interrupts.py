"""Ctrl-C and SIGTERM during a run: the work runs in a worker thread so that the main thread
answers at once (`interruptible`), the writers open keep what is on disk for a rerun to
resume (`OPEN_WRITERS`), and `Interrupted` says what was kept (`stop_on_ctrl_c`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from volconv.output import ResponseWriter
    from volconv.report import VolumeReport


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: ``signum``) stopped the run; the message says what was kept and
    how to resume."""

    signum = signal.SIGINT


# Writers open in this process: Ctrl-C removes their temporary files from the main thread
# while a slab may still be on the device.
OPEN_WRITERS: set[ResponseWriter] = set()
STOP = threading.Event()


def interruptible(fn: Callable[..., VolumeReport], *args: object, **kwargs: object):
    """``fn(*args, **kwargs)`` in a worker thread, so that the main thread stays free to
    answer Ctrl-C within a fraction of a second even while a long kernel runs (a blocking
    OpenCL wait holds the main thread in C, where Python's signal handlers cannot run).

    On Ctrl-C the writers open stop here, from the main thread, keeping their temporary files
    and progress for a rerun to resume (with ``--overwrite``, removing them), and
    `Interrupted` is raised; the worker (a daemon thread) is abandoned with its kernel.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # raised again in the main thread
            box["error"] = e

    worker = threading.Thread(target=target, name="volconv-run", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        if STOP.is_set() and worker.is_alive():
            for writer in list(OPEN_WRITERS):
                if writer.progress is not None:
                    writer.keep()  # volconv.run.resume: what is on disk stays, for a rerun
                else:
                    writer.__exit__(Interrupted, None, None)  # removes its temporary file
            OPEN_WRITERS.clear()
            raise Interrupted
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@contextmanager
def stop_on_ctrl_c(reports: list[VolumeReport], resumable: bool = True) -> Iterator[None]:
    """Ctrl-C (or SIGTERM) stops the run at once: `Interrupted` says which outputs are
    complete, that the one in progress keeps its complete slabs (``resumable``; else it is
    removed) and how to resume. A second signal falls back to Python's own handling."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM)

    def stop(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum))
        STOP.set()
        for s, handler in zip(signums, previous, strict=True):
            signal.signal(s, handler)

    STOP.clear()
    received: list[signal.Signals] = []
    previous = [signal.signal(s, stop) for s in signums]
    try:
        yield
        if STOP.is_set():  # after the last slab of an input, before the next one
            raise Interrupted
    except KeyboardInterrupt as e:
        done = sum(r.status in ("done", "skipped") for r in reports)
        kept = (
            "the one in progress keeps its complete slabs (a hidden partial file beside it)"
            if resumable
            else "the one in progress was removed (--overwrite)"
        )
        error = Interrupted(
            f"interrupted: {done} output(s) complete and kept; {kept}; "
            "run the same command again to resume"
        )
        error.signum = received[0] if received else signal.SIGINT
        raise error from e
    finally:
        for s, handler in zip(signums, previous, strict=True):
            signal.signal(s, handler)
        STOP.clear()
