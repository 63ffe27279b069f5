"""volconv.engines.boundary: index maps equal numpy.pad's modes (scipy.ndimage's, by their names),
also where the overhang is longer than the axis, and scipy's centring of even extents."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage as ndi

from volconv.checks import MODES
from volconv.engines.boundary import extend_indices, halo, sources

# scipy.ndimage's mode -> numpy.pad's name for the same extension
NUMPY = {"reflect": "symmetric", "mirror": "reflect", "nearest": "edge", "wrap": "wrap"}


@pytest.mark.parametrize("mode", sorted(NUMPY))
@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("overhang", [0, 1, 3, 10])  # 10 > n: folds more than once
def test_maps_equal_numpy_pad(mode, n, overhang):
    data = np.arange(100, 100 + n)
    want = np.pad(data, overhang, mode=NUMPY[mode])
    if mode == "mirror" and n == 1:
        want = np.full(n + 2 * overhang, data[0])  # numpy refuses; scipy repeats the voxel
    got = data[extend_indices(n, -overhang, n + overhang, mode)]
    np.testing.assert_array_equal(got, want)


def test_constant_marks_outside_with_minus_one():
    m = extend_indices(4, -2, 6, "constant")
    np.testing.assert_array_equal(m, [-1, -1, 0, 1, 2, 3, -1, -1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_halo_and_maps_reproduce_scipy_convolve_1d(mode, k):
    rng = np.random.default_rng(k)
    data, w = rng.random(5), rng.random(k)
    lo, hi = halo(k)
    m = extend_indices(5, -lo, 5 + hi, mode)
    ext = np.where(m >= 0, data[np.maximum(m, 0)], 1.5)
    got = np.correlate(ext, w[::-1], mode="valid")  # convolve = correlate with the flip
    np.testing.assert_allclose(got, ndi.convolve1d(data, w, mode=mode, cval=1.5), rtol=1e-12)


def test_unknown_mode_names_mode():
    with pytest.raises(ValueError, match=r"mode must be one of .*did you mean 'mirror'"):
        extend_indices(3, 0, 3, "miror")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_sources_are_the_distinct_rows_read(mode, n):
    for start in range(-9, 9):
        for stop in range(start, start + 13):
            m = extend_indices(n, start, stop, mode)
            np.testing.assert_array_equal(sources(m), np.unique(m[m >= 0]))
