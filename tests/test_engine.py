"""convolve_bank against scipy.ndimage.convolve (float64) at the contract's tolerance."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import scipy.ndimage as ndi
import scipy.signal
from conftest import assert_spec_close, reference

from volconv import BankConvolver, convolve_bank
from volconv.checks import MODES
from volconv.plan.direct import Block, Pass, make_plan

RNG = np.random.default_rng(20261122)


def random_volume(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return RNG.standard_normal(shape).astype(dt) * 50
    info = np.iinfo(dt)
    return RNG.integers(max(info.min, -3000), min(info.max, 3000), shape, endpoint=True).astype(dt)


def random_bank(n: int, extents: tuple[int, int, int]) -> np.ndarray:
    return RNG.standard_normal((n, *extents))


def assert_matches_scipy(volume, kernels, mode, cval=0.0, **kwargs):
    out = convolve_bank(volume, kernels, mode, cval, **kwargs)
    assert out.dtype == np.float32
    assert_spec_close(out, volume, kernels, reference(volume, kernels, mode, cval))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
@pytest.mark.parametrize("shape", [(1, 7, 33), (17, 29, 40)])
def test_every_mode_dtype_and_awkward_shape(device, mode, dtype, shape):
    assert_matches_scipy(
        random_volume(shape, dtype), random_bank(3, (3, 5, 7)), mode, cval=1.5, device=device
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 8, 16])
def test_every_mode_for_vector_widths(device, mode, n):
    assert_matches_scipy(
        random_volume((10, 11, 35), "uint8"), random_bank(n, (3, 4, 5)), mode, 7.0, device=device
    )


@pytest.mark.parametrize("n", [1, 3, 8, 13, 16, 33])
def test_bank_sizes(device, n):
    assert_matches_scipy(
        random_volume((11, 13, 21), "float32"), random_bank(n, (3, 3, 3)), "reflect", device=device
    )


@pytest.mark.parametrize("extents", [(1, 1, 1), (2, 2, 2), (3, 3, 3), (4, 4, 4), (7, 7, 7),
                                     (3, 5, 7), (2, 1, 4), (5, 4, 1)])  # fmt: skip
@pytest.mark.parametrize("mode", ["mirror", "constant", "wrap"])
def test_odd_even_and_mixed_extents(device, extents, mode):
    assert_matches_scipy(
        random_volume((9, 12, 19), "uint8"), random_bank(2, extents), mode, cval=-4, device=device
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("slab_depth", [1, 2, 3, 5])
def test_slab_seams_inside_the_kernel(device, mode, slab_depth):
    """Forced slab depths put seams inside a 7-deep kernel: the result must not change."""
    volume = random_volume((13, 10, 12), "int16")
    assert_matches_scipy(
        volume, random_bank(4, (7, 3, 4)), mode, cval=2.0, device=device, slab_depth=slab_depth
    )


# numpy.pad's names for scipy.ndimage's boundary modes
NUMPY_PAD = {"reflect": "symmetric", "mirror": "reflect", "nearest": "edge", "wrap": "wrap",
             "constant": "constant"}  # fmt: skip


def fft_reference(volume: np.ndarray, kernel: np.ndarray, mode: str, cval: float = 0.0):
    """scipy.ndimage.convolve in float64 by FFT, for kernels too large for scipy's direct sum in
    test time (a 31^3 kernel over 40^3 takes it 30 s); its error is ~1e-13 of the tolerance's."""
    widths = [(k - 1 - k // 2, k // 2) for k in kernel.shape]
    kw = {"constant_values": cval} if mode == "constant" else {}
    extended = np.pad(np.asarray(volume, np.float64), widths, NUMPY_PAD[mode], **kw)
    return scipy.signal.fftconvolve(extended, kernel, mode="valid")


@pytest.mark.parametrize("mode", MODES)
def test_fft_reference_is_scipy(mode):
    volume, kernel = random_volume((9, 10, 11), "float32"), random_bank(1, (4, 5, 3))[0]
    ref = ndi.convolve(volume.astype(np.float64), kernel, mode=mode, cval=2.5)
    np.testing.assert_allclose(fft_reference(volume, kernel, mode, 2.5), ref, atol=1e-9)


def gaussian(size: int, sigma: float) -> np.ndarray:
    """A normalised 3D Gaussian of extent ``size`` per axis, as the bank builds it."""
    g = np.exp(-0.5 * (np.arange(size) - size // 2) ** 2 / sigma**2)
    g /= g.sum()
    return g[:, None, None] * g[None, :, None] * g[None, None, :]


@pytest.mark.parametrize("mode", ["reflect", "constant"])
@pytest.mark.parametrize("volume", ["constant 255", "random uint8"])
def test_31_cube_kernels_on_bright_data(device, mode, volume):
    """The contract holds up to 31^3: one FP32 running sum over 29,791 taps did not (1.5x the
    tolerance for a sigma 5 Gaussian over 255s); the kernel sums such filters plane by plane."""
    shape = (40, 40, 40)
    vol = np.full(shape, 255, np.uint8)
    if volume == "random uint8":
        vol = RNG.integers(0, 256, shape, dtype=np.uint8)
    kernels = np.stack([gaussian(31, 5.0), RNG.random((31, 31, 31))])
    out = convolve_bank(vol, kernels, mode, device=device)
    ref = np.stack([fft_reference(vol, k, mode) for k in kernels])
    assert_spec_close(out, vol, kernels, ref)


def test_64_cube_bank_of_8(device):
    assert_matches_scipy(
        random_volume((64, 64, 64), "uint8"), random_bank(8, (7, 7, 7)), "reflect", device=device
    )


@pytest.mark.parametrize("mode", ["nearest", "wrap"])
def test_4d_is_t_independent_volumes(device, mode):
    volume = random_volume((9, 10, 11, 3), "uint16")
    kernels = random_bank(3, (3, 2, 5))
    out = convolve_bank(volume, kernels, mode, device=device, slab_depth=4)
    assert out.shape == (3, 9, 10, 11, 3)
    for t in range(3):
        frame = volume[..., t]
        assert_spec_close(out[..., t], frame, kernels, reference(frame, kernels, mode))


@pytest.mark.parametrize("cval", [0.5, -1.0, 300.0])
def test_cval_outside_the_input_type(device, cval):
    """A uint8 volume with a cval uint8 cannot hold is padded in float32."""
    assert_matches_scipy(
        random_volume((6, 7, 8), "uint8"),
        random_bank(2, (3, 3, 3)),
        "constant",
        cval,
        device=device,
    )


@pytest.mark.parametrize("dtype", [">i2", ">f4", "float64", "int32", "int8", "bool"])
def test_other_dtypes_and_byte_orders(device, dtype):
    volume = random_volume((8, 9, 10), "int16").astype(dtype)
    assert_matches_scipy(volume, random_bank(2, (3, 3, 3)), "reflect", device=device)


@pytest.mark.parametrize(
    "knobs",
    [{"unroll": 1}, {"unroll": 5}, {"unroll": 32}, {"vector_width": 16}, {"vector_width": 1},
     {"local_size": (1, 1)}, {"local_size": (8, 4)}],
)  # fmt: skip
def test_plan_overrides_keep_the_result(device, knobs):
    assert_matches_scipy(
        random_volume((7, 9, 45), "float32"),
        random_bank(5, (3, 3, 5)),
        "mirror",
        device=device,
        **knobs,
    )


@pytest.mark.parametrize("mode", ["reflect", "wrap", "constant"])
@pytest.mark.parametrize(
    ("n", "unroll", "rows", "row_unroll", "roll"),
    [(1, 8, 4, None, False), (1, 4, 8, None, False), (2, 4, 3, None, False), (4, 4, 2, 1, False),
     (8, 8, 1, 2, False), (8, 8, 1, 0, False), (3, 5, 2, None, False), (16, 2, 2, None, False),
     (1, 8, 4, 4, True), (4, 8, 2, 2, True), (8, 8, 1, 2, True), (8, 8, 1, 1, True),
     (3, 5, 3, None, True),
     (16, 2, 2, 0, True)],
)  # fmt: skip
def test_register_blocks_keep_the_result(device, mode, n, unroll, rows, row_unroll, roll):
    """Outputs per work-item along z and y (rows that do not divide ny, slab seams in the
    7-row kernel), the row loop's unroll and its order (over input rows, or over filter rows
    with a window of input rows): the same result."""
    volume = random_volume((11, 13, 37), "uint8")
    kernels = random_bank(n, (7, 5, 7))
    plan = make_plan(volume.shape, volume.dtype, kernels.shape[1:], n, mode, 3.0,
                     device, unroll=unroll, rows=rows, slab_depth=6)  # fmt: skip
    plan = replace(plan, row_unroll=row_unroll, roll=roll)
    conv = BankConvolver(kernels, volume.shape, volume.dtype, mode, 3.0, device=device,
                         plan=plan)  # fmt: skip
    out = np.concatenate([conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
                          for a, b in conv.slabs()], axis=1)  # fmt: skip
    assert_spec_close(out, volume, kernels, reference(volume, kernels, mode, 3.0))


@pytest.mark.parametrize("mode", ["reflect", "constant"])
def test_each_pass_with_its_own_block_keeps_the_result(device, mode):
    """Passes of 4, 2 and 1 filters, each with its own block and work-group (as a GPU plan
    makes them), one rolled, over a padded slab as wide as the widest unroll needs."""
    volume = random_volume((9, 13, 37), "uint8")
    kernels = random_bank(7, (5, 7, 3))
    plan = make_plan(volume.shape, volume.dtype, kernels.shape[1:], 7, mode, 2.0, device,
                     vector_width=4, unroll=16, slab_depth=5, pad_float=False)  # fmt: skip
    passes = (
        Pass(0, 4, 4, Block(4, 2, None, False, (8, 4, 1))),
        Pass(4, 2, 2, Block(8, 4, None, False, (4, 4, 1))),
        Pass(6, 1, 1, Block(5, 3, 3, True, (4, 2, 1))),
    )
    plan = replace(plan, passes=passes)
    conv = BankConvolver(kernels, volume.shape, volume.dtype, mode, 2.0, device=device,
                         plan=plan)  # fmt: skip
    out = np.concatenate([conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
                          for a, b in conv.slabs()], axis=1)  # fmt: skip
    assert_spec_close(out, volume, kernels, reference(volume, kernels, mode, 2.0))


def tiled_convolve(volume, kernels, mode, cval, device, tiles=2, roll=False, **knobs):
    """The bank through `BankConvolver` with every pass staging its input planes in ``tiles``
    tiles of local memory (bank_conv.cl's INPUT_LOCAL), over input rows or, ``roll``, over
    filter rows; slab by slab (seams inside the kernel). ``knobs`` hold for every pass."""
    plan = make_plan(volume.shape, volume.dtype, kernels.shape[1:], len(kernels), mode, cval,
                     device, input_local=True, slab_depth=4, pad_float=False,
                     **knobs)  # fmt: skip
    plan = replace(plan, input_local=tiles, **({"roll": True, "row_unroll": 2} if roll else {}))
    assert all(p.block is None for p in plan.passes)
    assert plan.build_options(plan.passes[0])["INPUT_LOCAL"] == tiles
    conv = BankConvolver(kernels, volume.shape, volume.dtype, mode, cval, device=device,
                         plan=plan)  # fmt: skip
    return np.concatenate([conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
                           for a, b in conv.slabs()], axis=1)  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 8, 13])
def test_input_tiles_keep_the_result_in_every_mode(device, mode, n):
    """Input planes staged in local memory: every mode, banks of one pass and of several,
    even extents, ny and nz that the work-group's block does not divide (work-items past
    the edges meet the barriers and store nothing)."""
    volume = random_volume((9, 13, 37), "uint8")
    kernels = random_bank(n, (3, 4, 6))
    out = tiled_convolve(volume, kernels, mode, 5.0, device, unroll=8, local_size=(4, 2))
    assert_spec_close(out, volume, kernels, reference(volume, kernels, mode, 5.0))


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
@pytest.mark.parametrize(
    ("extents", "unroll", "rows", "roll", "local"),
    [((7, 7, 7), 8, 1, False, (32, 4)), ((7, 5, 7), 4, 2, True, (8, 4)),
     ((2, 6, 5), 16, 3, False, (2, 8)), ((5, 3, 4), 12, 2, True, (4, 2))],
)  # fmt: skip
def test_input_tiles_keep_the_result_for_blocks_and_types(
    device, tiles, dtype, extents, unroll, rows, roll, local
):
    """One or two tiles (the next plane staged while this one is read), integer and float
    slabs, blocks over input rows or over filter rows, unrolls 4-16 (the tile's column
    order differs by unroll), work-groups wider or narrower than the volume."""
    volume = random_volume((7, 11, 29), dtype)
    kernels = random_bank(3, extents)
    out = tiled_convolve(volume, kernels, "reflect", 0.0, device, tiles, roll, vector_width=4,
                         unroll=unroll, rows=rows, local_size=local)  # fmt: skip
    assert_spec_close(out, volume, kernels, reference(volume, kernels, "reflect"))


def test_input_tiles_in_4d(device):
    volume = random_volume((6, 9, 21, 2), "uint8")
    kernels = random_bank(8, (3, 3, 7))
    out = convolve_bank(volume, kernels, "mirror", device=device, input_local=True,
                        unroll=8, local_size=(2, 4), slab_depth=3)  # fmt: skip
    for t in range(2):
        frame = volume[..., t]
        assert_spec_close(out[..., t], frame, kernels, reference(frame, kernels, "mirror"))


@pytest.mark.parametrize("pad_float", [False, True])
@pytest.mark.parametrize("dtype", ["uint8", "int16"])
def test_integer_slab_or_float_slab_keep_the_result(device, dtype, pad_float):
    """CPUs pad integers to a float32 slab (the hot loop then broadcasts from memory), GPUs
    keep the source type: both exact, in constant mode with a cval that fits."""
    volume = random_volume((9, 10, 11), dtype)
    kernels = random_bank(3, (3, 5, 3))
    conv = BankConvolver(kernels, volume.shape, volume.dtype, "constant", 7.0, device=device,
                         pad_float=pad_float)  # fmt: skip
    assert conv.plan.pad_dtype == (np.float32 if pad_float else volume.dtype)
    assert_matches_scipy(volume, kernels, "constant", 7.0, device=device, pad_float=pad_float)


def test_memory_budget_splits_into_slabs(device):
    volume = random_volume((24, 16, 16), "uint8")
    kernels = random_bank(4, (5, 5, 5))
    conv = BankConvolver(kernels, volume.shape, volume.dtype, device=device, memory_budget=40_000)
    assert conv.plan.n_slabs > 1
    assert_matches_scipy(volume, kernels, "reflect", device=device, memory_budget=40_000)


def test_timings_and_gflop(device):
    volume = random_volume((8, 8, 8), "uint8")
    conv = BankConvolver(random_bank(8, (3, 3, 3)), volume.shape, volume.dtype, device=device)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
    assert conv.executed_gflop == pytest.approx(2 * 8 * 27 * 512 / 1e9)
    assert all(conv.timings[k] > 0 for k in ("upload", "pad", "kernel", "download"))
    assert np.all(conv.time_kernel(0, 8, 2) > 0)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "names"),
    [
        (([1, 2, 3], np.ones((1, 3, 3, 3))), {}, TypeError, "volume"),
        ((np.zeros((4, 4)), np.ones((1, 3, 3, 3))), {}, ValueError, "volume"),
        ((np.zeros((4, 4, 4), complex), np.ones((1, 3, 3, 3))), {}, TypeError, "volume"),
        ((np.zeros((4, 4, 4)), np.ones((3, 3, 3))), {}, ValueError, "kernels"),
        ((np.zeros((4, 4, 4)), np.ones((65, 1, 1, 1))), {}, ValueError, "kernels"),
        ((np.zeros((4, 4, 4)), np.ones((1, 32, 1, 1))), {}, ValueError, "kernels"),
        ((np.zeros((4, 4, 4)), np.full((1, 3, 3, 3), np.nan)), {}, ValueError, "kernels"),
        ((np.zeros((4, 4, 4)), np.ones((1, 3, 3, 3)), "bogus"), {}, ValueError, "mode"),
        ((np.zeros((4, 4, 4)), np.ones((1, 3, 3, 3)), "constant", "x"), {}, TypeError, "cval"),
        ((np.zeros((4, 4, 4)), np.ones((1, 3, 3, 3))), {"slab_depth": 0}, ValueError, "slab_depth"),
        (
            (np.zeros((4, 4, 4)), np.ones((1, 3, 3, 3))),
            {"device": "no-such"},
            ValueError,
            "device 'no-such'",
        ),
    ],
)
def test_bad_arguments_name_the_argument(args, kwargs, error, names):
    with pytest.raises(error, match=names):
        convolve_bank(*args, **kwargs)


