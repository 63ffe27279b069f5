"""The separable path against scipy.ndimage (float64) at the contract's tolerance."""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage as ndi
from conftest import assert_spec_close, reference

from volconv.bank.factor import amplification, factorise, reconstruct, reconstruction_ok
from volconv.bank.filters import build_bank
from volconv.checks import MODES, spec_tolerance
from volconv.engines.separable import SeparableConvolver, convolve_separable
from volconv.plan.separable import describe_plan, plan_bank

RNG = np.random.default_rng(20261123)
ROOT = Path(__file__).resolve().parent.parent


def volume(shape: tuple[int, ...], dtype: str = "uint8") -> np.ndarray:
    if np.dtype(dtype).kind == "f":
        return (RNG.standard_normal(shape) * 50).astype(dtype)
    return RNG.integers(0, 256, shape).astype(dtype)


def rank_r(shape: tuple[int, int, int], r: int) -> np.ndarray:
    return sum(
        np.multiply.outer(np.multiply.outer(*(RNG.standard_normal(n) for n in shape[:2])),
                          RNG.standard_normal(shape[2]))
        for _ in range(r)
    )  # fmt: skip


# Every generated type: Gaussian orders 0..2 per axis (anisotropic sigma, odd extents that
# differ per axis), LoG, DoG, box, Sobel and a Gabor pair off the axes.
GENERATED = [
    *({"type": "gaussian", "sigma": [1.2, 0.8, 1.0], "order": list(o), "size": [7, 5, 9]}
      for o in itertools.product(range(3), repeat=3)),
    {"type": "log", "sigma": 1.1, "size": 9},
    {"type": "dog", "sigma": 0.9, "size": 7},
    {"type": "box", "size": [3, 5, 1]},
    {"type": "sobel", "axis": 2},
    {"type": "gabor", "sigma": [2.0, 1.5, 1.2], "frequency": 0.22, "orientation": [30, 25],
     "phase": 40, "size": [9, 7, 11]},
]  # fmt: skip


def assert_matches_scipy(vol, filters, mode, cval=0.0, **options):
    kernels = [getattr(f, "kernel", f) for f in filters]
    out = convolve_separable(vol, filters, mode, cval, **options)
    assert out.dtype == np.float32
    for f, k in enumerate(kernels):  # kernels of different extents: one by one
        ref = reference(vol, k[None], mode, cval)
        assert_spec_close(out[f : f + 1], vol, k[None], ref)
    return out


def test_generated_filters_carry_their_exact_factors():
    filters = build_bank(GENERATED)
    assert len(filters) == len(GENERATED) + 1  # the Gabor pair
    for f in filters:
        assert f.factors is not None, f.name
        scale = np.abs(f.kernel).max()
        assert np.abs(reconstruct(f.factors) - f.kernel).max() <= 1e-12 * scale, f.name
    terms = {f.type: len(f.factors) for f in filters}
    assert terms == {"gaussian": 1, "log": 3, "dog": 2, "box": 1, "sobel": 1, "gabor": 5}


@pytest.mark.parametrize("mode", MODES)
def test_every_generated_type_in_every_mode_with_seams(device, mode):
    """Slabs of 3 rows put seams inside every kernel; constant mode with cval != 0."""
    filters = build_bank(GENERATED)
    assert all(c.path == "separable" for c in plan_bank(filters, force="separable"))
    assert_matches_scipy(
        volume((13, 17, 21)), filters, mode, cval=-7.5, device=device, slab_depth=3,
        choices=plan_bank(filters, force="separable"),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["reflect", "mirror", "nearest", "wrap", "constant"])
