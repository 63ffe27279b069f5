"""OpenCL programs: the kernel sources of kernels/, the one build path, and the one context
per device and process. The engine, the FMA probe and every other kernel user build here.

Nothing touches OpenCL at import time, so importing volconv before a fork is safe; contexts
are made on first use, in the process that uses them. volconv's cache folder (the FMA probe,
the tuning, CPU program binaries) is `default_cache_dir`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import suppress
from functools import cache
from importlib import resources
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


@cache
def kernel_source(name: str) -> str:
    """The text of kernels/``name``: installed as the data package volconv.kernels, or read
    from the checkout's kernels/ when volconv is imported from a source tree."""
    try:
        folder = resources.files("volconv.kernels")
    except ModuleNotFoundError:
        folder = Path(__file__).resolve().parent.parent / "kernels"
    return folder.joinpath(name).read_text()


@cache
def context_for(device: cl.Device) -> tuple[cl.Context, cl.CommandQueue]:
    """The process's one context and profiling queue for ``device``, made on first use."""
    ctx = cl.Context([device])
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
