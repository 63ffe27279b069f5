"""The `volconv` program: its start, exit statuses and one-line errors around the commands
(`volconv.commands`, typer), which are imported after the OpenCL driver has started.

Exit status: 0 done; 2 the user's mistake found before any work (one clear line, no
traceback); 1 anything else, the cause on stderr: an input that failed, or the machine running
out of something (file descriptors, memory, disk), even where it surfaced as a file that could
not be read. ``--debug`` (before or after the command) shows tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

from volconv.errors import (
    DeviceError,
    MidRunError,
    NoDeviceError,
    OutputWriteError,
    one_line,
    resource_cause,
)


class UserError(Exception):
    """A mistake of the user's: exit status 2 and one line naming the file, key or value."""


_state: dict[str, float | bool | None] = {"debug": False, "t0": None, "leaving": False}


def _fail(message: str, status: int) -> None:
    # Plain text on one line whatever the width (messages name keys such as [input]), and
    # without rich: a process out of descriptors cannot import what rich loads lazily.
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()
    sys.exit(status)


_RESUME = "interrupted; rerun the same command to resume"


def _interrupted(e: KeyboardInterrupt, default: str = _RESUME) -> None:
    """Say what Ctrl-C kept and how to resume (``e``'s message, else ``default``), and exit
    130 at once: a kernel may still run on the device in a worker thread, and waiting for it
    (or for the OpenCL driver's clean-up at exit) is what the user interrupted."""
    if _state["debug"]:
        raise e
    message = str(e) or default
    sys.stderr.write(f"error: {message}\n")  # as `_fail`, without rich
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + int(getattr(e, "signum", 2)))  # 130 for Ctrl-C, 143 for SIGTERM


def entry_point() -> None:
    """The `volconv` program: `main`, then leave at once.

    Every output is closed and renamed, and the report written, before a command returns, so
    the interpreter's teardown is skipped, and the OpenCL driver's (its contexts and pinned
    memory freed) is left to a child that outlives this process (`volconv.device.driver.leave`);
    so is the wait for the file system to free the outputs ``--overwrite`` replaced, which an
    ``rm`` process finishes on its own (`volconv.output.staging.remove_later`).
    """
    _state["t0"], _state["leaving"] = _process_start(), True
    _one_blas_thread()
    _start_driver(sys.argv[1:])
    _start_workers(sys.argv[1:])
    try:
        main()
    except SystemExit as e:
        status = e.code
    else:
        status = 0
    if isinstance(status, str):  # what sys.exit("text") would print
        print(status, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to say
            stream.flush()
    if "volconv.run.spawn" in sys.modules:  # workers started early and never taken: they end
        sys.modules["volconv.run.spawn"].close_early()  # now, not with `leave`'s child
    from volconv.device.driver import leave

    leave(status or 0)


# What OpenBLAS reads for its thread count, in that order.
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def _one_blas_thread() -> None:
    """One OpenBLAS thread unless the user says otherwise, set before numpy is imported:
    numpy's OpenBLAS starts a thread per core as it loads (a share of the start on a node of
    many cores), and volconv computes on the device, not with BLAS (small SVDs at most). The
    worker processes of a batch inherit it."""
    if not any(os.environ.get(name) for name in _BLAS_THREADS):
        os.environ["OPENBLAS_NUM_THREADS"] = "1"


# The commands that use an OpenCL device.
_ON_A_DEVICE = ("run", "validate", "devices", "bench")


def _start_driver(argv: list[str]) -> None:
    """For a command that uses a device, start the OpenCL driver first thing, in a background
    thread (`volconv.device.driver`), while numpy, pyopencl, typer and the command's modules
    import."""
    words = [a for a in argv if not a.startswith("-")]
    if words and words[0] in _ON_A_DEVICE and not {"--help", "-h"} & set(argv):
        # a head start only: where it fails (a process out of descriptors), the command
        # starts the driver as pyopencl does, and says what is wrong
        with contextlib.suppress(Exception):
            from volconv.device.driver import start_driver

            start_driver()


def _start_workers(argv: list[str]) -> None:
    """For a batch on several local devices, start their workers first thing, while this
    process imports and plans (`volconv.run.spawn.start_early`: the batch takes them where
    its model wants them, and closes them otherwise)."""
    if argv[:1] != ["run"] or len(argv) < 2:
        return
    with contextlib.suppress(Exception):  # a head start only: the batch starts its own
        # nothing imported for a run that names no devices (the pipeline file read as bytes)
        if not any(a.startswith("--devices") for a in argv):
            with open(argv[1], "rb") as f:
                if b"devices" not in f.read(1 << 20):
                    return
        from volconv.run.spawn import start_early

        start_early(argv)


def _process_start() -> float:
    """The `time.perf_counter` this process started at (Linux: from /proc, to 10 ms), so that
    the table's ``start`` counts the interpreter's start and the imports too; else now."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 60 else now


def main() -> None:
    """Map exceptions to the exit statuses docs/contract.md promises (through SystemExit)."""
    if _state["t0"] is None:  # called in a process of its own (tests): from here
        _state["t0"] = time.perf_counter()
    try:
        _main_app()
    finally:
        # replaced outputs freed in the background (volconv.output.remove_later), waited
        # for here, after the table and the report: by a process that leaves (entry_point),
        # only where a thread of its own frees them, not an rm process (which goes on)
        if (staging := sys.modules.get("volconv.output.staging")) is not None:
            staging.wait_for_removals(processes=not _state["leaving"])


def _main_app() -> None:
    try:
        from volconv.commands import app

        app()  # typer reports bad options itself (exit 2) and exits through SystemExit
    except KeyboardInterrupt as e:  # outside a command (imports, typer's parsing)
        _interrupted(e)
    except (UserError, DeviceError) as e:
        if _state["debug"]:
            raise
        # out of file descriptors, memory or disk: the machine's state, not a wrong file
        _fail(str(e) + _hint(e), 2 if resource_cause(e) is None else 1)
    except NoDeviceError as e:
        if _state["debug"]:
            raise
        _fail(str(e), 1)
    except (OutputWriteError, MidRunError) as e:  # disk full; a mistake found mid-run
        if _state["debug"]:
            raise
        _fail(str(e) + _hint(e), 1)
    except Exception as e:  # the cause, in one line; --debug for the traceback
        if _state["debug"]:
            raise
        _fail(f"{type(e).__name__}: {e}{_hint(e)}", 1)


def _hint(e: BaseException) -> str:
    """What to do where the process ran out of file descriptors."""
    cause = resource_cause(e)
    if cause is not None and cause.errno in (errno.EMFILE, errno.ENFILE):
        return "; raise the limit of open files (ulimit -n)"
    return ""