def test_gaussians_equal_scipys_own_filters(device, mode):
    sigma, size = [1.5, 0.9, 1.2], [9, 7, 7]
    radius = [k // 2 for k in size]  # the contract's truncate = (size // 2) / sigma, per axis
    orders = [(0, 0, 0), (1, 0, 0), (0, 2, 0), (1, 1, 0), (0, 1, 2)]
    specs = [{"type": "gaussian", "sigma": sigma, "order": list(o), "size": size} for o in orders]
    specs.append({"type": "log", "sigma": 1.3, "size": 11})
    vol = volume((20, 18, 25), "float32")
    out = convolve_separable(vol, build_bank(specs), mode, device=device, slab_depth=7)
    v64 = vol.astype(np.float64)
    for f, o in enumerate(orders):
        ref = ndi.gaussian_filter(v64, sigma, order=o, mode=mode, radius=radius)[None]
        kernel = build_bank([specs[f]])[0].kernel
        assert_spec_close(out[f : f + 1], vol, kernel[None], ref)
    log = ndi.gaussian_laplace(v64, 1.3, mode=mode, truncate=5 / 1.3)
    assert_spec_close(out[-1:], vol, build_bank(specs[-1:])[0].kernel[None], log[None])


@pytest.mark.parametrize("mode", MODES)
def test_mixed_bank_every_path_and_extent(device, mode):
    """Separable, low-rank custom (rank 2), full-rank custom, even and mixed extents."""
    generated = build_bank([{"type": "gaussian", "sigma": 1.0, "order": [0, 1, 0], "size": 7},
                            {"type": "dog", "sigma": 0.8, "size": [7, 7, 5]}])  # fmt: skip
    low_rank = rank_r((9, 8, 10), 2)
    full = RNG.standard_normal((3, 5, 4))
    even = RNG.standard_normal((2, 2, 2))
    bank = [*generated, low_rank, full, even, RNG.standard_normal((3, 5, 4))]
    paths = [c.path for c in plan_bank(bank)]
    assert paths == ["separable", "separable", "low-rank", "direct", "direct", "direct"]
    out = assert_matches_scipy(volume((15, 16, 19)), bank, mode, cval=3.0, device=device,
                               slab_depth=4)  # fmt: skip
    assert np.all(np.isfinite(out))


def test_low_rank_even_extents_through_the_passes(device):
    """Even extents centred as scipy centres them, on the passes (forced), every mode; the
    tree run over blocks of 2 rows inside slabs of 5."""
    bank = [rank_r((4, 3, 6), 2), rank_r((2, 5, 1), 1), rank_r((6, 6, 2), 3)]
    choices = plan_bank(bank, force="separable")
    assert [c.path for c in choices] == ["low-rank", "separable", "low-rank"]
    for mode in MODES:
        options = {"device": device, "slab_depth": 5, "block_rows": 2, "choices": choices}
        assert_matches_scipy(volume((11, 9, 14), "int16"), bank, mode, -2.0, **options)


# A bank for the fused kernel: every kind of factor, extents that differ per axis and per
# filter (even ones from a custom rank-2 kernel), 6 responses x 9 axis-0 taps of partial sums.
FUSED = [
    {"type": "gaussian", "sigma": [1.2, 0.8, 1.0], "order": [1, 0, 2], "size": [7, 5, 9]},
    {"type": "log", "sigma": 1.1, "size": 9},
    {"type": "dog", "sigma": 0.9, "size": [7, 7, 5]},
    {"type": "box", "size": [3, 5, 1]},
    {"type": "sobel", "axis": 2},
]


@pytest.mark.parametrize("mode", MODES)
def test_the_fused_kernel_in_every_mode_with_seams(device, mode):
    """Slabs of 3 rows, chunks of 2 rows and tiles of 4 x 8 put seams inside every kernel and
    tiles past the volume's edges; constant mode with cval != 0."""
    bank = [*build_bank(FUSED), rank_r((4, 3, 6), 2)]
    options = {"choices": plan_bank(bank, force="separable"), "fused": True, "tile": (4, 8, 2),
               "slab_depth": 3}  # fmt: skip
    conv = SeparableConvolver(bank, (13, 17, 21), np.uint8, mode, -7.5, device=device, **options)
    assert conv.plan.fused and conv.pass_counts[2] >= len(bank)
    assert_matches_scipy(volume((13, 17, 21)), bank, mode, -7.5, device=device, **options)


def test_the_fused_kernel_beside_direct_groups_and_nonfinite_voxels(device):
    """The default tile over a volume smaller than it; direct filters of two extents beside the
    fused ones; NaN and +-Inf where scipy puts them."""
    bank = [*build_bank(FUSED[:3]), RNG.standard_normal((3, 5, 4)), RNG.standard_normal((2, 2, 2))]
    vol = volume((11, 9, 14), "float32")
    vol[5, 4, 7], vol[0, 0, 0], vol[10, 8, 13] = np.nan, np.inf, -np.inf
    out = convolve_separable(vol, bank, "mirror", device=device, fused=True, slab_depth=4)
    ref = reference(vol, [getattr(f, "kernel", f) for f in bank], "mirror")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref))
    finite = np.isfinite(ref)
    for f, k in enumerate(bank):
        k = getattr(k, "kernel", k)
        m = float(np.max(np.abs(vol[np.isfinite(vol)])))
        assert np.max(np.abs(out[f][finite[f]] - ref[f][finite[f]])) <= spec_tolerance(k, m)


