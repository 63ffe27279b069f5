"""Derived features against their float64 definitions: scipy.ndimage's Gaussian filters and
numpy.linalg.eigvalsh, within the bound the entries' tolerances imply (Weyl's inequality for
eigenvalues, the triangle inequality for magnitudes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.ndimage as ndi
from conftest import reference

from volconv.bank.features import PAIRS, build_features, expand
from volconv.bank.filters import build_bank
from volconv.bank.spec import BankError
from volconv.checks import SPEC_ATOL, SPEC_RTOL
from volconv.device.programs import context_for
from volconv.engines.features import FeatureKernels, StructureTensorStage
from volconv.engines.separable import SeparableConvolver, convolve_separable

MODES = ["reflect", "mirror", "nearest", "constant", "wrap"]
AXES = ((1, 0, 0), (0, 1, 0), (0, 0, 1))


def scene(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Flat regions, a ball, a tube along axis 2 and a noisy corner: where eigenvalues
    coincide (flat: all three; ball centre: all three; tube: two) and where they do not."""
    rng = np.random.default_rng(seed)
    x = np.indices(shape[:3]).astype(np.float64)
    c = [s / 2 for s in shape[:3]]
    v = np.zeros(shape[:3])
    r2 = sum((x[i] - c[i]) ** 2 for i in range(3))
    v[r2 <= (min(shape[:3]) / 4) ** 2] = 100.0
    v[((x[0] - 3) ** 2 + (x[1] - 3) ** 2) <= 2.5] = 60.0
    v[-4:, -4:, :] += rng.standard_normal((4, 4, shape[2])) * 10
    if len(shape) == 4:
        v = np.stack([v * (t + 1) for t in range(shape[3])], axis=-1)
    return v.astype(np.float32)


def gauss(v: np.ndarray, sigma: float, order, mode: str, cval: float, truncate=4.0):
    """The response of a Gaussian (derivative) as a filter of the bank defines it: the volume
    convolved in constant mode with the border at cval (scipy's gaussian_filter applies cval
    at every 1D pass instead; the two agree for cval = 0)."""
    v = np.asarray(v, np.float64)
    if mode != "constant":
        return ndi.gaussian_filter(v, sigma, order, mode=mode, truncate=truncate)
    inner = ndi.gaussian_filter(v - cval, sigma, order, mode="constant", truncate=truncate)
    flat = ndi.gaussian_filter(np.full(v.shape, cval), sigma, order, mode="nearest",
                               truncate=truncate)  # fmt: skip
    return inner + flat


def kernel_l1(sigma: float, order, truncate=4.0) -> float:
    """sum |k| of a 3D Gaussian (derivative) kernel: the product of its 1D factors' sums."""
    r = int(truncate * sigma + 0.5)
    total = 1.0
    for o in order:
        e = np.zeros(2 * r + 1)
        e[r] = 1
        total *= np.abs(ndi.gaussian_filter1d(e, sigma, order=o, truncate=truncate)).sum()
    return total


def tol(l1: float, m: float) -> float:
    return SPEC_RTOL * l1 * m + SPEC_ATOL


def eig_ref(entries) -> np.ndarray:
    m = np.empty((*entries[0].shape, 3, 3))
    for v, (a, b) in zip(entries, PAIRS, strict=True):
        m[..., a, b] = m[..., b, a] = v
    return np.moveaxis(np.linalg.eigvalsh(m)[..., ::-1], -1, 0)


def weyl(tols: list[float]) -> float:
    """||E||_F of a symmetric error matrix with tolerances (00, 11, 22, 01, 02, 12)."""
    return math.sqrt(sum(t * t for t in tols[:3]) + 2 * sum(t * t for t in tols[3:]))


def run(volume, filters, features, mode, cval, device, **options):
    return convolve_separable(volume, filters, mode, cval, device=device, features=features,
                              **options)  # fmt: skip


