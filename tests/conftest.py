"""Shared fixtures: the OpenCL device under test and SPEC.md's tolerance."""

from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.ndimage as ndi

from volconv.device import NoDeviceError, select_device

# SPEC.md: |stored - reference| <= SPEC_RTOL * sum(|kernel|) * max(|v|) + SPEC_ATOL
SPEC_RTOL = 1e-5
SPEC_ATOL = 1e-6


@pytest.fixture(scope="session")
def device():
    """The device the tests run on: VOLCONV_TEST_DEVICE, else PoCL's CPU device, else any."""
    spec = os.environ.get("VOLCONV_TEST_DEVICE", "cpu")
    try:
        return select_device(spec)
    except NoDeviceError as e:
        pytest.fail(f"no OpenCL device for the tests ({spec!r}): {e}")


def reference(volume: np.ndarray, kernels: np.ndarray, mode: str, cval: float = 0.0):
    """scipy.ndimage.convolve in float64 of each kernel, stacked: the oracle of SPEC.md."""
    v = np.asarray(volume, np.float64)
    return np.stack([ndi.convolve(v, k, mode=mode, cval=cval) for k in np.asarray(kernels)])


def assert_spec_close(out: np.ndarray, volume: np.ndarray, kernels: np.ndarray, ref: np.ndarray):
    """Every response within SPEC.md's float32 tolerance of the float64 reference."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out))
    vmax = float(np.max(np.abs(volume))) if np.size(volume) else 0.0
    for f, k in enumerate(np.asarray(kernels)):
        tol = SPEC_RTOL * float(np.sum(np.abs(k))) * vmax + SPEC_ATOL
        err = float(np.max(np.abs(out[f].astype(np.float64) - ref[f])))
        assert err <= tol, f"filter {f}: max error {err:.3g} > tolerance {tol:.3g}"