def test_the_fused_kernel_is_the_gpus_for_banks_that_fit():
    """GPUs fuse a bank whose values fit in registers (the demo bank, planned by the
    fused cost model: every filter separable) and run a larger one as the pass tree; CPUs run
    the tree; asking to fuse a bank that does not fit is an error."""
    from test_plan import fake_device

    from volconv.plan.separable import MAX_FUSED_VALUES, make_separable_plan

    bank = tomllib.loads((ROOT / "pipelines" / "demo.toml").read_text())["bank"]
    demo = build_bank(bank["filter"], bank["size"])
    n = MAX_FUSED_VALUES // 8 + 1  # 7^3 filters: 7 sums and a mid each, one too many
    large = build_bank([{"type": "gaussian", "sigma": 1 + i / 10} for i in range(n)], 7)
    shape = (64, 64, 64)
    for bank, gpu, fused in ((demo, True, True), (demo, False, False), (large, True, False)):
        plan = make_separable_plan(bank, shape, np.uint8, "reflect", 0.0, fake_device(gpu=gpu))
        assert plan.fused == fused
        assert {c.path for c in plan.choices} == {"separable"}
        assert ("fast" in plan.slab_bytes(1)) != fused  # no intermediates when fused
    with pytest.raises(ValueError, match="fused"):
        make_separable_plan(large, shape, np.uint8, "reflect", 0.0, fake_device(), fused=True)


def test_streamed_slabs_are_twice_what_they_compute_again():
    """A streamed slab (four a frame) is at least twice the rows it computes again: the halo
    along axis 0 of a sigma 3 Hessian (24 rows), and a structure tensor's gradients and products
    over its outer reach on both sides (rho 3: 24 rows more)."""
    from test_plan import fake_device

    from volconv.bank.features import build_features, expand
    from volconv.plan.separable import make_separable_plan

    def depth(tables: list[dict]) -> int:
        ex = expand([], build_features(tables))
        plan = make_separable_plan(ex.filters, (128, 256, 256), np.uint8, "reflect", 0.0,
                                   fake_device(), stream=True, **ex.plan_sizes())  # fmt: skip
        return plan.slab_depth

    assert depth([{"type": "gradient_magnitude", "sigma": 1.0, "name": "g"}]) == 32  # 128 / 4
    assert depth([{"type": "hessian_eigenvalues", "sigma": 3.0, "name": "h"}]) == 48
    st = {"type": "structure_tensor_eigenvalues", "sigma": 1.0, "name": "st"}
    assert depth([{**st, "rho": 1.0}]) == 32
    assert depth([{**st, "rho": 3.0}]) == 2 * (8 + 24)


def test_4d_volume_as_independent_frames(device):
    specs = [
        {"type": "log", "sigma": 1.0, "size": 7},
        {"type": "gaussian", "sigma": 0.7, "order": [0, 0, 1], "size": 5},
    ]
    filters = build_bank(specs)
    vol = volume((10, 12, 13, 3))
    out = convolve_separable(vol, filters, "mirror", device=device, slab_depth=4)
    assert out.shape == (2, *vol.shape)
    for t in range(vol.shape[3]):
        for f, flt in enumerate(filters):
            ref = reference(vol[..., t], flt.kernel[None], "mirror")
            assert_spec_close(out[f : f + 1, ..., t], vol[..., t], flt.kernel[None], ref)


def test_near_low_rank_kernel_falls_back_to_direct(device):
    """Rank 1 plus a perturbation above a quarter of the tolerance: no decomposition may be
    used, so the filter goes direct, and the response is still exact."""
    base = rank_r((7, 7, 7), 1)
    near = base + 1e-4 * np.abs(base).max() * RNG.standard_normal(base.shape)
    assert factorise(near) is None
    assert [c.path for c in plan_bank([near], force="separable")] == ["direct"]
    assert_matches_scipy(volume((12, 10, 11)), [near, base], "reflect", device=device,
                         choices=plan_bank([near, base], force="separable"))  # fmt: skip


def test_cancelling_terms_are_refused(device):
    """A DoG of two close sigmas is a tiny difference of two unit Gaussians: float32 passes of
    those terms would lose the tolerance, so its own factors are refused; a decomposition
    found afresh (whose terms do not cancel) may take their place."""
    dog = build_bank([{"type": "dog", "sigma": 1.0, "sigma2": 1.02, "size": 7}])[0]
    assert amplification(dog.kernel, dog.factors) > 16
    assert not reconstruction_ok(dog.kernel, dog.factors)
    choice = plan_bank([dog], force="separable")[0]
    assert choice.path in ("direct", "low-rank")
    assert choice.terms is not dog.factors
    if choice.path == "low-rank":
        assert reconstruction_ok(dog.kernel, choice.terms)
    assert_matches_scipy(volume((12, 11, 10)), [dog], "nearest", device=device,
                         choices=[choice])  # fmt: skip