# the pass tree one launch per node, as one kernel for CPUs (kernels/columns.cl), as three
# multi-output launches (kernels/tree.cl), as two with axis 0 first (kernels/tree_yz.cl)
TREES = {"passes": {"multi": False, "columns": False},
         "columns": {"multi": False, "columns": True},
         "multi": {"multi": True, "xfirst": False}, "xfirst": {"xfirst": True}}  # fmt: skip


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("mode", MODES)
def test_hessian_eigenvalues_and_gradient_magnitude(device, mode, tree):
    """Every mode (constant with cval != 0), an even extent, slab seams every 3 rows; each
    form of the pass tree."""
    volume = scene((17, 16, 14))
    cval = 7.5 if mode == "constant" else 0.0
    sigma = 1.5
    feats = build_features([
        {"type": "hessian_eigenvalues", "sigma": sigma, "name": "hess"},
        {"type": "gradient_magnitude", "sigma": 1.0, "name": "gm", "truncate": 3.0},
    ])  # fmt: skip
    out = run(volume, [], feats, mode, cval, device, slab_depth=3, fused=False, **TREES[tree])
    assert out.shape == (4, *volume.shape)
    m = max(float(np.abs(volume).max()), abs(cval))
    orders = [tuple(x + y for x, y in zip(AXES[a], AXES[b], strict=True)) for a, b in PAIRS]
    entries = [gauss(volume, sigma, o, mode, cval) for o in orders]
    ref = eig_ref(entries)
    bound = weyl([tol(kernel_l1(sigma, o), m) for o in orders])
    err = np.abs(out[:3] - ref).max()
    assert err <= bound, (err, bound)
    assert np.all(out[0] >= out[1]) and np.all(out[1] >= out[2])
    grads = [gauss(volume, 1.0, o, mode, cval, truncate=3.0) for o in AXES]
    gm = np.sqrt(sum(g * g for g in grads))
    bound = math.sqrt(sum(tol(kernel_l1(1.0, o, 3.0), m) ** 2 for o in AXES))
    assert np.abs(out[3] - gm).max() <= bound
    if mode != "constant":
        np.testing.assert_allclose(  # scipy's own function, for the definition
            gm, ndi.gaussian_gradient_magnitude(volume.astype(np.float64), 1.0, mode=mode,
                                                truncate=3.0), atol=1e-9)  # fmt: skip


