"""The presets against what they stand for: ``skimage.feature.multiscale_basic_features`` itself
(float32, channel for channel, borders included) and its float64 two-stage definition; ilastik's
features as ilastik chains them (presmoothing, then the features at the inner scale, each stage
with the bank's mode), stage by stage in scipy in float64; names and parameters as ilastik's
source gives them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.ndimage as ndi
from test_features import AXES, MODES, eig_ref, gauss, kernel_l1, run, scene, tol, weyl

from volconv.bank.features import PAIRS, build_features, expand
from volconv.bank.spec import BankError
from volconv.checks import SPEC_RTOL

ORDERS = [tuple(x + y for x, y in zip(AXES[a], AXES[b], strict=True)) for a, b in PAIRS]
EPS32 = float(np.finfo(np.float32).eps)


# -- scikit-image ---------------------------------------------------------------------------
@pytest.fixture(params=["rings", "rows"])
def skimage_stage1(request, monkeypatch):
    """skimage's stage 1 either way on every device: `NearestGaussians` (what GPUs run) and
    `RowGaussians` (CPUs)."""
    import volconv.engines.preset_memory as memory
    import volconv.engines.scales as scales

    smoother = scales.NearestGaussians if request.param == "rings" else scales.RowGaussians
    for module in (scales, memory):  # the stage's and its memory model's
        monkeypatch.setattr(module, "skimage_smoother", lambda device: smoother)
    return request.param


def as_float(volume: np.ndarray) -> np.ndarray:
    """img_as_float32's values in float64: integers scaled by their maximum, signed ones
    clipped at -1."""
    v = np.asarray(volume)
    if v.dtype.kind in "ui":
        return np.maximum(v / float(np.iinfo(v.dtype).max), -1.0)
    return v.astype(np.float64)


def skimage_definition(img: np.ndarray) -> list[np.ndarray]:
    """multiscale_basic_features' channels in float64, stage by stage: the Gaussian ('nearest',
    truncate 4), its Sobel magnitude ('reflect'), the Hessian's eigenvalues by np.gradient."""
    out = []
    for s in (0.5, 1, 2, 4, 8, 16):
        g = ndi.gaussian_filter(img, s, mode="nearest", truncate=4.0)
        sob = []
        for a in range(3):
            k = np.ones((1, 1, 1))
            for d in range(3):
                w = np.array([1.0, 0, -1]) if d == a else np.array([1.0, 2, 1]) / 4
                k = k * w.reshape([3 if i == d else 1 for i in range(3)])
            sob.append(ndi.convolve(g, k, mode="reflect"))
        out += [g, np.sqrt(sum(x * x for x in sob) / 3)]
        grads = np.gradient(g)
        out += list(eig_ref([np.gradient(grads[a], axis=b) for a, b in PAIRS]))
    return out


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int16"])
def test_the_skimage_preset_is_multiscale_basic_features(device, dtype, skimage_stage1):
    """Channel for channel, borders included, at float32's precision of each channel (skimage
    computes in float32): integers scaled as img_as_float32 scales them (int16's -32768 to
    -1); sigma to 16 (129 taps, overhangs past every axis); the bank's mode does not apply."""
    skimage_feature = pytest.importorskip("skimage.feature")
    v = scene((24, 27, 25), seed=6)
    if dtype == "float32":
        volume = v / 100
    elif dtype == "uint8":
        volume = np.clip(v * 2, 0, 255).astype(np.uint8)
    else:
        volume = (v * 300 - 9000).astype(np.int16)
        volume[0, :3, :] = np.iinfo(np.int16).min
    out = run(volume, [], build_features(None, preset="skimage"), "wrap", 0.0, device,
              slab_depth=5)  # fmt: skip
    theirs = np.moveaxis(skimage_feature.multiscale_basic_features(volume), -1, 0)
    assert out.shape == theirs.shape == (30, *volume.shape)
    m = float(np.abs(as_float(volume)).max())
    for c in range(30):
        bound = 8 * EPS32 * (float(np.abs(theirs[c]).max()) + m)
        assert np.abs(out[c] - theirs[c]).max() <= bound, (c, np.abs(out[c] - theirs[c]).max())


