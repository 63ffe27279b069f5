"""NaN, +Inf and -Inf voxels against scipy.ndimage.convolve (float64): docs/contract.md.

scipy leaves out taps of weight |w| <= DBL_EPSILON, so a non-finite voxel reaches an output only
through the taps a filter really has: never through the zero taps that pad a small filter to its
bank's common extent, nor through zero taps inside its own extent.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import reference

from volconv import BankConvolver, convolve_bank
from volconv.checks import MODES, spec_tolerance
from volconv.engines.nonfinite import (
    TAP_EPS,
    NonFiniteOverride,
    OverridePlan,
    finite_part,
    kept_taps,
)

RNG = np.random.default_rng(13)
# (mode, cval): every mode, and constant with a cval that is not 0
MODES_CVAL = [(m, 0.0) for m in MODES] + [("constant", 3.5)]


def centred(kernel: np.ndarray, extent: int) -> np.ndarray:
    """An odd-extent ``kernel`` zero-padded to ``extent`` per axis, as a bank pads it."""
    pads = [((extent - k) // 2, (extent - k) // 2) for k in kernel.shape]
    return np.pad(kernel, pads)


def gaussian(size: int, sigma: float) -> np.ndarray:
    g = np.exp(-0.5 * (np.arange(size) - size // 2) ** 2 / sigma**2)
    g /= g.sum()
    return g[:, None, None] * g[None, :, None] * g[None, None, :]


def laplacian() -> np.ndarray:
    """3^3, signed, with zero taps at its edges and corners."""
    k = np.zeros((3, 3, 3))
    k[1, 1, :] = k[1, :, 1] = k[:, 1, 1] = 1.0
    k[1, 1, 1] = -6.0
    return k


def sobel() -> np.ndarray:
    """3^3 Sobel along axis 0: signed, a whole plane of zero taps inside."""
    s = np.array([1.0, 2.0, 1.0])
    return np.array([-1.0, 0.0, 1.0])[:, None, None] * s[None, :, None] * s[None, None, :]


def tiny_taps() -> np.ndarray:
    """Signed random 3^3 with taps scipy leaves out (0, 1e-17, -DBL_EPSILON) and keeps (3e-16)."""
    k = RNG.standard_normal((3, 3, 3))
    k[0, 0, 0], k[1, 0, 2], k[2, 2, 1], k[0, 2, 2] = 0.0, 1e-17, -TAP_EPS, 3e-16
    return k


def mixed_bank() -> np.ndarray:
    """3^3 filters padded to the 7^3 of a Gaussian beside them, and a filter of zeros."""
    small = [np.full((3, 3, 3), 1 / 27), laplacian(), sobel(), tiny_taps()]
    return np.stack([*(centred(k, 7) for k in small), gaussian(7, 1.2), np.zeros((7, 7, 7))])


def volume(kind: str, shape: tuple[int, int, int] = (12, 13, 14)) -> np.ndarray:
    v = (RNG.standard_normal(shape) * 50).astype(np.float32)
    n0, n1, n2 = shape
    if kind == "single voxels":  # inside, on faces, edges and corners
        v[6, 6, 6] = v[0, 7, n2 - 1] = np.nan
        v[3, 9, 4] = v[0, 0, 0] = v[n0 - 1, 5, 0] = np.inf
        v[8, 3, 10] = v[n0 - 1, n1 - 1, n2 - 1] = v[5, 0, 7] = -np.inf
    elif kind == "clusters":  # +inf and -inf blocks close enough to meet: NaN between
        v[1:4, 2:5, 2:5] = np.inf
        v[5:8, 3:6, 3:6] = -np.inf
        v[8:11, n1 - 3 :, n2 - 4 :] = np.nan
        v[n0 - 2 :, 0:2, 6:9] = -np.inf
    elif kind == "nan background":  # a NaN-masked map: finite inside a ball
        x, y, z = np.indices(shape)
        r2 = (x - n0 / 2) ** 2 + (y - n1 / 2) ** 2 + (z - n2 / 2) ** 2
        v[r2 > (min(shape) / 2.5) ** 2] = np.nan
    else:
        raise ValueError(kind)
    return v


def assert_nonfinite_as_scipy(out, vol, kernels, mode, cval=0.0):
    """NaN, +inf and -inf exactly where scipy has them; finite values at the contract's tolerance
    with m = max |v| over the finite voxels (and |cval| in constant mode)."""
    ref = reference(vol, kernels, mode, cval)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    m = float(np.max(np.abs(vol[np.isfinite(vol)]), initial=0.0))
    if mode == "constant":
        m = max(m, abs(cval))
    for f, k in enumerate(np.asarray(kernels)):
        o, r = out[f].astype(np.float64), ref[f]
        for name, where in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            wrong = np.argwhere(where(o) != where(r))
            assert not len(wrong), (
                f"filter {f}: {name} differs from scipy at {len(wrong)} voxels, first "
                f"{tuple(wrong[0])}: {o[tuple(wrong[0])]} vs {r[tuple(wrong[0])]}"
            )
        finite = np.isfinite(r)
        tol = spec_tolerance(k, m)
        err = float(np.max(np.abs(o[finite] - r[finite]), initial=0.0))
        assert err <= tol, f"filter {f}: max error {err:.3g} > tolerance {tol:.3g}"


def test_scipy_leaves_out_taps_up_to_dbl_epsilon():
    """The threshold kept_taps uses is scipy's: |w| > DBL_EPSILON, by experiment."""
    v = np.zeros((3, 1, 1))
    v[1] = np.inf
    above = np.nextafter(TAP_EPS, 1)
    for w, kept in ((0.0, False), (1e-17, False), (TAP_EPS, False), (above, True), (-above, True)):
        k = np.array([1.0, w, 1.0]).reshape(3, 1, 1)
        assert bool(np.isinf(reference(v, k[None], "constant")[0, 1, 0, 0])) == kept, w
        assert bool(np.any([t[1, 0, 0] for t in kept_taps(k)])) == kept, w


