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


@pytest.mark.parametrize(
    ("src_t", "dst_t", "shape", "halo_"),
    [("uint8", "float32", (37, 20, 45), (3, 2, 5)), ("uint8", "uint8", (40, 7, 33), (0, 1, 2)),
     ("float32", "float32", (33, 9, 64), (1, 4, 0))],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["reflect", "constant"])
def test_pad_tiles_gathers_an_x_fastest_source_as_the_index_maps_say(
    device, src_t, dst_t, shape, halo_, mode
):
    """kernels/pad.cl's pad_tiles (GPUs, sources whose axis 0 is the fastest): every padded
    element is the source's at the three index maps, cval where one says outside; extents and
    a padded row length (an alignment tail of -1s) that the 32 x 32 tiles do not divide."""
    import pyopencl as cl

    from volconv.device.programs import build
    from volconv.engines.padder import PAD_ROWS, PAD_TILE
    from volconv.plan.direct import CL_TYPES

    rng = np.random.default_rng(1)
    src = np.asfortranarray(rng.integers(0, 255, shape).astype(src_t))
    cval = 7.0 if mode == "constant" else 0.0
    maps = [extend_indices(n, -h, n + h, mode) for n, h in zip(shape, halo_, strict=True)]
    maps[2] = np.concatenate([maps[2], [-1] * 3])  # the alignment tail
    p0, p1, p2 = (len(m) for m in maps)
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    defines = (("SRC_T", CL_TYPES[np.dtype(src_t)]), ("DST_T", CL_TYPES[np.dtype(dst_t)]),
               ("PAD_TILE", PAD_TILE), ("PAD_ROWS", PAD_ROWS))  # fmt: skip
    kernel = cl.Kernel(build(ctx, "pad.cl", defines), "pad_tiles")
    mf = cl.mem_flags
    bufs = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
            for a in (src.reshape(-1, order="F"), *(m.astype(np.int32) for m in maps))]  # fmt: skip
    out = np.empty((p0, p1, p2), dst_t)
    dst = cl.Buffer(ctx, mf.WRITE_ONLY, out.nbytes)
    nx, ny = shape[:2]
    kernel(queue, (-(-p2 // PAD_TILE) * PAD_TILE, p1 * PAD_ROWS, -(-p0 // PAD_TILE)),
           (PAD_TILE, PAD_ROWS, 1), bufs[0], dst, *bufs[1:], np.int32(p0), np.int32(p1),
           np.int32(p2), np.int64(1), np.int64(nx), np.int64(nx * ny), np.float32(cval),
           np.int32(0), np.int32(0))  # fmt: skip
    cl.enqueue_copy(queue, out, dst)
    i0, i1, i2 = np.ix_(*maps)
    inside = (i0 >= 0) & (i1 >= 0) & (i2 >= 0)
    expected = np.where(inside, src[np.maximum(i0, 0), np.maximum(i1, 0), np.maximum(i2, 0)],
                        cval).astype(dst_t)  # fmt: skip
    np.testing.assert_array_equal(out, expected)