@pytest.mark.parametrize("lanes", [1, 8])
def test_eigenvalues_where_they_coincide(device, lanes):
    """Matrices with repeated and nearly repeated eigenvalues, of every scale: within a few
    float32 roundings of ||A||_F, where a float32 closed form loses sqrt(eps)."""
    rng = np.random.default_rng(3)
    n = 4000
    q, _ = np.linalg.qr(rng.standard_normal((n, 3, 3)))
    base = rng.standard_normal(n)[:, None] * np.ones(3)
    gaps = rng.standard_normal((n, 3)) * 10.0 ** rng.integers(-9, 0, (n, 1))
    gaps[: n // 4] = 0  # exactly repeated: flat regions, ball centres
    gaps[n // 4 : n // 2, 1:] = 0  # a tube: two equal
    lam = (base + gaps) * 10.0 ** rng.integers(-20, 20, (n, 1))
    a = np.einsum("nij,nj,nkj->nik", q, lam, q)
    entries = np.stack([a[:, i, j] for i, j in PAIRS]).astype(np.float32)
    ctx, queue = context_for(device)
    values, _ = FeatureKernels(ctx, queue, lanes).eigen(entries)
    ref = eig_ref(list(entries.astype(np.float64)))
    fro = np.sqrt((entries.astype(np.float64) ** 2).sum(0) + (entries[3:] ** 2).sum(0))
    err = np.abs(values - ref) / fro
    assert err.max() <= 1e-6, err.max()


@pytest.mark.parametrize("lanes", [1, 8])
def test_eigenvalues_of_degenerate_and_nonfinite_matrices(device, lanes):
    entries = np.zeros((6, 5), np.float32)
    entries[:3, 1] = 2.0  # 2 I
    entries[0, 2] = np.nan
    entries[4, 3] = np.inf
    entries[:, 4] = [1e-40, 0, 0, 0, 0, 0]  # subnormal
    ctx, queue = context_for(device)
    values, _ = FeatureKernels(ctx, queue, lanes).eigen(entries)
    np.testing.assert_array_equal(values[:, 0], 0)
    np.testing.assert_array_equal(values[:, 1], 2)
    assert np.isnan(values[:, 2:4]).all()
    np.testing.assert_array_equal(values[:, 4], [np.float32(1e-40), 0, 0])


@pytest.mark.parametrize("mode", ["reflect", "constant"])
@pytest.mark.parametrize("flat", [False, True])
def test_fused_kernel_with_a_zero_background(device, mode, flat, monkeypatch):
    """kernels/fused.cl's ZERO_SKIP (planes of a tile whose input is zero skip their passes,
    as GPUs run it): a zero background beside the ball, a plane of zeros inside the volume
    and a NaN, constant mode with cval != 0 (the padding not zero), against float64."""
    from volconv.engines import passes

    monkeypatch.setitem(passes.FUSED_FLAT, "cpu", flat)
    monkeypatch.setitem(passes.FUSED_FLAT, "gpu", flat)
    volume = np.zeros((20, 16, 14), np.float32)
    volume[12:18] = scene((6, 16, 14), seed=2)
    volume[14] = 0.0
    nan = volume.copy()
    nan[15, 3, 4] = np.nan
    cval = 7.5 if mode == "constant" else 0.0
    sigma = 1.0
    feats = build_features([{"type": "hessian_eigenvalues", "sigma": sigma, "name": "h"}])
    out = run(volume, [], feats, mode, cval, device, slab_depth=7, fused=True, multi=False,
              xfirst=False)  # fmt: skip
    m = max(float(np.abs(volume).max()), abs(cval))
    orders = [tuple(x + y for x, y in zip(AXES[a], AXES[b], strict=True)) for a, b in PAIRS]
    ref = eig_ref([gauss(volume, sigma, o, mode, cval) for o in orders])
    assert np.abs(out - ref).max() <= weyl([tol(kernel_l1(sigma, o), m) for o in orders])
    if mode == "reflect":  # exact zeros far from the ball; NaN where the NaN reaches
        assert np.all(out[:, :6] == 0.0)
        got = run(nan, [], feats, mode, cval, device, slab_depth=7, fused=True, multi=False,
                  xfirst=False)  # fmt: skip
        assert np.isnan(got[:, 15, 3, 4]).all() and not np.isnan(got[:, :6]).any()


@pytest.mark.parametrize(("mode", "fused", "tree"), [
    ("reflect", False, "passes"), ("constant", False, "passes"), ("wrap", False, "passes"),
    ("wrap", True, "passes"), ("reflect", False, "multi"), ("constant", False, "multi"),
    ("wrap", False, "multi"), ("mirror", True, "multi"), ("reflect", False, "xfirst"),
    ("constant", False, "xfirst"), ("wrap", False, "xfirst"), ("nearest", True, "xfirst"),
    ("constant", True, "multi"),
])  # fmt: skip
def test_structure_tensor_eigenvalues(device, mode, fused, tree):
    """The outer smoothing takes the bank's mode (and cval) on the product field; seams every
    4 rows, rho's radius past the slab and, along axis 2, past the axis; the gradients and
    the smoothing as fused kernels too, and the smoothing as one tree of the six products
    with the eigenvalues as its epilogue (multi; xfirst: axis 0 first)."""
    volume = scene((18, 13, 6), seed=1)
    cval = 3.0 if mode == "constant" else 0.0
    sigma, rho = 1.0, 1.6
    feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": sigma,
                             "rho": rho, "name": "st"}])  # fmt: skip
    multi = tree != "passes"
    options = {"multi": multi, "xfirst": tree == "xfirst"}
    out = run(volume, [], feats, mode, cval, device, slab_depth=4, fused=fused, **options)
    assert out.shape == (3, *volume.shape)
    m = max(float(np.abs(volume).max()), abs(cval))
    g = [gauss(volume, sigma, o, mode, cval) for o in AXES]
    entries = [ndi.gaussian_filter(g[a] * g[b], rho, mode=mode, cval=cval) for a, b in PAIRS]
    ref = eig_ref(entries)
    t = [tol(kernel_l1(sigma, o), m) for o in AXES]
    gmax = [float(np.abs(x).max()) for x in g]
    entry_tol = [
        gmax[a] * t[b] + gmax[b] * t[a] + t[a] * t[b]
        + SPEC_RTOL * (gmax[a] * gmax[b] + abs(cval)) + SPEC_ATOL
        for a, b in PAIRS
    ]  # fmt: skip
    bound = weyl(entry_tol)
    err = np.abs(out - ref).max()
    assert err <= bound, (err, bound)
    # the stage's memory model is what it allocates
    ex = expand([], feats)
    conv = SeparableConvolver(ex.filters, volume.shape, volume.dtype, mode, cval, device=device,
                              slab_depth=4, expanded=ex, fused=fused, **options)  # fmt: skip
    stage = conv._tensors[0][0]
    assert stage.grad.plan.fused == fused
    assert stage.outer_plan.fused == (fused and not multi) and stage.outer_plan.multi == multi
    assert stage.xfirst == (tree == "xfirst")
    model = StructureTensorStage.device_bytes(feats[0], volume.shape, volume.dtype, mode, cval,
                                              device, 4, fused, **options)  # fmt: skip
    assert stage.held_bytes == model