@pytest.mark.parametrize(("mode", "cval"), MODES_CVAL)
@pytest.mark.parametrize("kind", ["single voxels", "clusters", "nan background"])
def test_mixed_bank_in_every_mode(device, kind, mode, cval):
    vol, kernels = volume(kind), mixed_bank()
    out = convolve_bank(vol, kernels, mode, cval, device=device)
    assert_nonfinite_as_scipy(out, vol, kernels, mode, cval)


@pytest.mark.parametrize(("mode", "cval"), MODES_CVAL)
def test_a_filter_does_not_depend_on_its_bank(device, mode, cval):
    """A 3^3 box alone, and padded to 7^3 in a bank with a 7^3 Gaussian: the same response,
    the one scipy gives for the 3^3 box (one +inf voxel used to make 98 voxels NaN)."""
    vol = volume("single voxels")
    box = np.full((1, 3, 3, 3), 1 / 27)
    alone = convolve_bank(vol, box, mode, cval, device=device)[0]
    in_bank = convolve_bank(
        vol, np.stack([gaussian(7, 1.2), centred(box[0], 7)]), mode, cval, device=device
    )[1]
    assert_nonfinite_as_scipy(alone[None], vol, box, mode, cval)
    assert_nonfinite_as_scipy(in_bank[None], vol, box, mode, cval)
    np.testing.assert_array_equal(np.isnan(alone), np.isnan(in_bank))
    np.testing.assert_array_equal(np.isinf(alone), np.isinf(in_bank))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extents", [(2, 2, 2), (4, 3, 2), (1, 4, 5)])
def test_even_extents_with_zero_taps(device, mode, extents):
    kernels = RNG.standard_normal((3, *extents))
    kernels[RNG.random(kernels.shape) < 0.3] = 0.0
    vol = volume("clusters", (9, 10, 11))
    out = convolve_bank(vol, kernels, mode, -2.0, device=device)
    assert_nonfinite_as_scipy(out, vol, kernels, mode, -2.0)


@pytest.mark.parametrize("mode", ["reflect", "constant", "wrap"])
@pytest.mark.parametrize("slab_depth", [1, 2, 3])
def test_slab_seams_inside_the_kernel(device, mode, slab_depth):
    vol, kernels = volume("clusters"), mixed_bank()
    out = convolve_bank(vol, kernels, mode, 1.0, device=device, slab_depth=slab_depth)
    assert_nonfinite_as_scipy(out, vol, kernels, mode, 1.0)


@pytest.mark.parametrize("mode", ["mirror", "nearest"])
def test_4d_frames_with_and_without_non_finite_voxels(device, mode):
    frames = [volume("single voxels", (9, 10, 11)) for _ in range(3)]
    frames[0][~np.isfinite(frames[0])] = 7.0  # frame 0 finite: the kernel alone
    frames[2] = volume("nan background", (9, 10, 11))
    vol = np.stack(frames, axis=-1)
    kernels = mixed_bank()[:, 2:5, 1:6, 2:5]  # 3x5x3: the 3^3 filters padded, a cut Gaussian
    out = convolve_bank(vol, kernels, mode, device=device, slab_depth=4)
    assert out.shape == (len(kernels), *vol.shape)
    for t, frame in enumerate(frames):
        assert_nonfinite_as_scipy(out[..., t], frame, kernels, mode)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_other_float_types(device, dtype):
    vol, kernels = volume("clusters").astype(dtype), mixed_bank()
    out = convolve_bank(vol, kernels, "reflect", device=device)
    assert_nonfinite_as_scipy(out, vol, kernels, "reflect")


