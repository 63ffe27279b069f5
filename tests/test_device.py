"""Device listing and choosing: specs over fake device lists, and `volconv devices` in every
state of the machine (no platform, a broken one, a fake vendors folder)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from volconv.device.devices import (
    Candidate,
    DeviceError,
    NoDeviceError,
    choose,
    find_library,
    missing_platform_help,
    select_device,
)
from volconv.engines.direct import convolve_bank

ROOT = Path(__file__).resolve().parents[1]
POCL_ICD = Path("/etc/OpenCL/vendors/pocl.icd")

# Two platforms as a cluster node might have them: NVIDIA with two GPUs, PoCL with a CPU.
MACHINE = [
    Candidate(0, 0, "NVIDIA CUDA", "NVIDIA A100-SXM4-40GB", "GPU", 19500.0),
    Candidate(0, 1, "NVIDIA CUDA", "NVIDIA H100 80GB HBM3", "GPU", 66900.0),
    Candidate(1, 0, "Portable Computing Language", "cpu-haswell-AMD EPYC 7B13", "CPU", 3500.0),
]


@pytest.mark.parametrize(
    ("spec", "chosen"),
    [
        ("auto", 1),  # a GPU first, then the highest peak
        ("  AUTO ", 1),
        ("gpu", 1),
        ("cpu", 2),
        ("0", 1),  # a bare number is a platform (pyopencl's PYOPENCL_CTX)
        ("1", 2),
        ("0:0", 0),
        ("1:0", 2),
        ("0:", 1),  # any device of platform 0
        ("nvidia:a100", 0),  # name fragments on both sides, any case
        ("portable:0", 2),
        ("a100", 0),
        ("epyc 7b13", 2),
        ("cuda", 1),
    ],
)
def test_choose_by_spec(spec: str, chosen: int) -> None:
    assert choose(MACHINE, spec) == chosen


def test_ties_go_to_the_first_and_unknown_peaks_count_as_zero() -> None:
    twins = [Candidate(0, i, "P", "same", "GPU", None) for i in range(3)]
    assert choose(twins, "same") == 0
    cpus = [Candidate(0, 0, "P", "slow", "CPU", None), Candidate(0, 1, "P", "fast", "CPU", 10.0)]
    assert choose(cpus, "auto") == 1


@pytest.mark.parametrize("spec", ["tpu9000", "2", "0:2", "9:9", "amd:", "gpu", " ", ""])
def test_a_spec_that_matches_nothing_is_a_value_error_naming_it(spec: str) -> None:
    machine = MACHINE if spec != "gpu" else MACHINE[2:]
    with pytest.raises(DeviceError) as info:
        choose(machine, spec, source="PYOPENCL_CTX")
    assert isinstance(info.value, ValueError) and not isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert message.startswith(f"PYOPENCL_CTX {spec!r}: ") and "\n" not in message
    if spec.strip():
        assert "available: 0:0 NVIDIA A100" in message or "available: 1:0 cpu" in message


def test_unknown_devices_in_the_api_and_the_environment(device, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"^device 'tpu9000': no OpenCL device matches"):
        convolve_bank(np.zeros((4, 4, 4)), np.ones((1, 3, 3, 3)), device="tpu9000")
    monkeypatch.setenv("PYOPENCL_CTX", "7")
    with pytest.raises(DeviceError, match=r"^PYOPENCL_CTX '7': no OpenCL device matches"):
        select_device()
    with pytest.raises(DeviceError, match="PYOPENCL_CTX"):
        select_device("auto")
    assert select_device(device.name) == device  # an explicit spec wins over the variable
    monkeypatch.setenv("PYOPENCL_CTX", "0")
    assert select_device().platform == select_device("0:").platform


def test_find_library_is_bounded_and_follows_no_folder_tree(tmp_path: Path, monkeypatch):
    lib = tmp_path / "lib" / "libnvidia-opencl.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "again").symlink_to(loop, target_is_directory=True)  # as LLVM's package has one
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert find_library("libnvidia-opencl.so.1", [str(loop), str(lib.parent)]) == str(lib)
    start = time.monotonic()
    assert find_library("libvolconv-nothing.so.9", [str(loop), str(tmp_path)]) is None
    assert time.monotonic() - start < 1.0
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib.parent))
    assert find_library("libnvidia-opencl.so.1", []) == str(lib)
    libc = find_library("libc.so.6", [])  # from the dynamic linker's cache
    assert libc is None or Path(libc).name == "libc.so.6"


def test_missing_platform_help_names_an_unregistered_nvidia_driver(tmp_path, monkeypatch):
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    (vendors / "broken.icd").write_text("libvolconv-no-such-driver.so\n")
    monkeypatch.setenv("OCL_ICD_VENDORS", str(vendors))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    (tmp_path / "libnvidia-opencl.so.1").write_bytes(b"")
    text = missing_platform_help()
    assert text.startswith(f"No usable OpenCL platform (ICD files in {vendors}: 1).")
    assert "is installed but not registered" in text and f"{vendors}/nvidia.icd" in text
    (vendors / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
    assert "not registered" not in missing_platform_help()


def devices(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "volconv", "devices"], cwd=ROOT, timeout=30,
                         capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip
    return run, time.monotonic() - start


def startup_seconds() -> float:
    """The same interpreter and imports without the device search, to subtract."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import volconv.cli, volconv.device.devices"], cwd=ROOT,
                   timeout=30, check=True)  # fmt: skip
    return time.monotonic() - start