@pytest.mark.parametrize(("fused", "tree"), [(False, "passes"), (True, "passes"),
                                             (False, "columns"), (False, "multi"),
                                             (False, "xfirst")])  # fmt: skip
def test_gabor_energy_and_dedup_with_the_bank(device, fused, tree):
    """A bank filter equal to a feature's input is computed once and stored; the feature's
    other inputs are not stored; a Gabor pair's energy."""
    bank = build_bank(
        [{"type": "gaussian", "sigma": 1.0, "order": [1, 0, 0], "size": 9, "name": "dx"},
         {"type": "box", "size": 3, "name": "mean"}],
        7,
    )  # fmt: skip
    feats = build_features([
        {"type": "gradient_magnitude", "sigma": 1.0, "name": "gm"},
        {"type": "gabor_energy", "sigma": 2.0, "frequency": 0.2, "orientation": [30, 10],
         "name": "tex", "size": 9},
        {"type": "hessian_eigenvalues", "sigma": 1.0, "name": "h"},
    ])  # fmt: skip
    ex = expand(bank, feats)
    # dx is the gradient's first input; the Hessian's six and the other two gradients added
    assert len(ex.filters) == 2 + 2 + 2 + 6
    assert ex.names == ["dx", "mean", "gm", "tex", "h_0", "h_1", "h_2"]
    assert [o.kind for o in ex.outputs][:3] == ["response", "response", "gradient_magnitude"]
    volume = scene((15, 12, 11), seed=2)
    out = run(volume, bank, feats, "mirror", 0.0, device, slab_depth=5, fused=fused,
              **TREES[tree])  # fmt: skip
    assert out.shape == (7, *volume.shape)
    m = float(np.abs(volume).max())
    ref = reference(volume, [f.kernel for f in bank], "mirror")
    for i, f in enumerate(bank):
        assert np.abs(out[i] - ref[i]).max() <= tol(np.abs(f.kernel).sum(), m)
    real, imag = feats[1].inputs
    re, im = reference(volume, [real.kernel, imag.kernel], "mirror")
    bound = math.hypot(tol(np.abs(real.kernel).sum(), m), tol(np.abs(imag.kernel).sum(), m))
    assert np.abs(out[3] - np.hypot(re, im)).max() <= bound


@pytest.mark.parametrize(("fused", "tree"), [(False, "passes"), (True, "passes"),
                                             (False, "columns"), (False, "multi"),
                                             (False, "xfirst")])  # fmt: skip