def test_finite_volumes_never_build_the_override(device):
    """Finite float volumes take the kernel alone: no indicator convolvers compiled or held."""
    vol, kernels = volume("single voxels"), mixed_bank()
    conv = BankConvolver(kernels, vol.shape, vol.dtype, device=device, slab_depth=5)
    finite = np.nan_to_num(vol, nan=1.0, posinf=2.0, neginf=-2.0)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, finite[conv.source_rows(a, b)])
    assert conv._override is None
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, vol[conv.source_rows(a, b)])
    assert conv._override is not None


def test_slabs_into_pinned_views_as_the_pipeline_does(device):
    """``out=pinned[:, : b - a]`` (a view, as `volconv run` passes) takes the override too."""
    vol, kernels = volume("clusters"), mixed_bank()
    conv = BankConvolver(kernels, vol.shape, vol.dtype, "wrap", device=device, slab_depth=5)
    pinned = conv.pinned_slab()
    out = np.empty((len(kernels), *vol.shape), np.float32)
    for a, b in conv.slabs():
        out[:, a:b] = conv.convolve_slab(a, b, vol[conv.source_rows(a, b)], pinned[:, : b - a])
    assert_nonfinite_as_scipy(out, vol, kernels, "wrap")
    assert all(conv.timings[s] > 0 for s in ("upload", "pad", "kernel", "download"))


# -- what the override holds (docs/contract.md, "Memory") ------------------------------------------
def override_run(device, vol, kernels, mode, slab_depth, budget):
    """Every slab of ``vol``: the finite part filtered, then `NonFiniteOverride.apply` with
    ``budget``, as `BankConvolver` does. Returns the responses, the override and the most
    memory numpy allocated in one apply (tracemalloc)."""
    conv = BankConvolver(kernels, vol.shape, vol.dtype, mode, device=device, slab_depth=slab_depth)

    def counting(supports):
        return BankConvolver(supports, vol.shape, np.uint8, mode, 0.0, device=device,
                             slab_depth=slab_depth)  # fmt: skip

    override = NonFiniteOverride(conv.kernels, counting, budget=budget)
    out = np.empty((len(kernels), *vol.shape), np.float32)
    peak = 0
    for a, b in conv.slabs():
        rows = vol[conv.source_rows(a, b)]
        out[:, a:b] = conv.convolve_slab(a, b, finite_part(rows))
        tracemalloc.start()
        override.apply(a, b, rows, out[:, a:b])
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return out, override, peak


@pytest.mark.parametrize("mode", ["reflect", "wrap"])
def test_the_override_counts_in_sub_slabs_within_its_budget(device, mode):
    """A budget of two rows of counts: each slab is counted two rows at a time, exactly as
    scipy; apply's numpy allocations stay within what `OverridePlan.host_bytes` counts, and a
    slab six times as deep holds no more."""
    vol, kernels = volume("nan background", (24, 40, 48)), mixed_bank()
    vol[5:7, 10:12, 20:30] = np.inf
    vol[15, 30:33, 5:9] = -np.inf
    plan = OverridePlan.of(kernels)
    budget = plan.host_bytes(vol.shape, 2, vol.itemsize)
    assert plan.depth(vol.shape, 12, vol.itemsize, budget) == 2
    peaks = []
    for slab_depth in (4, 24):
        out, override, peak = override_run(device, vol, kernels, mode, slab_depth, budget)
        assert_nonfinite_as_scipy(out, vol, kernels, mode)
        assert override.plan.banks and peak <= budget, (peak, budget)
        peaks.append(peak)
    assert peaks[1] <= 1.1 * peaks[0], peaks  # whatever the slab's depth


def test_the_override_plan_is_the_overrides():
    """Distinct supports only (a bank of Gaussians shares one), banks at most N wide: the
    counting convolvers `volconv.run.memory` counts are those the override builds."""
    gaussians = np.stack([gaussian(5, s) for s in (0.8, 1.0, 1.5, 2.0)])
    plan = OverridePlan.of(gaussians)
    assert len(plan.signed) == 1 and plan.union is None and [len(b) for b in plan.banks] == [1]
    plan = OverridePlan.of(mixed_bank())  # signed supports and their unions differ
    built = []
    NonFiniteOverride(mixed_bank(), lambda k: built.append(len(k)) or object())
    assert [len(b) for b in plan.banks] == built and max(built) <= len(mixed_bank())
    assert plan.union is not None and len(plan.signed) > len(plan.union)
