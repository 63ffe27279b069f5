"""FP32 peak of an OpenCL device: theoretical (2 x FP32 lanes x clock) and measured (FMA probe).

The theoretical peak uses only what the device tells us (vendor extensions, ISA flags, the
clock OpenCL reports) and a table per architecture; a device we cannot model is "unknown",
with the reason, never a guess. The arithmetic lives in small pure functions
(`nvidia_peak`, `amd_gpu_peak`, `intel_gpu_peak`, `cpu_peak`) that take plain numbers, so it
is testable without the hardware; `theoretical_peak` reads the device and dispatches.

The measured peak is the best FP32 multiply-add rate of kernels/fma_probe.cl, cached on disk
per (platform, device, driver, probe source): `measured_peak`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv.device.cache import cache_folder, device_key, read_cached, write_cached
from volconv.device.programs import build, context_for, kernel_source
from volconv.report import format_gflops

log = logging.getLogger(__name__)

# FP32 lanes per streaming multiprocessor by compute capability (CUDA C++ Programming Guide,
# "Arithmetic Instructions": 32-bit floating-point add, multiply, multiply-add per clock per SM).
NVIDIA_FP32_LANES_PER_SM: dict[tuple[int, int], int] = {
    (3, 0): 192, (3, 2): 192, (3, 5): 192, (3, 7): 192,  # Kepler
    (5, 0): 128, (5, 2): 128, (5, 3): 128,  # Maxwell
    (6, 0): 64, (6, 1): 128, (6, 2): 128,  # Pascal (GP100 has 64)
    (7, 0): 64, (7, 2): 64, (7, 5): 64,  # Volta, Xavier, Turing
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,  # A100; GA10x, Orin, Ada
    (9, 0): 128,  # Hopper
    (10, 0): 128, (10, 1): 128, (10, 3): 128,  # Blackwell datacentre, Thor (old numbering)
    (11, 0): 128,  # Thor
    (12, 0): 128, (12, 1): 128,  # Blackwell GeForce / workstation, GB10
}  # fmt: skip

# Dense FP16 tensor-core flops (FP32 accumulation) per SM and clock by compute capability:
# A100 312 TFLOP/s = 108 SM x 2048 x 1.41 GHz; H100 SXM 989 = 132 SM x 4096 x 1.83 GHz
# (NVIDIA's A100 and H100 datasheets, dense). mma.sync reaches about 65 % of Hopper's figure,
# which counts wgmma (benchmarks/README.md).
NVIDIA_FP16_TENSOR_FLOPS_PER_SM: dict[tuple[int, int], int] = {(8, 0): 2048, (9, 0): 4096}

# AMD GPU targets that issue two FP32 FMAs per lane and clock: packed FP32 (v_pk_fma_f32) on
# CDNA 2/3 and dual-issue (VOPD, wave64 on both halves) on RDNA 3/4. The vendor's FP32 peak
# counts both; kernels need float2 work or the compiler's pairing to reach it.
_AMD_DOUBLE_ISSUE = (
    (re.compile(r"gfx90a|gfx94\d|gfx95\d"), "packed FP32 (CDNA 2/3)"),
    (re.compile(r"gfx1[12]\d\d"), "dual-issue (RDNA 3/4)"),
)

# Intel GPU families by marketing name: FP32 lanes per EU (vector engine). Gen9 to Xe-HPG
# have 8; Xe-HPC (Data Center GPU Max) and Xe2 (Arc B-series, Lunar Lake) have 16.
_INTEL_GPU_LANES = (
    (re.compile(r"Data Center GPU Max|Arc\(TM\) B\d|Arc\(TM\) 1[34]0V", re.I), 16, "Xe-HPC/Xe2"),
    (
        re.compile(r"Arc\(TM\) A\d|Iris|UHD Graphics|HD Graphics|Data Center GPU Flex", re.I),
        8,
        "Gen9..Xe-HPG",
    ),
)

# x86 SIMD width in FP32 lanes by the widest ISA the CPU advertises.
_X86_SIMD_LANES = (("avx512f", 16), ("avx2", 8), ("avx", 8), ("sse2", 4))

# Skylake-SP and Cascade Lake Bronze, Silver and Gold 5xxx parts (x1xx, x2xx) have one
# AVX-512 FMA unit; Gold 5122 and every later Xeon have two.
_XEON_ONE_FMA = re.compile(r"(Bronze|Silver) [34][12]\d\d|Gold 5[12]\d\d")

# Probe variants (vector width, chains), tried in turn; the best rate is the measured peak.
# float4 x 8 keeps an NVIDIA SM issuing FFMA with ~40 registers; PoCL on AVX-512 wants the
# wide vectors (float8/16, measured: scalar chains are not vectorised across work-items).
PROBE_VARIANTS = ((4, 8), (8, 16), (16, 8))
PROBE_BLOCK = 16  # unrolled repetitions per loop iteration: 16 x 8 chains = 128 FMAs
PROBE_SECONDS = 0.05  # per timed launch, after calibration
PROBE_REPEATS = 10


@dataclass(frozen=True)
class Peak:
    """A device's theoretical FP32 peak and how it was derived (or why it is unknown)."""

    gflops: float | None
    how: str

    def __str__(self) -> str:
        return format_gflops(self.gflops)


