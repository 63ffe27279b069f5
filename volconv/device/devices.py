"""OpenCL devices: listing, choosing, and one lazily made context per device and process.

Nothing here touches OpenCL at import time, so importing volconv before a fork is safe.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyopencl as cl

from volconv.device.driver import driver_started
from volconv.device.peak import Peak, theoretical_peak
from volconv.errors import DeviceError, NoDeviceError

__all__ = ["DeviceError", "NoDeviceError", "list_devices", "select_device"]


# Where driver libraries live (no recursion: PoCL's LLVM package makes a symlink loop under
# /usr/lib that a recursive search never leaves).
LIBRARY_FOLDERS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/usr/local/lib", "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/wsl/lib",
)  # fmt: skip


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


def find_library(name: str, folders: Sequence[str] = LIBRARY_FOLDERS) -> str | None:
    """The path of the shared library file ``name`` (e.g. ``libnvidia-opencl.so.1``) in
    ``LD_LIBRARY_PATH``, ``folders`` or the dynamic linker's cache, else None. Bounded:
    one look per folder and one ``ldconfig -p`` of at most a second."""
    path = os.environ.get("LD_LIBRARY_PATH", "")
    for folder in [*filter(None, path.split(os.pathsep)), *folders]:
        if os.path.isfile(candidate := os.path.join(folder, name)):
            return candidate
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.isfile(p)), None
    )
    if ldconfig is None:
        return None
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=1).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():  # "\tlibfoo.so.1 (libc6,x86-64) => /usr/lib/.../libfoo.so.1"
        if line.strip().startswith(name + " ") and "=>" in line:
            return line.split("=>", 1)[1].strip()
    return None


def device_name(device: cl.Device) -> str:
    """The device as records and tables name it: "NAME (PLATFORM)"."""
    return f"{device.name.strip()} ({device.platform.name.strip()})"


def missing_platform_help() -> str:
    """Why no OpenCL platform shows up here, and what to do about it."""
    vendors = os.environ.get("OCL_ICD_VENDORS", "/etc/OpenCL/vendors")
    icds = sorted(glob.glob(os.path.join(vendors, "*.icd"))) if os.path.isdir(vendors) else []
    lines = [f"No usable OpenCL platform (ICD files in {vendors}: {len(icds)})."]
    nvidia = find_library("libnvidia-opencl.so.1")
    registered = any("nvidia" in _read(p) for p in icds)
    if nvidia and not registered:
        lines.append(
            f"The NVIDIA OpenCL driver ({nvidia}) is installed but not registered; "
            f"register it with:\n  mkdir -p {vendors} && "
            f"echo libnvidia-opencl.so.1 > {vendors}/nvidia.icd"
        )
    pocl = [p for p in icds if "pocl" in _read(p).lower() or "pocl" in os.path.basename(p)]
    cache = pocl_cache_dir()
    if pocl and not _writable(cache):
        lines.append(
            f"PoCL is registered ({pocl[0]}) but cannot write its kernel cache {cache}, and "
            "then offers no device: set POCL_CACHE_DIR (or XDG_CACHE_HOME) to a writable folder."
        )
    elif pocl:
        lines.append(f"PoCL is registered ({pocl[0]}) but offers no device; "
                     "POCL_DEBUG=all volconv devices shows why.")  # fmt: skip
    else:
        lines.append(
            "For the CPU, install PoCL: apt-get install pocl-opencl-icd "
            "(Debian/Ubuntu; the PyPI pocl-binary-distribution wheel fails on some recent CPUs)."
        )
    return "\n".join(lines)


def pocl_cache_dir() -> str:
    """Where PoCL keeps compiled kernels: POCL_CACHE_DIR, else XDG_CACHE_HOME/pocl, else
    ~/.cache/pocl."""
    if os.environ.get("POCL_CACHE_DIR"):
        return os.environ["POCL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pocl")


def _writable(folder: str) -> bool:
    """Whether a file can be made in ``folder`` (made if missing, as PoCL would)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _platforms() -> list[cl.Platform]:
    driver_started()
    try:
        return cl.get_platforms()
    except cl.Error:  # PLATFORM_NOT_FOUND_KHR: no ICD registered at all
        return []


@cache
def _devices() -> list[tuple[int, int, cl.Platform, cl.Device]]:
    """Every device of every platform, enumerated once a process (the driver's platforms and
    devices do not change while it runs): `volconv run` chooses its device, and starts its
    context, before the pipeline's run chooses it again."""
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
    return list(_infos())