def test_convolve_slab_rejects_a_range_that_is_not_a_slab(device):
    conv = BankConvolver(
        random_bank(1, (3, 3, 3)), (10, 4, 4), np.uint8, device=device, slab_depth=4
    )
    volume = np.zeros((10, 4, 4), np.uint8)
    with pytest.raises(ValueError, match="slab"):
        conv.convolve_slab(0, 10, volume)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", ["uint8", "int16"])
@pytest.mark.parametrize("resident", [False, True], ids=["runs", "resident"])
def test_a_whole_frame_uploads_as_it_is_in_either_layout(device, mode, order, dtype, resident):
    """A frame in the file's own layout (x-fastest NIfTI: order F) goes to the device without a
    host transpose: kept there whole (GPUs), or its rows copied run by run (slabs whose rows
    wrap around, in wrap or reflect, take several runs)."""
    rng = np.random.default_rng(3)
    volume = rng.integers(0, 200, (11, 7, 9)).astype(dtype)
    frame = np.asarray(volume, order=order)
    kernels = rng.standard_normal((3, 5, 3, 4))
    conv = BankConvolver(kernels, volume.shape, volume.dtype, mode, 2.0, device=device,
                         slab_depth=4)  # fmt: skip
    conv.padder.frame_bytes = frame.nbytes if resident else 0
    out = np.empty((3, *volume.shape), np.float32)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, out=out[:, a:b], frame=frame)
    assert_spec_close(out, volume, kernels, reference(volume, kernels, mode, 2.0))
    whole = np.ones((11, 7, 9), np.float32)  # floats are gathered on the host (NaN checks)
    conv_f = BankConvolver(kernels, whole.shape, whole.dtype, mode, device=device, slab_depth=4)
    for a, b in conv_f.slabs():
        by_rows = conv_f.convolve_slab(a, b, whole[conv_f.source_rows(a, b)])
        np.testing.assert_array_equal(conv_f.convolve_slab(a, b, frame=whole), by_rows)