# -- the arithmetic --------------------------------------------------------------------------


def nvidia_peak(cc: tuple[int, int], sms: int, clock_mhz: float) -> Peak:
    """2 x FP32 lanes per SM x SMs x clock for an NVIDIA GPU of compute capability ``cc``."""
    lanes = NVIDIA_FP32_LANES_PER_SM.get(tuple(cc))
    if lanes is None:
        return Peak(None, f"NVIDIA compute capability {cc[0]}.{cc[1]} is not in the table")
    ghz = clock_mhz / 1000
    return Peak(
        2 * lanes * sms * ghz,
        f"{sms} SM x {lanes} FP32 lanes (cc {cc[0]}.{cc[1]}) x 2 x {ghz:.3f} GHz",
    )


def nvidia_tensor_peak(cc: tuple[int, int], sms: int, clock_mhz: float) -> Peak:
    """Dense FP16 tensor-core flops with FP32 accumulation: per SM per clock x SMs x clock."""
    per_sm = NVIDIA_FP16_TENSOR_FLOPS_PER_SM.get(tuple(cc))
    if per_sm is None:
        return Peak(None, f"no FP16 tensor-core figure for cc {cc[0]}.{cc[1]}")
    ghz = clock_mhz / 1000
    return Peak(
        per_sm * sms * ghz,
        f"{sms} SM x {per_sm} FP16 tensor flops (cc {cc[0]}.{cc[1]}) x {ghz:.3f} GHz",
    )


def tensor_peak(device: cl.Device) -> Peak:
    """The FP16 tensor-core peak of ``device`` (FP32 accumulation), or unknown with the reason."""
    if not (
        device.type & cl.device_type.GPU and "cl_nv_device_attribute_query" in device.extensions
    ):
        return Peak(None, "tensor-core peaks are modelled for NVIDIA GPUs only")
    cc = (device.compute_capability_major_nv, device.compute_capability_minor_nv)
    return nvidia_tensor_peak(cc, device.max_compute_units, device.max_clock_frequency)


def amd_gpu_peak(
    target: str,
    compute_units: int,
    simd_per_cu: int,
    simd_width: int,
    simd_instruction_width: int,
    clock_mhz: float,
) -> Peak:
    """2 x FP32 lanes x clock for an AMD GPU from cl_amd_device_attribute_query.

    Lanes per compute unit = SIMDs x SIMD width x instruction width (VLIW4/5 on TeraScale,
    1 since GCN); on RDNA OpenCL counts work-group processors (4 SIMD32 each) as compute
    units, which this product covers. ``target`` is the gfx name (``gfx90a``, ``gfx1100``),
    which decides packed/dual-issue FP32.
    """
    lanes = simd_per_cu * simd_width * simd_instruction_width
    if lanes <= 0 or compute_units <= 0 or clock_mhz <= 0:
        return Peak(None, "AMD device reports no SIMD layout")
    issue, why = next(((2, w) for rx, w in _AMD_DOUBLE_ISSUE if rx.fullmatch(target)), (1, ""))
    ghz = clock_mhz / 1000
    extra = f" x {issue} {why}" if issue > 1 else ""
    return Peak(
        2 * lanes * compute_units * issue * ghz,
        f"{compute_units} CU x {lanes} FP32 lanes ({target}){extra} x 2 x {ghz:.3f} GHz",
    )