@pytest.mark.parametrize("state", ["empty folder", "missing folder", "broken driver"])
def test_devices_explains_a_missing_platform_within_a_second(tmp_path: Path, state: str):
    vendors = tmp_path / "vendors"
    if state != "missing folder":
        vendors.mkdir()
    if state == "broken driver":
        (vendors / "broken.icd").write_text("libvolconv-no-such-driver.so\n")
    run, seconds = devices({"OCL_ICD_VENDORS": str(vendors), "PYOPENCL_CTX": ""})
    assert run.returncode == 1 and "Traceback" not in run.stderr
    icds = 1 if state == "broken driver" else 0
    assert f"No usable OpenCL platform (ICD files in {vendors}: {icds})" in run.stderr
    assert "install PoCL" in run.stderr
    assert seconds - startup_seconds() < 1.0, seconds


@pytest.mark.skipif(not POCL_ICD.is_file(), reason=f"no {POCL_ICD} to copy")
def test_devices_lists_the_platforms_of_a_vendors_folder(tmp_path: Path) -> None:
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    (vendors / "pocl.icd").write_text(POCL_ICD.read_text())
    (vendors / "broken.icd").write_text("libvolconv-no-such-driver.so\n")  # skipped
    run, _ = devices({"OCL_ICD_VENDORS": str(vendors), "PYOPENCL_CTX": ""})
    assert run.returncode == 0, run.stderr
    assert "Portable Computing Language" in run.stdout and "(auto)" in run.stdout
    assert "FP32 peak" in run.stdout and "[CPU]" in run.stdout


@pytest.mark.skipif(not POCL_ICD.is_file(), reason=f"no {POCL_ICD} to copy")
def test_pocl_without_a_writable_cache_is_named_not_said_missing(tmp_path: Path) -> None:
    """PoCL offers no device when it cannot write its kernel cache: say that, not 'install'."""
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    (vendors / "pocl.icd").write_text(POCL_ICD.read_text())
    run, _ = devices({"OCL_ICD_VENDORS": str(vendors), "PYOPENCL_CTX": "",
                      "POCL_CACHE_DIR": "/proc/volconv-no-cache"})  # fmt: skip
    if run.returncode == 0:  # this PoCL works without its cache: nothing to explain
        pytest.skip("PoCL offered a device without a writable cache")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "cannot write its kernel cache /proc/volconv-no-cache" in run.stderr
    assert "POCL_CACHE_DIR" in run.stderr and "install PoCL" not in run.stderr


def test_no_platform_is_not_the_users_mistake(tmp_path: Path) -> None:
    """With no OpenCL at all, select_device says what to install (the CLI's exit 1)."""
    code = (
        "from volconv.device.devices import NoDeviceError, select_device\n"
        "try:\n    select_device('tpu9000')\n"
        "except NoDeviceError as e:\n    print(type(e).__mro__[1].__name__, e)\n"
    )
    env = {**os.environ, "OCL_ICD_VENDORS": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=30)  # fmt: skip
    assert run.stdout.startswith("RuntimeError No usable OpenCL platform"), run.stderr
    assert issubclass(NoDeviceError, RuntimeError)