@pytest.mark.parametrize("depth", [4, 20])
def test_the_skimage_preset_against_its_float64_definition(
    device, depth, skimage_stage1, monkeypatch
):
    """Within SPEC's tolerance of the float64 definition, on a 4D volume with slab seams every 4
    rows, or one slab of 20 (the stencils write 16 rows at a time here). NaN and Inf are
    refused."""
    import volconv.engines.scales as scales

    monkeypatch.setattr(scales, "SUB_ROWS", 16)
    volume = scene((20, 17, 16, 2), seed=3)
    volume[..., 1] *= 37
    feats = build_features(None, preset="skimage")
    out = run(volume, [], feats, "reflect", 0.0, device, slab_depth=depth)
    names = expand([], feats).names
    for t in range(2):
        v = volume[..., t].astype(np.float64)
        ref = skimage_definition(v)
        m = float(np.abs(v).max())
        bounds = [tol(1, m), tol(2, m)] + [weyl([tol(4, m)] * 6)] * 3
        for c, r in enumerate(ref):
            err = np.abs(out[c, ..., t] - r).max()
            assert err <= bounds[c % 5], (names[c], t, err, bounds[c % 5])
    volume[9, 3, 4, 1] = np.nan
    with pytest.raises(ValueError, match=r"non-finite voxels \(NaN, Inf\) in rows"):
        run(volume[..., 1], [], feats, "reflect", 0.0, device, slab_depth=4)


@pytest.mark.parametrize(
    ("tile", "rows"), [(None, 4), ((32, 8), 8), ((32, 4), 3)], ids=["scale", "tile", "tile-32x4"]
)
def test_the_skimage_stage2_kernels_on_gpus(device, monkeypatch, tile, rows):
    """What GPUs run for skimage's channels (skimage_scale, or skimage_tile: a tile of the
    field in local memory), the eigenvalues in the kernel, at several rows a work-item, with
    tiles and row blocks crossing every face and slab seams: within SPEC's tolerance of the
    float64 definition."""
    import volconv.engines.scales as scales

    monkeypatch.setattr(scales, "lanes_for", lambda device: 1)
    monkeypatch.setattr(scales, "SKIMAGE_TILE", tile)
    monkeypatch.setattr(scales, "SKIMAGE_ROWS", rows)
    monkeypatch.setattr(scales, "SUB_ROWS", 6)
    volume = scene((19, 13, 37), seed=5)
    feats = build_features(None, preset="skimage")
    out = run(volume, [], feats, "reflect", 0.0, device, slab_depth=7)
    ref = skimage_definition(volume.astype(np.float64))
    m = float(np.abs(volume).max())
    bounds = [tol(1, m), tol(2, m)] + [weyl([tol(4, m)] * 6)] * 3
    for c, r in enumerate(ref):
        err = np.abs(out[c] - r).max()
        assert err <= bounds[c % 5], (c, err, bounds[c % 5])


def test_skimage_names():
    feats = build_features(None, preset="skimage")
    names = expand([], feats).names
    assert names[:5] == ["intensity_s0.5", "edges_s0.5", "texture_s0.5_0", "texture_s0.5_1",
                         "texture_s0.5_2"]  # fmt: skip
    assert names[-3:] == ["texture_s16_0", "texture_s16_1", "texture_s16_2"]
    with pytest.raises(BankError, match=r'bank\.scales: the "skimage" preset takes its own'):
        build_features(None, preset="skimage", scales=[1.0])


# -- ilastik --------------------------------------------------------------------------------
TITLES = ["Gaussian Smoothing", "Laplacian of Gaussian", "Gaussian Gradient Magnitude",
          "Difference of Gaussians", "Structure Tensor Eigenvalues",
          "Hessian of Gaussian Eigenvalues"]  # fmt: skip


