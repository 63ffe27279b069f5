"""OpenCL programs: the kernel sources of kernels/, the one build path, and the one context
per device and process. The engine, the FMA probe and every other kernel user build here.

Nothing touches OpenCL at import time, so importing volconv before a fork is safe; contexts
are made on first use, in the process that uses them.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

import pyopencl as cl


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
    """Build kernels/``name`` with ``-D`` defines and other compiler ``options``; pyopencl
    caches the binary on disk, keyed by source, options and device."""
    return cl.Program(ctx, kernel_source(name)).build(
        options=[f"-D{k}={v}" for k, v in defines] + list(options)
    )


def device_seconds(events: list[cl.Event]) -> float:
    """Seconds ``events`` ran on the device, summed (OpenCL profiling counters)."""
    return sum(e.profile.end - e.profile.start for e in events) * 1e-9
