"""The FP32 peak model (pure arithmetic per vendor) and the FMA probe with its cache."""

from __future__ import annotations

import json

import pyopencl as cl
import pytest

from volconv.device import cache, peak
from volconv.device.peak import CpuInfo, amd_gpu_peak, cpu_peak, intel_gpu_peak, nvidia_peak

AVX512 = frozenset({"sse2", "avx", "avx2", "fma", "avx512f"})
AVX2 = frozenset({"sse2", "avx", "avx2", "fma"})


def test_h100_is_66_9_tflops():
    p = nvidia_peak((9, 0), 132, 1980)
    assert p.gflops == pytest.approx(132 * 128 * 2 * 1.98)  # GFLOP/s
    assert str(p) == "66.9 TFLOP/s"
    assert "132 SM x 128 FP32 lanes (cc 9.0)" in p.how


@pytest.mark.parametrize(
    ("cc", "sms", "mhz", "tflops"),
    [
        ((8, 0), 108, 1410, 19.5),  # A100: 64 lanes per SM
        ((8, 6), 84, 1860, 40.0),  # RTX 3090: 128
        ((7, 0), 80, 1530, 15.7),  # V100
        ((3, 5), 15, 875, 5.04),  # K40: 192
    ],
)
def test_nvidia_table(cc, sms, mhz, tflops):
    assert nvidia_peak(cc, sms, mhz).gflops / 1000 == pytest.approx(tflops, rel=5e-3)


def test_nvidia_unknown_compute_capability():
    p = nvidia_peak((13, 0), 100, 2000)
    assert p.gflops is None
    assert str(p) == "unknown"
    assert "13.0" in p.how


@pytest.mark.parametrize(
    ("target", "cus", "simd", "width", "mhz", "tflops"),
    [
        ("gfx1100", 48, 4, 32, 2500, 61.4),  # RX 7900 XTX: 48 WGPs, dual-issue
        ("gfx1032", 16, 4, 32, 2900, 11.9),  # RX 6600 XT: single issue
        ("gfx90a", 220, 4, 16, 1700, 95.7),  # MI250X: packed FP32
        ("gfx900", 64, 4, 16, 1600, 13.1),  # Vega Frontier Edition
    ],
)
def test_amd_gpus(target, cus, simd, width, mhz, tflops):
    p = amd_gpu_peak(target, cus, simd, width, 1, mhz)
    assert p.gflops / 1000 == pytest.approx(tflops, rel=5e-3)
    assert target in p.how


def test_amd_without_simd_layout_is_unknown():
    assert amd_gpu_peak("gfx1100", 48, 0, 0, 0, 2500).gflops is None


def test_intel_gpus():
    assert intel_gpu_peak("Intel(R) Arc(TM) A770 Graphics", 512, 2400).gflops == pytest.approx(
        512 * 8 * 2 * 2.4
    )
    assert intel_gpu_peak("Intel(R) Data Center GPU Max 1550", 1024, 1600).gflops == (
        pytest.approx(1024 * 16 * 2 * 1.6)
    )
    unknown = intel_gpu_peak("Intel(R) Graphics [0x1234]", 64, 1000)
    assert unknown.gflops is None and "not a family" in unknown.how


@pytest.mark.parametrize(
    ("cpu", "lanes"),
    [
        (CpuInfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", AVX512), 32),
        (CpuInfo("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Silver 4114 CPU", AVX512), 16),
        (CpuInfo("GenuineIntel", 6, 140, "11th Gen Intel(R) Core(TM) i7-1165G7", AVX512), 16),
        (CpuInfo("GenuineIntel", 6, 63, "Intel(R) Xeon(R) CPU E5-2680 v3", AVX2), 16),
        (CpuInfo("GenuineIntel", 6, 45, "Intel(R) Xeon(R) CPU E5-2670", {"sse2", "avx"}), 8),
        (CpuInfo("AuthenticAMD", 0x17, 0x01, "AMD EPYC 7601", AVX2), 8),  # Zen: 128-bit
        (CpuInfo("AuthenticAMD", 0x17, 0x31, "AMD EPYC 7742", AVX2), 16),  # Zen 2
        (CpuInfo("AuthenticAMD", 0x19, 0x11, "AMD EPYC 9654", AVX512), 16),  # Zen 4
        (CpuInfo("AuthenticAMD", 0x1A, 0x02, "AMD EPYC 9755", AVX512), 32),  # Zen 5
    ],
)
def test_cpu_fma_lanes(cpu, lanes):
    cpu = CpuInfo(cpu.vendor, cpu.family, cpu.model, cpu.name, frozenset(cpu.flags))
    p = cpu_peak(cpu, 4, 2000)
    assert p.gflops == pytest.approx(2 * lanes * 4 * 2.0)
    assert f"{lanes} FMA lanes" in p.how


def test_cpu_unknown():
    arm = CpuInfo("", 0, 0, "", frozenset({"fp", "asimd"}))
    assert cpu_peak(arm, 8, 2000).gflops is None
    bulldozer = CpuInfo("AuthenticAMD", 0x15, 1, "AMD Opteron 6274", frozenset(AVX2 - {"avx2"}))
    assert "unknown" in cpu_peak(bulldozer, 8, 2000).how
    xeon = CpuInfo("GenuineIntel", 6, 143, "Xeon", AVX512)
    assert cpu_peak(xeon, 4, 0).gflops is None


def test_theoretical_peak_of_the_test_device(device):
    p = peak.theoretical_peak(device)
    assert p.how
    if device.type & cl.device_type.CPU and "sse2" in peak.cpuinfo().flags:
        assert p.gflops > 0
        assert f"{device.max_clock_frequency / 1000:.3f} GHz" in p.how


# -- the probe and its cache ------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(device, tmp_path_factory):
    """One real probe of the test device into a fresh cache: (cache_dir, GFLOP/s)."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, peak.measured_peak(device, cache_dir=cache)


def test_probe_measures_a_positive_rate(measured, device):
    cache, gflops = measured
    assert gflops > 0
    entries = json.loads((cache / "peak.json").read_text())
    (key, entry), *_ = entries.items()
    assert device.name.strip() in key and device.driver_version.strip() in key
    assert entry["gflops"] == gflops and entry["variant"].startswith("float")


def test_cache_hits_and_refresh_measures_again(measured, device, monkeypatch):
    cache, gflops = measured

    def fake_probe(dev):
        return {"gflops": 123.0, "variant": "fake"}

    monkeypatch.setattr(peak, "probe_fma", fake_probe)
    assert peak.measured_peak(device, cache_dir=cache) == gflops  # from the file
    assert peak.measured_peak(device, cache_dir=cache, refresh=True) == 123.0
    assert peak.measured_peak(device, cache_dir=cache) == 123.0


def test_unreadable_cache_measures_again(device, tmp_path, monkeypatch):
    (tmp_path / "peak.json").write_text("{not json")
    monkeypatch.setattr(peak, "probe_fma", lambda dev: {"gflops": 7.0})
    assert peak.measured_peak(device, cache_dir=tmp_path) == 7.0
    assert json.loads((tmp_path / "peak.json").read_text())


def test_failed_probe_is_none(device, tmp_path, monkeypatch):
    def broken(dev):
        raise cl.RuntimeError("clBuildProgram failed: BUILD_PROGRAM_FAILURE")

    monkeypatch.setattr(peak, "probe_fma", broken)
    assert peak.measured_peak(device, cache_dir=tmp_path) is None
    assert not (tmp_path / "peak.json").exists()


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path
    assert cache.cache_folder() == tmp_path