def ilastik_definition(v: np.ndarray, scales, mode: str, cval: float) -> list:
    """ilastik's channels (feature-major) in float64, stage by stage, each with ``mode``:
    P = the presmoothing by sqrt(s^2 - 1) (s <= 1: s) with window 3.5, then at min(s, 1) with
    window 2 the features of P; with each channel's tolerance: the entries' (kernel l1 at the
    inner scale), through the triangle inequality, the product rule and Weyl's inequality."""
    m = max(float(np.abs(v[np.isfinite(v)]).max()), abs(cval))
    per = {}
    for s in scales:
        inner = min(s, 1.0)
        pre = gauss(v, math.sqrt(s * s - 1) if s > 1 else s, (0, 0, 0), mode, cval, 3.5)

        def g(order=(0, 0, 0), sigma=inner, pre=pre):
            return gauss(pre, sigma, order, mode, cval, truncate=2.0)

        def t(order, sigma=inner):
            return tol(kernel_l1(sigma, order, 2.0), m)

        with np.errstate(invalid="ignore", over="ignore"):
            grads = [g(o) for o in AXES]
            hess = [g(o) for o in ORDERS]
            prods = [grads[a] * grads[b] for a, b in PAIRS]
            st = [gauss(p, 0.5 * inner, (0, 0, 0), mode, cval, truncate=2.0) for p in prods]
            gmax = max(float(np.abs(x[np.isfinite(x)]).max(initial=0.0)) for x in grads)
            tg = max(t(o) for o in AXES)
            t_st = 2 * gmax * tg + tg * tg + 4 * SPEC_RTOL * gmax * gmax
            lap = [(2, 0, 0), (0, 2, 0), (0, 0, 2)]
            per[s] = [
                ([g()], t((0, 0, 0))),
                ([hess[0] + hess[1] + hess[2]], sum(t(o) for o in lap)),
                ([np.sqrt(sum(x * x for x in grads))], math.sqrt(sum(t(o) ** 2 for o in AXES))),
                ([g() - g(sigma=0.66 * inner)], t((0, 0, 0)) + t((0, 0, 0), 0.66 * inner)),
                (eigen(st), weyl([t_st] * 6)),
                (eigen(hess), weyl([t(o) for o in ORDERS])),
            ]
    return [per[s][k] for k in range(6) for s in scales]


def eigen(entries: list[np.ndarray]) -> list[np.ndarray]:
    bad = ~np.isfinite(np.stack(entries)).all(0)
    out = eig_ref([np.where(bad, 0, e) for e in entries])
    out[:, bad] = np.nan
    return list(out)


def check_ilastik(out: np.ndarray, v: np.ndarray, scales, mode: str, cval: float) -> None:
    i = 0
    for channels, bound in ilastik_definition(v.astype(np.float64), scales, mode, cval):
        for r in channels:
            got = out[i]
            np.testing.assert_array_equal(np.isnan(got), np.isnan(r), err_msg=str(i))
            ok = np.isfinite(r)
            err = float(np.abs(got[ok] - r[ok]).max(initial=0.0))
            assert err <= bound, (i, err, bound)
            i += 1
    assert i == len(out)


@pytest.mark.parametrize("mode", MODES)
def test_the_ilastik_preset_stage_by_stage(device, mode, monkeypatch):
    """Every mode (constant with cval != 0), odd and even extents, slab seams every 4 rows (one
    slab of 17 in constant and wrap mode: the stencils write 16 rows at a time here), the inner
    radii 1 and 2 and an outer radius 0 (scale 0.3)."""
    import volconv.engines.scales as stage

    monkeypatch.setattr(stage, "SUB_ROWS", 16)
    scales = [0.3, 1.0, 1.6]
    cval = 7.5 if mode == "constant" else 0.0
    volume = scene((17, 16, 13), seed=5)
    depth = 17 if mode in ("constant", "wrap") else 4
    out = run(volume, [], build_features(None, preset="ilastik", scales=scales), mode, cval,
              device, slab_depth=depth)  # fmt: skip
    check_ilastik(out, volume, scales, mode, cval)