def test_custom_decompositions_within_a_quarter_of_the_tolerance():
    laplace = np.zeros((3, 3, 3))
    laplace[1, 1, :] += [1, -2, 1]
    laplace[1, :, 1] += [1, -2, 1]
    laplace[:, 1, 1] += [1, -2, 1]
    for kernel, most in [(rank_r((5, 6, 7), 1), 1), (rank_r((9, 8, 10), 2), 2), (laplace, 4)]:
        terms = factorise(kernel)
        assert terms is not None and len(terms) <= most
        err = np.abs(reconstruct(terms) - kernel).sum()
        assert err <= 0.25e-5 * np.abs(kernel).sum()
    assert factorise(RNG.standard_normal((7, 7, 7))) is None


@pytest.mark.parametrize("fused", [False, True])
def test_equal_factors_are_shared_and_work_is_counted(device, fused):
    """One sigma of the ilastik bank: 12 filters, 4 distinct axis-2 factors, 7 (axis-2,
    axis-1) pairs, 11 distinct terms (fused: 15 distinct (response, pair) combos, the DoG's
    Gaussian feeding two responses); gflop counts each filter's own extent."""
    specs = [{"type": "gaussian", "sigma": 1.0, "order": list(o), "size": 7}
             for o in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2, 0, 0), (0, 2, 0),
                       (0, 0, 2), (1, 1, 0), (1, 0, 1), (0, 1, 1)]]  # fmt: skip
    specs += [{"type": "log", "sigma": 1.0, "size": 7}, {"type": "dog", "sigma": 1.0, "size": 7}]
    shape = (16, 12, 20)
    bank = build_bank(specs)
    conv = SeparableConvolver(bank, shape, np.uint8, device=device, fused=fused,
                              choices=plan_bank(bank, force="separable"))  # fmt: skip
    assert conv.pass_counts == ((4, 7, 15) if fused else (4, 7, 11))
    assert conv.engines == ["separable"]
    assert conv.gflop == pytest.approx(2 * 12 * 343 * np.prod(shape) / 1e9)
    assert 0 < conv.executed_gflop < conv.gflop / 5
    assert conv.kernel_bytes > 0
    mixed = SeparableConvolver([RNG.standard_normal((3, 3, 3)), RNG.standard_normal((2, 4, 5))],
                               shape, np.uint8, device=device)  # fmt: skip
    assert mixed.engines == ["fp32"]
    assert mixed.gflop == pytest.approx(2 * (27 + 40) * np.prod(shape) / 1e9)
    assert mixed.executed_gflop == pytest.approx(mixed.gflop)  # grouped by extent: no padding


def test_describe_plan_names_each_filter():
    filters = build_bank([{"type": "gaussian", "sigma": 1.0, "size": 9, "name": "smooth"}])
    bank = [*filters, RNG.standard_normal((3, 3, 3))]
    text = describe_plan(plan_bank(bank), ["smooth", "mine"])
    assert "smooth" in text and "separable 9x9x9: 1 term" in text
    assert "mine" in text and "direct 3x3x3" in text
    assert text.startswith("paths: 1 direct, 1 separable\n")
    fused = describe_plan(plan_bank(bank), ["smooth", "mine"], fused=True)
    assert fused.startswith("paths: 1 direct, 1 separable (in one fused kernel)\n")


