"""OpenCL programs: the kernel sources of kernels/, the one build path, and the one context
per device and process. The engine, the FMA probe and every other kernel user build here.

Nothing touches OpenCL at import time, so importing volconv before a fork is safe; contexts
are made on first use, in the process that uses them, or started ahead (`start_driver`,
`start_context`) by a `volconv run` that knows it will need them. volconv's cache folder
(the FMA probe, the tuning, CPU program binaries) is `default_cache_dir`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import pyopencl as cl


def default_cache_dir() -> Path:
    """``$VOLCONV_CACHE_DIR``, else the user cache dir (platformdirs), else ~/.cache/volconv."""
    if env := os.environ.get("VOLCONV_CACHE_DIR"):
        return Path(env)
    try:
        from platformdirs import user_cache_dir  # a pyopencl dependency
    except ImportError:
        return Path.home() / ".cache" / "volconv"
    return Path(user_cache_dir("volconv"))


def kernel_folder() -> Traversable:
    """kernels/: installed as the data package volconv.kernels, or the checkout's when volconv
    is imported from a source tree."""
    try:
        return resources.files("volconv.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "kernels"


@cache
def kernel_source(name: str) -> str:
    """The text of kernels/``name`` (`kernel_folder`)."""
    return kernel_folder().joinpath(name).read_text()


# -- starting the driver ahead, in the background -----------------------------------------
# pyopencl holds the GIL in clGetPlatformIDs and clCreateContext, where NVIDIA's driver starts
# CUDA (0.12 s and 0.10 s on the H100 node); through ctypes the same calls release it, so that
# a `volconv run` imports its modules and reads its pipeline meanwhile.
_DRIVER: list[Future[None]] = []  # the platforms' start, once a process
_CONTEXTS: dict[int, Future[int | None]] = {}  # device pointer -> context pointer, or None
_MADE: set[int] = set()  # devices `context_for` has made or taken a context for


@cache
def _loader() -> ctypes.CDLL | None:
    """The OpenCL ICD loader pyopencl calls (its wheel bundles one), loaded once more by
    ctypes (the same library, so the same loader state), or None where it cannot be told
    apart: not Linux, or two loaders mapped."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {f[5] for f in (line.split(None, 5) for line in maps) if len(f) == 6
                     and os.path.basename(f[5].strip()).startswith("libOpenCL")}  # fmt: skip
    except OSError:
        return None
    if len(paths) != 1:
        return None
    lib = ctypes.CDLL(paths.pop().strip())
    lib.clCreateContext.restype = ctypes.c_void_p
    return lib


def _background(fn: Callable[[], object], name: str) -> Future:
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
    if _DRIVER or (lib := _loader()) is None:
        return
    count = ctypes.c_uint32()
    _DRIVER.append(_background(lambda: lib.clGetPlatformIDs(0, None, ctypes.byref(count)),
                               "volconv-driver"))  # fmt: skip


def driver_started() -> None:
    """Wait until `start_driver`'s thread is done (at once if none was started): OpenCL calls
    begin only after it, as the loader starts its platforms once."""
    if _DRIVER:
        _DRIVER[0].exception()  # a failure: pyopencl's own call then reports it


def start_context(device: cl.Device) -> None:
    """Start making ``device``'s context (`context_for` takes it) in a background thread."""
    if device.int_ptr in _CONTEXTS or device.int_ptr in _MADE or (lib := _loader()) is None:
        return
    pointer = ctypes.c_void_p(device.int_ptr)

    def make() -> int | None:
        status = ctypes.c_int32()
        made = lib.clCreateContext(None, 1, ctypes.byref(pointer), None, None,
                                   ctypes.byref(status))  # fmt: skip
        return made if status.value == 0 and made else None

    _CONTEXTS[device.int_ptr] = _background(make, "volconv-context")


@cache
def context_for(device: cl.Device) -> tuple[cl.Context, cl.CommandQueue]:
    """The process's one context and profiling queue for ``device``, made on first use (or
    taken from `start_context`)."""
    _MADE.add(device.int_ptr)
    started = _CONTEXTS.pop(device.int_ptr, None)
    made = started.result() if started is not None and started.exception() is None else None
    # the started one is this process's to own; a failed start is made again, by pyopencl,
    # which reports the driver's error
    ctx = cl.Context.from_int_ptr(made, retain=False) if made else cl.Context([device])
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    return ctx, queue


@cache
def build(
    ctx: cl.Context,
    name: str,
    defines: tuple[tuple[str, object], ...],
    options: tuple[str, ...] = (),
) -> cl.Program:
    """Build kernels/``name`` with ``-D`` defines and other compiler ``options``, once per
    process. On a GPU pyopencl (or the driver) caches the binary on disk; on a CPU,
    `cpu_binary_build`."""
    flags = [f"-D{k}={v}" for k, v in defines] + list(options)
    device = ctx.devices[0]
    if device.type & cl.device_type.CPU:
        return cpu_binary_build(ctx, device, kernel_source(name), flags)
    return cl.Program(ctx, kernel_source(name)).build(options=flags)


def cpu_binary_build(
    ctx: cl.Context,
    device: cl.Device,
    source: str,
    options: list[str],
    cache_dir: Path | None = None,
) -> cl.Program:
    """Build ``source`` from the binary cached under ``cache_dir``/programs, keyed by
    platform, device, driver, source and options; else from source, caching its binary.

    PoCL keeps its own cache, but a build from source still hashes and reloads it: 40-80 ms
    a program on the 2-core EPYC VM, against 3 ms from the binary. A binary the driver
    refuses (truncated, another driver) is built again from source and replaced.
    """
    parts = (device.platform.name, device.name, device.driver_version, source, *options)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    path = (cache_dir or default_cache_dir()) / "programs" / f"{key}.bin"
    try:
        return cl.Program(ctx, [device], [path.read_bytes()]).build(options=options)
    except (OSError, cl.Error):  # none yet, or refused: from source
        pass
    program = cl.Program(ctx, source).build(options=options)
    with suppress(OSError):  # a read-only cache folder: the next process builds from source
        _write_atomic(path, program.get_info(cl.program_info.BINARIES)[0])
    return program


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it: another process
    never reads half a binary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def device_seconds(events: list[cl.Event]) -> float:
    """Seconds ``events`` ran on the device, summed (OpenCL profiling counters)."""
    return sum(e.profile.end - e.profile.start for e in events) * 1e-9