def test_the_ilastik_preset_4d_nonfinite_and_a_bank(device):
    """4D frames, NaN and Inf (the host's stage 1, the device's stage 2 as scipy spreads them),
    and a bank's own filter stored before the preset's outputs."""
    from volconv.bank.filters import build_bank

    scales = [0.7, 3.5]
    volume = scene((15, 12, 14, 2), seed=8)
    volume[7, 5, 6, 1] = np.nan
    volume[3, 10, 2, 1] = -np.inf
    bank = build_bank([{"type": "gaussian", "sigma": 1.0, "name": "g"}], 7)
    feats = build_features(None, preset="ilastik", scales=scales)
    out = run(volume, bank, feats, "mirror", 0.0, device, slab_depth=3)
    assert out.shape[0] == 1 + 20
    for t in range(2):
        check_ilastik(out[1:, ..., t], volume[..., t], scales, "mirror", 0.0)
    assert np.isnan(out[1:, ..., 1]).any()


def test_the_ilastik_preset_names_and_parameters():
    """ilastik's channels, names and conventions (lazyflow's OpPixelFeaturesPresmoothed and
    filterOperators): presmoothing by sqrt(s^2 - 1) (s <= 1: by s) with window 3.5, features
    at min(s, 1) with window 2, DoG's second sigma 0.66 of the first, the structure tensor's
    outer scale 0.5 of its inner one."""
    scales = [0.7, 1.6]
    feats = build_features(None, preset="ilastik", scales=scales)
    names = []
    for t in TITLES:
        for s in scales:
            base = f"{t} (\N{GREEK SMALL LETTER SIGMA}={s})"
            names += [f"{base} [{i}]" for i in range(3)] if "Eigenvalues" in t else [base]
    ex = expand([], feats)
    assert ex.names == names
    st = feats[9]  # scale 1.6
    assert st.params["rho"] == 0.5 and st.params["presmooth"] == pytest.approx(math.sqrt(1.56))
    assert feats[7].params["sigma2"] == pytest.approx(0.66)  # DoG at 1.6
    assert feats[0].params == {"preset": "ilastik", "feature": "GaussianSmoothing",
                               "scale": 0.7, "presmooth": 0.7, "sigma": 0.7}  # fmt: skip
    (plan, planes), = ex.presets  # fmt: skip
    assert planes == tuple(range(20)) and plan.n_outputs == 20
    assert [s.smooth for s in plan.scales] == pytest.approx([0.7, math.sqrt(1.56)])
    assert plan.scales[1].at == (1, 3, 5, 7, 11, 17)


def test_presets_are_validated():
    with pytest.raises(BankError, match=r"bank\.scales: must be a list of numbers > 0"):
        build_features(None, preset="ilastik", scales=[0.7, -1])
    with pytest.raises(BankError, match=r"bank\.scales: must be distinct numbers"):
        build_features(None, preset="ilastik", scales=[0.7, 0.7])
    with pytest.raises(BankError, match=r"bank\.preset: must be one of ilastik, skimage"):
        build_features(None, preset="ilastk")
    with pytest.raises(BankError, match=r"bank\.scales: applies to a preset only"):
        build_features([], scales=[1.0])
    with pytest.raises(BankError, match=r"bank\.scales: sigma .* needs an extent of"):
        build_features(None, preset="ilastik", scales=[100.0])
    assert len(build_features(None, preset="ilastik")) == 6 * 7  # the dialog's seven scales


def test_each_scale_as_if_alone(device):
    """ilastik's seven default scales: each scale's channels equal a run of that scale alone."""
    feats = build_features(None, preset="ilastik")
    ex = expand([], feats)
    assert len(ex.outputs) == 70
    volume = scene((9, 7, 6), seed=9)
    out = run(volume, [], feats, "wrap", 0.0, device)
    alone = run(volume, [], build_features(None, preset="ilastik", scales=[0.7]), "wrap", 0.0,
                device)  # fmt: skip
    at = [i for i, n in enumerate(ex.names) if "=0.7)" in n]
    np.testing.assert_array_equal(out[at], alone)