def test_4d_and_float16_and_nonfinite(device, fused, tree):
    """4D frames; NaN and Inf as the float64 definition gives them; the stored type; the
    features as the fused kernel's epilogue too, and as each pass tree's."""
    volume = scene((12, 10, 9, 2), seed=4)
    volume[5, 4, 4, 0] = np.nan
    volume[2, 7, 1, 1] = np.inf
    feats = build_features(
        [
            {"type": "hessian_eigenvalues", "sigma": 1.0, "name": "h"},
            {"type": "gradient_magnitude", "sigma": 0.8, "name": "g"},
        ]
    )
    out = run(volume, [], feats, "reflect", 0.0, device, slab_depth=4, fused=fused,
              **TREES[tree])  # fmt: skip
    for t in range(2):
        v = volume[..., t]
        finite = np.isfinite(v)
        m = float(np.abs(v[finite]).max())
        ex = expand([], feats)
        resp = reference(v, [f.kernel for f in ex.filters], "reflect")
        with np.errstate(invalid="ignore"):
            m3 = np.stack([resp[i] for i in ex.device[0].inputs])
            bad = ~np.isfinite(m3).all(0)
            m3[:, bad] = 0
            ref = eig_ref(list(m3))
            ref[:, bad] = np.nan
            grads = np.stack([resp[i] for i in ex.device[1].inputs])
            gm = np.sqrt((grads * grads).sum(0))
        got = out[:3, ..., t]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        ok = ~np.isnan(ref)
        bound = weyl([tol(np.abs(ex.filters[i].kernel).sum(), m) for i in ex.device[0].inputs])
        assert np.abs(got[ok] - ref[ok]).max() <= bound
        np.testing.assert_array_equal(np.isnan(out[3, ..., t]), np.isnan(gm))
        np.testing.assert_array_equal(np.isposinf(out[3, ..., t]), np.isposinf(gm))
        assert bad.any()  # the test reaches them
    # float16 on the device (finite slabs) and on the host (non-finite ones): the same as
    # the float32 outputs rounded
    v = volume[..., 0]
    ex = expand([], feats)
    conv = SeparableConvolver(ex.filters, v.shape, v.dtype, "reflect", 0.0, device=device,
                              slab_depth=4, expanded=ex, fused=fused, **TREES[tree])  # fmt: skip
    assert conv.plan.fused == fused
    assert (conv.plan.multi, conv.plan.xfirst) == (tree in ("multi", "xfirst"), tree == "xfirst")
    assert conv.plan.columns == (tree == "columns")
    conv.store("float16")
    half = np.empty((4, *v.shape), np.float16)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, v[conv.source_rows(a, b)], half[:, a:b])
    np.testing.assert_array_equal(half, out[..., 0].astype(np.float16))


@pytest.mark.parametrize(("tree", "prefetch", "flat"),
                         [("multi", 0, 0), ("xfirst", 0, 0), ("xfirst", 1, 0), ("xfirst", 0, 1),
                          ("xfirst", 1, 1)])  # fmt: skip
def test_pass_tree_shapes_blocks_and_groups(device, tree, prefetch, flat, monkeypatch):
    """The multi-output trees in the shapes GPUs take (work-groups past the edges, tiles
    wider than the volume's last axis, blocks of rows not dividing the slab; tree_yz.cl's
    warps of 4 rows; a root's mids at once, or one at a time with the next root's tile
    prefetched and the responses staged in two rounds; FLAT: the tiles of a zero background
    skipped and diagonal matrices by a branch, on a volume whose first rows are zero)
    against the float64 definition."""
    from volconv.engines import tree as trees
    from volconv.engines import xfirst

    kind = "cpu" if device.type & 2 else "gpu"  # CL_DEVICE_TYPE_CPU
    monkeypatch.setitem(trees.TREE_GROUPS, kind, {"tree_z": (8, 2, 1), "tree_y": (4, 4, 2),
                                                  "tree_x": (8, 1, 4)})  # fmt: skip
    monkeypatch.setitem(xfirst.XFIRST_SHAPE, kind, {"TY": 8, "TZ": 32, "UB": 4, "VC": 4,
                                                   "UA": 8, "BLOCK": 7, "FX": (8, 2),
                                                   "PREFETCH": prefetch, "FLAT": flat,
                                                   "MG": 1 if prefetch else 0})  # fmt: skip
    volume = scene((23, 21, 20), seed=5)
    if flat:  # A's first rows zero: their tiles skipped, their matrices diagonal
        volume[:13] = 0.0
    sigma = 2.0
    feats = build_features([{"type": "hessian_eigenvalues", "sigma": sigma, "name": "h"}])
    out = run(volume, [], feats, "nearest", 0.0, device, slab_depth=10, fused=False,
              **TREES[tree])  # fmt: skip
    orders = [tuple(x + y for x, y in zip(AXES[a], AXES[b], strict=True)) for a, b in PAIRS]
    ref = eig_ref([gauss(volume, sigma, o, "nearest", 0.0) for o in orders])
    m = float(np.abs(volume).max())
    assert np.abs(out - ref).max() <= weyl([tol(kernel_l1(sigma, o), m) for o in orders])


