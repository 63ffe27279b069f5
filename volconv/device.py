"""OpenCL devices: listing, choosing, and one lazily made context per device and process.

Nothing here touches OpenCL at import time, so importing volconv before a fork is safe.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyopencl as cl

from volconv.peak import Peak, theoretical_peak


class NoDeviceError(RuntimeError):
    """No usable OpenCL device; the message says what to install or register."""


@dataclass(frozen=True)
class DeviceInfo:
    """What `volconv devices` shows of one device."""

    platform_index: int
    device_index: int
    platform: str
    name: str
    kind: str
    compute_units: int
    clock_mhz: int
    global_mem: int
    max_alloc: int
    local_mem: int
    driver: str
    peak: Peak

    @property
    def spec(self) -> str:
        return f"{self.platform_index}:{self.device_index}"


def _kind(device: cl.Device) -> str:
    if device.type & cl.device_type.GPU:
        return "GPU"
    if device.type & cl.device_type.CPU:
        return "CPU"
    if device.type & cl.device_type.ACCELERATOR:
        return "accelerator"
    return "other"


def missing_platform_help() -> str:
    """Why no OpenCL platform shows up here, and what to do about it."""
    vendors = os.environ.get("OCL_ICD_VENDORS", "/etc/OpenCL/vendors")
    icds = sorted(glob.glob(os.path.join(vendors, "*.icd"))) if os.path.isdir(vendors) else []
    lines = [f"No usable OpenCL platform (ICD files in {vendors}: {len(icds)})."]
    nvidia = ctypes.util.find_library("nvidia-opencl") or next(
        iter(glob.glob("/usr/lib*/**/libnvidia-opencl.so.1", recursive=True)), None
    )
    registered = any("nvidia" in Path(p).read_text() for p in icds)
    if nvidia and not registered:
        lines.append(
            "The NVIDIA OpenCL driver (libnvidia-opencl.so.1) is installed but not registered; "
            f"register it with:\n  mkdir -p {vendors} && "
            f"echo libnvidia-opencl.so.1 > {vendors}/nvidia.icd"
        )
    lines.append(
        "For the CPU, install PoCL: apt-get install pocl-opencl-icd "
        "(Debian/Ubuntu; the PyPI pocl-binary-distribution wheel fails on some recent CPUs)."
    )
    return "\n".join(lines)


def _platforms() -> list[cl.Platform]:
    try:
        return cl.get_platforms()
    except cl.Error:  # PLATFORM_NOT_FOUND_KHR: no ICD registered at all
        return []


def _devices() -> list[tuple[int, int, cl.Platform, cl.Device]]:
    found = []
    for pi, platform in enumerate(_platforms()):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no devices of any type
            continue
        found.extend((pi, di, platform, d) for di, d in enumerate(devices))
    return found


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device of every platform, with its theoretical FP32 peak."""
    return [
        DeviceInfo(
            pi, di, p.name.strip(), d.name.strip(), _kind(d), d.max_compute_units,
            d.max_clock_frequency, d.global_mem_size, d.max_mem_alloc_size, d.local_mem_size,
            d.driver_version.strip(), theoretical_peak(d),
        )
        for pi, di, p, d in _devices()
    ]  # fmt: skip


def _matches(fragment: str, index: int, name: str) -> bool:
    fragment = fragment.strip()
    return str(index) == fragment if fragment.isdigit() else fragment.lower() in name.lower()


def select_device(spec: str | None = None) -> cl.Device:
    """The device named by ``spec``, else by ``PYOPENCL_CTX``, else the highest peak.

    ``spec`` is ``auto``, ``gpu``, ``cpu``, a name fragment (of device or platform), or
    ``"platform:device"`` where each side is an index or a name fragment.
    """
    candidates = _devices()
    if not candidates:
        raise NoDeviceError(missing_platform_help())
    if spec is None or spec == "auto":
        spec = os.environ.get("PYOPENCL_CTX") or "auto"
    spec = spec.strip()
    if spec.lower() in ("auto", "gpu", "cpu"):
        pool = candidates
        if spec.lower() != "auto":
            want = cl.device_type.GPU if spec.lower() == "gpu" else cl.device_type.CPU
            pool = [c for c in candidates if c[3].type & want]
    elif ":" in spec:
        plat, dev = spec.split(":", 1)
        pool = [
            c for c in candidates
            if _matches(plat, c[0], c[2].name) and (not dev or _matches(dev, c[1], c[3].name))
        ]  # fmt: skip
    else:
        pool = [c for c in candidates if spec.lower() in f"{c[2].name} {c[3].name}".lower()]
    if not pool:
        names = "; ".join(f"{pi}:{di} {d.name.strip()}" for pi, di, _, d in candidates)
        raise NoDeviceError(f"no OpenCL device matches {spec!r}; available: {names}")

    def rank(c: tuple[int, int, cl.Platform, cl.Device]) -> tuple[int, float]:
        peak = theoretical_peak(c[3]).gflops
        return (1 if c[3].type & cl.device_type.GPU else 0, peak or 0.0)

    return max(pool, key=rank)[3]


@cache
def context_for(device: cl.Device) -> tuple[cl.Context, cl.CommandQueue]:
    """The process's one context and profiling queue for ``device``, made on first use."""
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    return ctx, queue
