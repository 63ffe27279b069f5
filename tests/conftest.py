"""Shared fixtures: the OpenCL devices under test and the contract's tolerance.

Tests that take the ``device`` fixture (a ``pyopencl.Device``) or ``device_spec`` (its spec, for
a pipeline file or ``--device``) run once on every OpenCL device present, as pyopencl's own
tests do; ``VOLCONV_TEST_DEVICE`` (a spec as ``--device`` takes it: ``cpu``, ``nvidia``,
``0:1``) narrows them to one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage as ndi

from volconv.checks import spec_tolerance
from volconv.device.devices import NoDeviceError, list_devices, select_device


def _specs_under_test() -> list[str]:
    if spec := os.environ.get("VOLCONV_TEST_DEVICE"):
        return [spec]
    return [d.spec for d in list_devices()] or ["auto"]


@pytest.fixture(scope="session", params=_specs_under_test())
def device_spec(request) -> str:
    """The spec of each OpenCL device present in turn (as ``--device`` and ``run.device``
    take it), or the one VOLCONV_TEST_DEVICE names: the pipeline-level tests that exercise
    the device put it in their pipeline or command line."""
    return request.param


@pytest.fixture(scope="session")
def device(device_spec):
    """Each OpenCL device present in turn, or the one VOLCONV_TEST_DEVICE names."""
    try:
        return select_device(device_spec)
    except (NoDeviceError, ValueError) as e:
        pytest.fail(f"no OpenCL device for the tests ({device_spec!r}): {e}")


def reference(volume: np.ndarray, kernels: np.ndarray, mode: str, cval: float = 0.0):
    """scipy.ndimage.convolve in float64 of each kernel, stacked: the oracle of docs/contract.md."""
    v = np.asarray(volume, np.float64)
    return np.stack([ndi.convolve(v, np.asarray(k), mode=mode, cval=cval) for k in kernels])


def assert_spec_close(out: np.ndarray, volume: np.ndarray, kernels: np.ndarray, ref: np.ndarray):
    """Every response within the contract's float32 tolerance of the float64 reference."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out))
    vmax = float(np.max(np.abs(volume))) if np.size(volume) else 0.0
    for f, k in enumerate(kernels):
        tol = spec_tolerance(k, vmax)
        err = float(np.max(np.abs(out[f].astype(np.float64) - ref[f])))
        assert err <= tol, f"filter {f}: max error {err:.3g} > tolerance {tol:.3g}"


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (as root; skipped with the reason where mounting is not allowed)."""
    mounts = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=True)