@pytest.mark.parametrize("kind", ["hessian", "structure"])
def test_an_intermediate_reused_by_the_next_frame_holds_no_stale_values(device, monkeypatch,
                                                                          kind):  # fmt: skip
    """FLAT: the first launch of kernels/tree_yz.cl (a Hessian) and of structure.cl stores no
    column of zeros where its intermediate holds zeros already (kernels/bands.cl's MARK_COLUMN).
    A frame whose blob has moved along axis 2, after one whose columns held values there (in
    rows past the last block's end too: slabs of 8 rows over 13, 4 rows a column), gives the
    same bits as alone."""
    from volconv.engines import structure as st
    from volconv.engines import xfirst

    kind_ = "cpu" if device.type & 2 else "gpu"  # CL_DEVICE_TYPE_CPU
    monkeypatch.setitem(xfirst.XFIRST_SHAPE, kind_, {**xfirst.XFIRST_SHAPE["cpu"], "UA": 4,
                                                     "FLAT": 1})  # fmt: skip
    monkeypatch.setitem(st.ST_SHAPES, kind_, {**st.ST_SHAPES["cpu"], "UA": 4, "FLAT": 1})
    if kind == "hessian":
        feats = build_features([{"type": "hessian_eigenvalues", "sigma": 1.0, "name": "h"}])
        options, row = {"fused": False, "xfirst": True}, 3
    else:  # the gradients zero at the second slab's first row (rows past its end read it)
        feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": 0.5,
                                 "rho": 1.0, "name": "st"}])  # fmt: skip
        options, row = {"multi": True, "xfirst": False}, 0
    frames = np.zeros((2, 13, 24, 24), np.float32)
    frames[0, row, 10:14, 4:8] = 100.0
    frames[1, row, 10:14, 16:20] = 100.0
    series = run(np.moveaxis(frames, 0, -1), [], feats, "reflect", 0.0, device, slab_depth=8,
                 **options)  # fmt: skip
    alone = run(frames[1], [], feats, "reflect", 0.0, device, slab_depth=8, **options)
    assert np.abs(alone).max() > 0
    np.testing.assert_array_equal(series[..., 1], alone)


def test_feature_tables_are_validated():
    def fails(tables, match):
        with pytest.raises(BankError, match=match):
            build_features(tables)

    fails([{"type": "hessian_eigenvalue", "sigma": 1}], r"bank\.feature\[0\]\.type.*did you")
    fails([{"type": "gradient_magnitude"}], r"bank\.feature\[0\]\.sigma: missing")
    fails([{"type": "hessian_eigenvalues", "sigma": 1},
           {"type": "structure_tensor_eigenvalues", "sigma": 1}],
          r"bank\.feature\[1\]\.rho: missing")  # fmt: skip
    fails([{"type": "gradient_magnitude", "sigma": -1}], r"bank\.feature\[0\]\.sigma: must")
    fails([{"type": "gradient_magnitude", "sigma": 1, "truncate": 0}], r"\.truncate: must")
    fails([{"type": "gradient_magnitude", "sigma": 1, "rho": 2}], r"\.rho: unknown key")
    fails([{"type": "gabor_energy", "sigma": 2, "frequency": 0.9}],
          r"bank\.feature\[0\]\.frequency")  # fmt: skip
    fails(
        [
            {"type": "gradient_magnitude", "sigma": 1, "name": "a"},
            {"type": "gradient_magnitude", "sigma": 2, "name": "a"},
        ],
        "duplicate output name",
    )
    feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": 1, "rho": 2.5,
                             "name": "st"}])  # fmt: skip
    assert feats[0].output_names == ["st_0", "st_1", "st_2"]
    assert feats[0].describe() == (
        "st: structure_tensor_eigenvalues(sigma=1, rho=2.5, truncate=4) -> st_0, st_1, st_2"
    )
    assert feats[0].inputs[0].kernel.shape == (9, 9, 9)  # radius int(4 * 1 + 0.5)


