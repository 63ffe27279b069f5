"""Starting the OpenCL driver ahead, in a background thread, before numpy and pyopencl load.

pyopencl holds the GIL in clGetPlatformIDs and clCreateContext, where NVIDIA's driver starts
CUDA (benchmarks/README.md); through ctypes the same calls release it. `start_driver` loads
the ICD loader pyopencl links (the one its wheel bundles, found without importing pyopencl)
and lets it find its platforms in a thread while the program imports its modules;
`volconv.device.programs.start_context` makes a context the same way. Nothing here imports
numpy or pyopencl, and nothing starts at import. `leave` ends the program without waiting for
the driver's teardown.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from typing import NoReturn

_DRIVER: list[Future[None]] = []  # the platforms' start, once a process


def _mapped() -> set[str] | None:
    """The paths of the OpenCL ICD loaders mapped in this process; None where it cannot be
    told (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            return {f[5].strip() for f in (line.split(None, 5) for line in maps) if len(f) == 6
                    and os.path.basename(f[5].strip()).startswith("libOpenCL")}  # fmt: skip
    except OSError:
        return None


def _bundled() -> str | None:
    """The ICD loader pyopencl's wheel bundles (pyopencl/.libs or pyopencl.libs), as a real
    path, without importing pyopencl; None where there is not exactly one. It reads
    ``PYOPENCL_HOME`` as it starts (and fails without it), which pyopencl sets as it
    imports: set here first, to the value pyopencl gives it."""
    try:
        spec = find_spec("pyopencl")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    package = Path(os.path.dirname(os.path.abspath(spec.origin)))
    for folder in (package / ".libs", package.parent / "pyopencl.libs"):
        found = sorted(folder.glob("libOpenCL*.so*")) if folder.is_dir() else []
        if len(found) == 1:
            os.environ["PYOPENCL_HOME"] = str(package)  # as pyopencl sets it
            return os.path.realpath(found[0])
    return None


@cache
def loader() -> ctypes.CDLL | None:
    """The OpenCL ICD loader pyopencl calls, loaded by ctypes too (the same library, so the
    same loader state): the one mapped, else, before pyopencl loads, the one its wheel
    bundles (pyopencl's extension then links that one: the dynamic linker finds it loaded
    under its name); None where it cannot be told apart (not Linux, two loaders mapped)."""
    paths = _mapped()
    if paths is None:
        return None
    if not paths and (bundled := _bundled()) is not None:
        paths = {bundled}
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop())
    except OSError:  # cannot be loaded here (out of descriptors, memory): pyopencl says why
        return None
    lib.clCreateContext.restype = ctypes.c_void_p
    return lib


def shared_loader() -> ctypes.CDLL | None:
    """`loader`, where it is the one library pyopencl calls (one loader mapped, that one):
    a context made through it is pyopencl's to take."""
    lib = loader()
    if lib is None or _mapped() != {lib._name}:
        return None
    return lib


def background(fn: Callable[[], object], name: str) -> Future:
    """``fn()`` in a daemon thread; its result (or exception) in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # seen by whoever takes the result
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def start_driver() -> None:
    """Start the OpenCL driver in a background thread: the ICD loader finds its platforms
    (once a process). `driver_started` waits for it, before the first pyopencl call."""
    if _DRIVER or (lib := loader()) is None:
        return
    count = ctypes.c_uint32()
    _DRIVER.append(background(lambda: lib.clGetPlatformIDs(0, None, ctypes.byref(count)),
                              "volconv-driver"))  # fmt: skip


def driver_started() -> None:
    """Wait until `start_driver`'s thread is done (at once if none was started): OpenCL calls
    begin only after it, as the loader starts its platforms once."""
    if _DRIVER:
        _DRIVER[0].exception()  # a failure: pyopencl's own call then reports it


# How long the child `leave` forks waits for its parent to end before it ends itself.
HANDOFF_SECONDS = 10.0


def leave(status: int) -> NoReturn:
    """End this process with ``status`` at once. Where it loaded the OpenCL driver, whose
    teardown at exit (its contexts and pinned memory freed as its device files close) the
    shell would otherwise wait for (benchmarks/README.md, "Start-up"), a forked child
    holding the same device files takes it over: the child closes stdin, stdout and stderr at
    once (whoever reads them sees their end with this process's), waits for this process to
    end, then ends itself, the last to close the driver's files. Call it with every output
    complete and every stream flushed."""
    if (_DRIVER or "pyopencl" in sys.modules) and hasattr(os, "fork"):
        parent = os.getpid()
        with warnings.catch_warnings():  # a threaded process's fork: the child only ends
            warnings.simplefilter("ignore")
            try:
                child = os.fork()
            except OSError:  # no process to spare: this one tears the driver down
                child = -1
        if child == 0:
            try:
                for fd in (0, 1, 2):
                    with suppress(OSError):
                        os.close(fd)
                deadline = time.monotonic() + HANDOFF_SECONDS
                while os.getppid() == parent and time.monotonic() < deadline:
                    time.sleep(0.002)
            finally:
                os._exit(0)
    os._exit(status)
