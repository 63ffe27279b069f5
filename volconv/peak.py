"""Theoretical FP32 peak of an OpenCL device: 2 x FP32 lanes x clock.

Only what the device tells us is used; a device we cannot model returns ``None`` ("unknown"),
never a guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyopencl as cl

# FP32 lanes per streaming multiprocessor by compute capability (CUDA C Programming Guide,
# "Arithmetic Instructions" throughput table).
NVIDIA_FP32_LANES_PER_SM: dict[tuple[int, int], int] = {
    (3, 0): 192, (3, 2): 192, (3, 5): 192, (3, 7): 192,
    (5, 0): 128, (5, 2): 128, (5, 3): 128,
    (6, 0): 64, (6, 1): 128, (6, 2): 128,
    (7, 0): 64, (7, 2): 64, (7, 5): 64,
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128, (10, 1): 128, (10, 3): 128,
    (11, 0): 128,
    (12, 0): 128, (12, 1): 128,
}  # fmt: skip

# x86 SIMD width in FP32 lanes by the widest ISA the CPU advertises.
_X86_SIMD_LANES = (("avx512f", 16), ("avx2", 8), ("avx", 8), ("sse2", 4))


@dataclass(frozen=True)
class Peak:
    """A device's theoretical FP32 peak and how it was derived."""

    gflops: float | None
    how: str

    def __str__(self) -> str:
        if self.gflops is None:
            return "unknown"
        if self.gflops >= 1000:
            return f"{self.gflops / 1000:.1f} TFLOP/s"
        return f"{self.gflops:.1f} GFLOP/s"


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())}


def _physical_cores(info: dict[str, str]) -> int:
    """Physical cores this process may use: hyperthreads add no FMA units."""
    logical = len(os.sched_getaffinity(0))
    try:
        threads_per_core = int(info["siblings"]) // int(info["cpu cores"])
    except (KeyError, ValueError, ZeroDivisionError):
        threads_per_core = 1
    return max(1, logical // max(1, threads_per_core))


def theoretical_peak(device: cl.Device) -> Peak:
    """2 x FP32 lanes x clock for ``device``, or unknown."""
    clock_ghz = device.max_clock_frequency / 1000.0
    cus = device.max_compute_units
    if device.type & cl.device_type.GPU and "cl_nv_device_attribute_query" in device.extensions:
        cc = (device.compute_capability_major_nv, device.compute_capability_minor_nv)
        lanes = NVIDIA_FP32_LANES_PER_SM.get(cc)
        if lanes is None:
            return Peak(None, f"NVIDIA compute capability {cc[0]}.{cc[1]} not in the table")
        return Peak(
            2 * lanes * cus * clock_ghz,
            f"{cus} SM x {lanes} FP32 lanes (cc {cc[0]}.{cc[1]}) x 2 x {clock_ghz:.3f} GHz",
        )
    if device.type & cl.device_type.CPU:
        info = _cpuinfo()
        flags = set(info.get("flags", "").split())
        lanes = next((w for isa, w in _X86_SIMD_LANES if isa in flags), None)
        cores = min(_physical_cores(info), cus)
        if lanes is None or clock_ghz <= 0:
            return Peak(None, "CPU without recognised x86 SIMD flags")
        # Cores since Haswell (AVX2) issue two FMA vectors per cycle; earlier ones one of
        # each mul and add, which is the same count of FLOPs.
        fma_units = 2
        return Peak(
            2 * lanes * fma_units * cores * clock_ghz,
            f"{cores} cores x {lanes} lanes x {fma_units} FMA units x 2 x {clock_ghz:.3f} GHz",
        )
    return Peak(None, "no FP32 model for this device")