def test_rows_or_frame_one_of_them(device):
    conv = BankConvolver(np.ones((1, 3, 3, 3)), (4, 4, 4), np.uint8, device=device)
    with pytest.raises(ValueError, match="one of them"):
        conv.convolve_slab(0, 4)
    with pytest.raises(ValueError, match="frame: expected shape"):
        conv.convolve_slab(0, 4, frame=np.zeros((4, 4, 5), np.uint8))


@pytest.mark.parametrize(
    ("volume", "kernels", "cval", "name"),
    [
        (np.full((4, 4, 4), 1e300), np.ones((1, 3, 3, 3)), 0.0, "volume"),
        (np.ones((4, 4, 4)), np.full((1, 3, 3, 3), 1e300), 0.0, "kernels"),
        (np.ones((4, 4, 4)), np.ones((1, 3, 3, 3)), 1e300, "cval"),
    ],
)
def test_values_beyond_float32_are_refused_not_made_inf(device, volume, kernels, cval, name):
    # volconv computes in float32: scipy's finite result would come out inf
    with pytest.raises(ValueError, match=rf"{name}.*float32's range"):
        convolve_bank(volume, kernels, "constant", cval, device=device)
    volume[0, 0, 0] = np.inf  # non-finite voxels are not "beyond the range": they propagate
    if name == "kernels":
        out = convolve_bank(volume, np.ones((1, 3, 3, 3)), device=device)
        assert np.isinf(out[0, 0, 0, 0]) and np.isfinite(out[0, 3, 3, 3])


def test_convolve_slab_refuses_an_out_of_another_shape_or_type(device):
    kernels = random_bank(2, (3, 3, 3))
    conv = BankConvolver(kernels, (8, 9, 10), np.float32, device=device, slab_depth=8)
    volume = np.random.default_rng(5).random((8, 9, 10)).astype(np.float32)
    rows = volume[conv.source_rows(0, 8)]
    for out in (np.zeros((2, 2, 9, 10), np.float32), np.zeros((2, 8, 9, 10)),
                np.zeros((2, 8, 9, 20), np.float32)[..., ::2], [[0.0]]):  # fmt: skip
        with pytest.raises(ValueError, match="out must be"):
            conv.convolve_slab(0, 8, rows, out)
    out = np.full((2, 8, 9, 10), np.nan, np.float32)
    assert conv.convolve_slab(0, 8, rows, out) is out
    assert_spec_close(out, volume, kernels, reference(volume, kernels, "reflect"))