@pytest.mark.parametrize("mode", MODES)
def test_long_passes_with_overhangs_longer_than_an_axis(device, mode):
    """A 41-tap Gaussian derivative and an 81-tap Gaussian (past the direct kernel's 31) on
    axes of 6 and 9 voxels, through the separable passes, equal scipy's gaussian_filter."""
    from volconv.bank.features import gaussian_filter_of

    cval = -2.0 if mode == "constant" else 0.0
    filters = [gaussian_filter_of("wide", (10.0, 10.0, 10.0), (0, 0, 0), 4.0),
               gaussian_filter_of("d1", (5.0, 2.0, 5.0), (0, 1, 0), 4.0)]  # fmt: skip
    assert filters[0].kernel.shape == (81, 81, 81)
    volume = scene((9, 20, 6), seed=7)
    out = run(volume, filters, [], mode, cval, device, slab_depth=4)
    m = max(float(np.abs(volume).max()), abs(cval))
    for f, (sigma, order) in zip(filters, [(10.0, (0, 0, 0)), ((5.0, 2.0, 5.0), (0, 1, 0))],
                                 strict=True):  # fmt: skip
        ref = gauss(volume, sigma, order, mode, cval)
        assert np.abs(out[filters.index(f)] - ref).max() <= tol(np.abs(f.kernel).sum(), m)


def test_nonfinite_voxels_under_wide_filters_are_refused(device):
    volume = scene((10, 9, 8))
    volume[4, 4, 4] = np.nan
    feats = build_features([{"type": "gradient_magnitude", "sigma": 8.0, "name": "g"}])
    with pytest.raises(ValueError, match="non-finite voxels"):
        run(volume, [], feats, "reflect", 0.0, device)


def test_structure_tensor_with_nonfinite_voxels(device):
    """A slab holding NaN goes through the host: NaN where the float64 definition has it
    (the gradients by scipy's rules, the products smoothed by scipy), the rest as before."""
    volume = scene((16, 14, 13), seed=8)
    volume[3, 3, 3] = np.nan
    feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": 0.5,
                             "rho": 0.5, "name": "st"}])  # fmt: skip
    out = run(volume, [], feats, "reflect", 0.0, device, slab_depth=4)
    grads = reference(volume, [f.kernel for f in feats[0].inputs], "reflect")
    with np.errstate(invalid="ignore"):
        entries = [ndi.convolve(grads[a] * grads[b], feats[0].rho_filter.kernel, mode="reflect")
                   for a, b in PAIRS]  # fmt: skip
        bad = ~np.isfinite(np.stack(entries)).all(0)
        for e in entries:
            e[bad] = 0
        ref = eig_ref(entries)
    ref[:, bad] = np.nan
    assert bad.any() and (~bad).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.abs(out[ok] - ref[ok]).max() <= 1e-4 * float(np.abs(ref[ok]).max())


def test_useful_work_counts_every_filter_the_features_definitions_apply():
    """The throughput record's useful work (docs/contract.md): a feature's filters at their
    own extents, a structure tensor's outer smoothing of its six products, and a preset's
    filters composed with its smoothing, as its library applies them."""
    from volconv.bank.presets import preset_features

    feats = build_features([
        {"type": "gradient_magnitude", "sigma": 1.0, "name": "g"},  # 3 of 9^3
        {"type": "structure_tensor_eigenvalues", "sigma": 1.5, "rho": 1.0, "truncate": 2.0,
         "name": "st"},  # 3 of 7^3 (radius 3), 6 of 5^3 (radius 2)
    ])  # fmt: skip
    assert sorted(map(math.prod, expand([], feats).work_extents)) == sorted(
        [9**3] * 3 + [7**3] * 3 + [5**3] * 6
    )
    skimage = {f.name: f.work_extents() for f in preset_features("skimage", None)}
    assert skimage["intensity_s1"] == [(9, 9, 9)]  # radius 4 at truncate 4
    assert skimage["edges_s1"] == [(11, 11, 11)] * 3  # a Sobel operator on it
    assert skimage["texture_s1"] == [(13, 9, 9), (9, 13, 9), (9, 9, 13), (11, 11, 9),
                                     (11, 9, 11), (9, 11, 11)]  # fmt: skip
    # ilastik at scale 1.6: presmoothing sqrt(1.56) at window 3.5 (radius 4), inner 1 at
    # window 2 (radius 2): 13^3; the outer Gaussian 0.5 at window 2 (radius 1): 3^3
    ilastik = {f.params["feature"]: f.work_extents() for f in preset_features("ilastik", [1.6])}
    assert ilastik["HessianOfGaussianEigenvalues"] == [(13, 13, 13)] * 6
    assert ilastik["StructureTensorEigenvalues"] == [(13, 13, 13)] * 3 + [(3, 3, 3)] * 6
    assert ilastik["DifferenceOfGaussians"] == [(13, 13, 13), (11, 11, 11)]  # 0.66: radius 1