@pytest.mark.parametrize("preset", ["skimage", "ilastik"])
def test_the_memory_a_preset_takes(device, preset, skimage_stage1):
    """`preset_bytes` (what a pipeline's memory model counts) is what the stage allocates."""
    from volconv.engines.preset_memory import preset_bytes
    from volconv.engines.separable import SeparableConvolver

    ex = expand([], build_features(None, preset=preset))
    shape = (40, 12, 10)
    conv = SeparableConvolver(ex.filters, shape, np.uint8, "mirror", 0.0, device=device,
                              slab_depth=20, expanded=ex)  # fmt: skip
    (stage, _), = conv._tensors  # fmt: skip
    host, dev = preset_bytes(ex.presets[0][0], shape, np.uint8, "mirror", 0.0, device, 20)
    assert dev == stage.device_bytes and host >= ex.presets[0][0].n_outputs * 20 * 12 * 10 * 4


def test_the_eigenvalues_in_the_stencils_as_on_gpus(device, monkeypatch):
    """GPUs compute stage 2 by kernels/stencils.cl (one voxel per work-item), CPUs by
    kernels/skimage_rows.cl and ilastik_rows.cl (vectors along axis 2), the eigenvalues in the
    kernels either way: both paths give the same channels."""
    import volconv.engines.scales as scales

    volume = scene((12, 11, 10), seed=2)
    runs = []
    for lanes in (None, 1):
        if lanes is not None:
            monkeypatch.setattr(scales, "lanes_for", lambda device: 1)
        runs.append([run(volume, [], build_features(None, preset=p, scales=s), "mirror", 0.0,
                         device, slab_depth=5)
                     for p, s in (("skimage", None), ("ilastik", [0.7, 1.6]))])  # fmt: skip
    for a, b in zip(*runs, strict=True):
        m = float(np.abs(a).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * m)


@pytest.mark.parametrize("per_item", [1, 3, 8, "rows"])
def test_the_skimage_gaussians_over_slabs(device, per_item):
    """The skimage preset's stage 1 (`NearestGaussians`) at 1, 3 or 8 outputs per work-item
    (GPUs take 8), or `RowGaussians` (CPUs; rows of 11 along axis 2: a partial block): each
    scale's Gaussian ('nearest') over consecutive slabs, rows reused from its ring (sigma 16
    overhangs the volume), then a changed input and a slab out of order, smoothed afresh, each
    within SPEC's tolerance of scipy in float64."""
    import pyopencl as cl

    from volconv.device.programs import context_for
    from volconv.engines.clock import KernelClock
    from volconv.engines.gaussians import RowGaussians
    from volconv.engines.smoothing import NearestGaussians

    ctx, queue = context_for(device)
    v = np.clip(scene((30, 13, 11), seed=4) * 2, 0, 255).astype(np.uint8)
    sigmas = (0.5, 2.0, 16.0)
    if per_item == "rows":
        stage = RowGaussians(ctx, queue, sigmas, 4.0, v.shape, 9, KernelClock())
    else:
        stage = NearestGaussians(ctx, queue, sigmas, 4.0, v.shape, v.dtype, 9, KernelClock(),
                                 per_item=per_item)  # fmt: skip
    spans = [(0, 9), (7, 16), (16, 25), (25, 30)]
    for vol, at in ((v, spans), (v[::-1].copy(), spans[:2]), (v, [(20, 29), (2, 11)])):
        refs = [ndi.gaussian_filter(vol.astype(np.float64), s, mode="nearest") for s in sigmas]
        for g0, g1 in at:
            events, work = stage.smooth(g0, g1, lambda lo, hi, vol=vol: vol[lo:hi])
            for s, ref in enumerate(refs):
                got = np.empty((g1 - g0, *v.shape[1:]), np.float32)
                cl.enqueue_copy(queue, got, stage.field, src_offset=s * stage.rows * got[0].nbytes,
                                wait_for=events + work)  # fmt: skip
                err = np.abs(got - ref[g0:g1]).max()
                assert err <= tol(1, 255.0), (vol is v, g0, g1, sigmas[s], err)