def every_device() -> tuple[str, ...]:
    """The specs of ``devices = "all"``: every GPU and accelerator of this machine, else
    every device (a `NoDeviceError` with what to install where there is none)."""
    found = list_devices()
    if not found:
        select_device("auto")  # raises NoDeviceError with what to install
    gpus = [d for d in found if d.kind in ("GPU", "accelerator")]
    return tuple(d.spec for d in gpus or found)


@cache
def _infos() -> tuple[DeviceInfo, ...]:
    """`list_devices`, once a process (its devices do not change: `_devices`)."""
    return tuple(
        DeviceInfo(
            pi, di, p.name.strip(), d.name.strip(), _kind(d), d.max_compute_units,
            d.max_clock_frequency, d.global_mem_size, d.max_mem_alloc_size, d.local_mem_size,
            d.driver_version.strip(), theoretical_peak(d),
        )
        for pi, di, p, d in _devices()
    )  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """What choosing a device looks at: where it is, its names, kind and peak."""

    platform_index: int
    device_index: int
    platform: str
    name: str
    kind: str  # GPU, CPU, accelerator, other
    peak_gflops: float | None = None

    @property
    def spec(self) -> str:
        return f"{self.platform_index}:{self.device_index}"


def _matches(fragment: str, index: int, name: str) -> bool:
    """An index (all digits) or a case-blind fragment of ``name``."""
    fragment = fragment.strip()
    return str(index) == fragment if fragment.isdigit() else fragment.lower() in name.lower()


def choose(candidates: Sequence[Candidate], spec: str, source: str = "device") -> int:
    """The position in ``candidates`` of the device ``spec`` names.

    Parameters
    ----------
    candidates : sequence of Candidate
        The devices of this machine.
    spec : str
        ``auto`` (any), ``gpu``, ``cpu``, a platform index (``"1"``, as pyopencl's
        ``PYOPENCL_CTX`` means it), ``"platform:device"`` (each side an index or a name
        fragment; an empty device side takes any), or a fragment of the platform or device
        name. Among several matches: a GPU first, then the highest peak, then the first.
    source : str
        What the spec came from, for the message: ``device``, ``PYOPENCL_CTX``, ...

    Raises
    ------
    DeviceError
        An empty spec, or one that matches no candidate (the message lists them).
    """
    text = spec.strip() if isinstance(spec, str) else ""
    if not text:
        raise DeviceError(f"{source} {spec!r}: not a device spec (auto, gpu, cpu, a name "
                          "fragment or platform:device)")  # fmt: skip
    word = text.lower()
    if word in ("auto", "gpu", "cpu"):
        pool = [i for i, c in enumerate(candidates) if word in ("auto", c.kind.lower())]
    elif ":" in text:
        plat, dev = text.split(":", 1)
        pool = [
            i for i, c in enumerate(candidates)
            if _matches(plat, c.platform_index, c.platform)
            and (not dev.strip() or _matches(dev, c.device_index, c.name))
        ]  # fmt: skip
    elif text.isdigit():
        pool = [i for i, c in enumerate(candidates) if c.platform_index == int(text)]
    else:
        pool = [i for i, c in enumerate(candidates) if word in f"{c.platform} {c.name}".lower()]
    if not pool:
        names = "; ".join(f"{c.spec} {c.name}" for c in candidates) or "none"
        raise DeviceError(f"{source} {spec!r}: no OpenCL device matches it; available: {names}")

    def rank(i: int) -> tuple[int, float, int]:
        c = candidates[i]
        return (c.kind == "GPU", c.peak_gflops or 0.0, -i)

    return max(pool, key=rank)


def select_device(spec: str | None = None, source: str = "device") -> cl.Device:
    """The device named by ``spec``, else by ``PYOPENCL_CTX``, else the best (see `choose`).

    Raises
    ------
    NoDeviceError
        No OpenCL device at all (the message says what to install).
    DeviceError
        ``spec`` (or ``PYOPENCL_CTX``) names no device of this machine.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        if env := os.environ.get("PYOPENCL_CTX", "").strip():
            spec, source = env, "PYOPENCL_CTX"
        else:
            spec = "auto"
    found = _devices()
    if not found:
        raise NoDeviceError(missing_platform_help())
    return found[choose(_candidates(), spec, source)][3]


@cache
def _candidates() -> list[Candidate]:
    """What `select_device` chooses among, once a process (`_devices`)."""
    return [
        Candidate(pi, di, p.name.strip(), d.name.strip(), _kind(d), theoretical_peak(d).gflops)
        for pi, di, p, d in _devices()
    ]