def intel_gpu_peak(name: str, eus: int, clock_mhz: float) -> Peak:
    """2 x FP32 lanes x clock for an Intel GPU recognised by ``name``; OpenCL counts EUs."""
    for rx, lanes, family in _INTEL_GPU_LANES:
        if rx.search(name):
            ghz = clock_mhz / 1000
            return Peak(
                2 * lanes * eus * ghz,
                f"{eus} EU x {lanes} FP32 lanes ({family}) x 2 x {ghz:.3f} GHz",
            )
    return Peak(None, f"Intel GPU {name!r} is not a family in the table")


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says about a CPU model."""

    vendor: str  # GenuineIntel, AuthenticAMD, ...
    family: int
    model: int
    name: str
    flags: frozenset[str]


def cpu_fma_lanes(cpu: CpuInfo) -> tuple[int, str] | str:
    """FP32 multiply-add lanes per core and cycle with the reason, or why they are unknown.

    Two FMA units of the widest vector width for every AVX2 or AVX-512 core, except the
    parts known to have fewer: AMD Zen/Zen+ (128-bit datapath), Zen 4 (AVX-512 on 256-bit
    units) and mobile Zen 5 (256-bit), Intel client cores with AVX-512 (one 512-bit FMA, ports
    0+1 fused) and Skylake/Cascade Lake Bronze, Silver and Gold 5xxx Xeons. Without FMA
    (pre-Haswell) one multiplier and one adder give the same two FLOPs per lane and cycle.
    """
    lanes = next((w for isa, w in _X86_SIMD_LANES if isa in cpu.flags), None)
    if lanes is None:
        return "no x86 SIMD flags: FMA pipes per core unknown for this CPU"
    if "fma" not in cpu.flags:
        return lanes, f"{lanes} lanes, separate multiply and add ports"
    if cpu.vendor == "AuthenticAMD":
        if cpu.family < 0x17:
            return "AMD before Zen shares its FPU between two cores: unknown"
        if cpu.family == 0x17 and cpu.model < 0x30:
            return 8, "Zen/Zen+: 2 FMA x 128-bit"
        if cpu.family in (0x17, 0x19):
            return 16, "Zen 2-4: 2 FMA x 256-bit"
        if cpu.family == 0x1A and (0x20 <= cpu.model <= 0x2F or 0x60 <= cpu.model <= 0x6F):
            return 16, "mobile Zen 5: 2 FMA x 256-bit"
        return 2 * lanes, f"2 FMA x {lanes} lanes"
    if lanes == 16 and ("Core(TM)" in cpu.name or _XEON_ONE_FMA.search(cpu.name)):
        return 16, "1 AVX-512 FMA unit"
    return 2 * lanes, f"2 FMA x {lanes} lanes"


def cpu_peak(cpu: CpuInfo, cores: int, clock_mhz: float) -> Peak:
    """2 x FMA lanes per core x physical cores x clock for an x86 CPU."""
    lanes = cpu_fma_lanes(cpu)
    if isinstance(lanes, str):
        return Peak(None, lanes)
    if clock_mhz <= 0 or cores <= 0:
        return Peak(None, "the CPU reports no clock")
    n, why = lanes
    ghz = clock_mhz / 1000
    return Peak(
        2 * n * cores * ghz,
        f"{cores} cores x {n} FMA lanes ({why}) x 2 x {ghz:.3f} GHz",
    )


# -- reading the device -----------------------------------------------------------------------


def cpuinfo() -> CpuInfo:
    """The first processor block of /proc/cpuinfo (empty fields where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        block = ""
    info = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())}

    def number(key: str) -> int:
        try:
            return int(info.get(key, "0"), 0)
        except ValueError:
            return 0

    return CpuInfo(
        vendor=info.get("vendor_id", ""),
        family=number("cpu family"),
        model=number("model"),
        name=info.get("model name", ""),
        flags=frozenset(info.get("flags", "").split()),
    )