@pytest.mark.parametrize("shape", [(1, 7, 33), (5, 1, 1), (2, 3, 17)])
@pytest.mark.parametrize("mode", MODES)
def test_axes_shorter_than_the_kernels(device, shape, mode):
    """Overhangs longer than the axis fold back as scipy folds them, 1-voxel axes included."""
    specs = [
        {"type": "log", "sigma": 1.0, "size": 7},
        {"type": "gaussian", "sigma": 2.0, "order": [1, 0, 2], "size": 9},
    ]
    assert_matches_scipy(volume(shape, "float32"), build_bank(specs), mode, 4.0, device=device)


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_voxels_on_the_separable_path_equal_scipy(device, mode):
    """NaN and +-Inf reach the outputs the kept taps reach, whatever path a filter takes."""
    filters = build_bank(
        [{"type": "gaussian", "sigma": 1.0, "size": 5}, {"type": "log", "sigma": 1.0},
         {"type": "box", "size": 3}],
        7,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    volume = rng.standard_normal((14, 9, 11)).astype(np.float32)
    volume[3, 4, 5] = np.nan
    volume[9, 0, 2] = np.inf
    volume[12, 8, 10] = -np.inf
    volume[:2, :2, :] = np.nan  # a masked corner
    choices = plan_bank(filters, force="separable")
    conv = SeparableConvolver(filters, volume.shape, volume.dtype, mode, 1.5, device=device,
                              choices=choices, slab_depth=4)  # fmt: skip
    out = np.empty((len(filters), *volume.shape), np.float32)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, volume[conv.source_rows(a, b)], out[:, a:b])
    ref = reference(volume, [f.kernel for f in filters], mode, 1.5)
    for f, k in enumerate(filters):
        np.testing.assert_array_equal(np.isnan(out[f]), np.isnan(ref[f]), err_msg=k.name)
        np.testing.assert_array_equal(np.isposinf(out[f]), np.isposinf(ref[f]), err_msg=k.name)
        np.testing.assert_array_equal(np.isneginf(out[f]), np.isneginf(ref[f]), err_msg=k.name)
        finite = np.isfinite(ref[f])
        m = max(float(np.max(np.abs(volume[np.isfinite(volume)]))), 1.5)
        err = np.max(np.abs(out[f][finite] - ref[f][finite]))
        assert err <= spec_tolerance(k.kernel, m), (k.name, err)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["C", "F"])
def test_a_whole_frame_on_every_path(device, mode, order):
    """Separable passes and direct groups both read a frame in the file's own layout."""
    filters = build_bank(
        [{"type": "gaussian", "sigma": 1.0, "size": 5}, {"type": "sobel", "axis": 2}], 7
    )
    volume = np.random.default_rng(4).integers(0, 255, (13, 8, 10)).astype(np.uint8)
    conv = SeparableConvolver(filters, volume.shape, volume.dtype, mode, 1.0, device=device,
                              choices=plan_bank(filters), slab_depth=5)  # fmt: skip
    assert {c.path for c in conv.plan.choices} == {"separable", "direct"}
    frame = np.asarray(volume, order=order)
    out = np.empty((2, *volume.shape), np.float32)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, out=out[:, a:b], frame=frame)
    assert_spec_close(out, volume, [f.kernel for f in filters],
                      reference(volume, [f.kernel for f in filters], mode, 1.0))  # fmt: skip


def test_convolve_slab_refuses_an_out_of_another_shape_or_type(device):
    filters = build_bank([{"type": "gaussian", "sigma": 1.0}, {"type": "box"}], 3)
    conv = SeparableConvolver(filters, (8, 9, 10), np.float32, device=device, slab_depth=8)
    volume = RNG.random((8, 9, 10)).astype(np.float32)
    rows = volume[conv.source_rows(0, 8)]
    for out in (np.zeros((2, 2, 9, 10), np.float32), np.zeros((2, 8, 9, 10))):
        with pytest.raises(ValueError, match="out must be"):
            conv.convolve_slab(0, 8, rows, out)
    out = np.full((2, 8, 9, 10), np.nan, np.float32)
    assert conv.convolve_slab(0, 8, rows, out) is out
    kernels = [f.kernel for f in filters]
    assert_spec_close(out, volume, kernels, reference(volume, kernels, "reflect"))


def test_the_pass_shape_and_cost_model_follow_the_device_kind():
    """GPUs get narrow vectors (coalesced loads) and costlier passes than CPUs, as measured."""
    from test_plan import fake_device

    from volconv.plan.separable import PASS_SHAPE, make_separable_plan

    filters = build_bank([{"type": "gaussian", "sigma": 3.5, "size": 23}], 7)
    for gpu, kind in ((True, "gpu"), (False, "cpu")):
        plan = make_separable_plan(filters, (32, 32, 32), np.uint8, "reflect", 0.0,
                                   fake_device(gpu=gpu))  # fmt: skip
        assert (plan.vector_width, plan.rows) == PASS_SHAPE[kind]
        assert plan.choices[0].path == "separable"  # 23^3 is separable on both
    small = build_bank([{"type": "gaussian", "sigma": 1.0, "size": 5}], 5)
    assert plan_bank(small, kind="cpu")[0].path == "separable"
    assert plan_bank(small, kind="gpu")[0].path == "direct"  # 125 taps: the direct kernel