def _physical_cores() -> int:
    """Physical cores this process may run on: hyperthreads share FMA units."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            return len(cpus)  # no topology exposed: count logical CPUs
    return len(cores)


def _amd_target(device: cl.Device) -> str:
    """The gfx target: from the device name (ROCm names it ``gfx90a:sramecc+:xnack-``), else
    from the graphics IP version, which cannot tell gfx90a from gfx900."""
    m = re.match(r"gfx[0-9a-f]+", device.name.strip())
    if m:
        return m.group(0)
    return f"gfx{device.gfxip_major_amd}{device.gfxip_minor_amd}"


def theoretical_peak(device: cl.Device) -> Peak:
    """2 x FP32 lanes x clock for ``device``, or unknown with the reason."""
    clock = device.max_clock_frequency
    cus = device.max_compute_units
    ext = device.extensions
    if device.type & cl.device_type.GPU:
        if "cl_nv_device_attribute_query" in ext:
            cc = (device.compute_capability_major_nv, device.compute_capability_minor_nv)
            return nvidia_peak(cc, cus, clock)
        if "cl_amd_device_attribute_query" in ext:
            try:
                return amd_gpu_peak(
                    _amd_target(device), cus, device.simd_per_compute_unit_amd,
                    device.simd_width_amd, device.simd_instruction_width_amd, clock,
                )  # fmt: skip
            except cl.Error as e:  # an old driver without the SIMD queries
                return Peak(None, f"AMD driver does not report its SIMD layout ({e.code})")
        if "intel" in device.vendor.lower():
            return intel_gpu_peak(device.name.strip(), cus, clock)
        return Peak(None, f"no FP32 model for GPUs of {device.vendor.strip()!r}")
    if device.type & cl.device_type.CPU:
        return cpu_peak(cpuinfo(), min(_physical_cores(), cus), clock)
    return Peak(None, "no FP32 model for this kind of device")


# -- the FMA probe ---------------------------------------------------------------------------


PEAK_FILE = "peak.json"


def _cache_key(device: cl.Device) -> str:
    """The device key (platform, device, driver) and the probe's source: a new driver or
    probe measures again."""
    probe = hashlib.sha256(kernel_source("fma_probe.cl").encode()).hexdigest()[:12]
    return f"{device_key(device)} | probe {probe}"


def _probe_variant(device: cl.Device, vw: int, chains: int) -> float:
    """GFLOP/s of the best of `PROBE_REPEATS` launches of one probe variant.

    The iteration count is calibrated first so that a launch takes about `PROBE_SECONDS`:
    long enough to swamp launch overheads, short enough for a display watchdog.
    """
    ctx, queue = context_for(device)
    defines = (("VW", vw), ("CHAINS", chains), ("BLOCK", PROBE_BLOCK))
    knl = cl.Kernel(build(ctx, "fma_probe.cl", defines), "fma_probe")
    local = min(256, knl.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, device))
    # Eight work-groups per compute unit keep every SM (or core) busy, with no lone tail.
    size = device.max_compute_units * local * 8
    out = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, size * 4)

    def launch(iters: int) -> float:
        knl.set_args(out, np.int32(iters), np.float32(0.9999), np.float32(1e-4))
        ev = cl.enqueue_nd_range_kernel(queue, knl, (size,), (local,))
        ev.wait()
        return (ev.profile.end - ev.profile.start) * 1e-9

    iters, seconds = 1, launch(1)
    while seconds < PROBE_SECONDS / 4 and iters < 2**24:
        iters *= 4
        seconds = launch(iters)
    iters = max(1, min(2**30, round(iters * PROBE_SECONDS / max(seconds, 1e-9))))
    best = min(launch(iters) for _ in range(PROBE_REPEATS))
    return 2 * vw * chains * PROBE_BLOCK * iters * size / best / 1e9


def probe_fma(device: cl.Device) -> dict[str, object]:
    """Run the FMA probe on ``device`` (uncached): the best rate over `PROBE_VARIANTS`.

    The best launch counts, not the median: clock ramps and other work on the device only
    ever lower a rate.
    """
    best: dict[str, object] = {"gflops": 0.0}
    for vw, chains in PROBE_VARIANTS:
        rate = _probe_variant(device, vw, chains)
        if rate > best["gflops"]:
            best = {"gflops": rate, "variant": f"float{vw} x {chains} chains"}
    return best


def _read_cache(folder: Path) -> dict[str, dict]:
    """peak.json in the cache ``folder``, where it passes the trust rule (`volconv.device.cache`);
    else empty: measured again."""
    text = read_cached(folder, PEAK_FILE, "measured again")
    try:
        data = json.loads(text) if text is not None else {}
    except ValueError:  # unreadable: measured again, and replaced
        return {}
    return data if isinstance(data, dict) else {}


def measured_peak(
    device: cl.Device,
    *,
    refresh: bool = False,
    probe: bool = True,
    cache_dir: Path | None = None,
) -> float | None:
    """The FMA probe's FP32 rate of ``device`` in GFLOP/s, or None when the probe fails.

    Cached in ``peak.json`` in the cache folder (``cache_dir``, default
    `volconv.device.cache.default_cache_dir`, under its trust rule) per device key and probe source;
    ``refresh`` measures again and replaces the entry. With
    ``probe=False`` only the cache is read (None when it has no entry): `volconv run` records
    the probe's rate when known and never spends seconds measuring it.
    """
    return _measured(device, "", probe_fma, "gflops", refresh, probe, cache_dir)


def measured_bandwidth(
    device: cl.Device,
    *,
    refresh: bool = False,
    probe: bool = True,
    cache_dir: Path | None = None,
) -> float | None:
    """The device's copy bandwidth in GB/s (bytes read plus written), cached beside the FMA
    probe's rate and read the same way (see `measured_peak`): what the memory-bound separable
    passes are measured against."""
    return _measured(device, " | copy", probe_copy, "gbps", refresh, probe, cache_dir)


def _measured(
    device: cl.Device,
    suffix: str,
    measure: Callable[[cl.Device], dict[str, object]],
    field: str,
    refresh: bool,
    probe: bool,
    cache_dir: Path | None,
) -> float | None:
    folder = cache_folder(cache_dir)
    key = _cache_key(device) + suffix
    if not refresh and (hit := _read_cache(folder).get(key)):
        with contextlib.suppress(KeyError, TypeError, ValueError):  # damaged: measured again
            return float(hit[field])
    if not probe:
        return None
    try:
        entry = measure(device)
    except cl.Error as e:  # a driver that cannot build or run the probe: unknown
        log.warning("probe %s failed on %s: %s", measure.__name__, device.name.strip(), e)
        return None
    entry["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    cache = _read_cache(folder)  # re-read: another process may have added a device
    cache[key] = entry
    # atomic, through a private file: a reader never sees half a file
    write_cached(folder, PEAK_FILE, (json.dumps(cache, indent=1) + "\n").encode())
    return float(entry[field])


def probe_copy(device: cl.Device, repeats: int = 3) -> dict[str, object]:
    """Best of ``repeats`` device-to-device copies of up to 256 MiB, in GB/s counting the
    bytes read and written (the memory traffic a pass over the same data makes)."""
    ctx, queue = context_for(device)
    n = int(min(256 << 20, device.max_mem_alloc_size // 2))
    src = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n)
    dst = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n)
    cl.enqueue_fill_buffer(queue, src, np.uint8(1), 0, n).wait()
    best = math.inf
    for _ in range(repeats + 1):  # the first is a warm-up
        event = cl.enqueue_copy(queue, dst, src)
        event.wait()
        best = min(best, (event.profile.end - event.profile.start) * 1e-9)
    return {"gbps": 2 * n / best / 1e9, "bytes": n}


def fp32_peak(device: cl.Device, measured_gflops: float | None) -> Peak:
    """The FP32 peak that fractions of peak are taken against: the model, or the FMA probe's
    rate where the probe reached more (a model built on the base clock a VM reports reads
    low), so that no FP32 path ever shows more than 100 % of it. ``how`` says which."""
    model = theoretical_peak(device)
    if measured_gflops and model.gflops and measured_gflops > model.gflops:
        return Peak(
            measured_gflops,
            f"FMA probe, above the model's {model} ({model.how}): the clock reported is low",
        )
    return model
