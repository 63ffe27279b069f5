"""kernels/structure.cl: the structure tensor's outer smoothing in two launches, in the tile
shapes each kind of device runs (volconv.engines.structure.ST_SHAPES), against float64."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage as ndi
from test_features import AXES, eig_ref, gauss, kernel_l1, run, scene, tol, weyl

import volconv.engines.structure as st
from volconv.bank.features import PAIRS, build_features, expand
from volconv.checks import SPEC_ATOL, SPEC_RTOL
from volconv.engines.separable import SeparableConvolver


@pytest.mark.parametrize(
    ("kind", "mode", "rho", "block", "flat"),
    [("gpu", "reflect", 1.5, None, 1), ("gpu", "reflect", 1.5, None, 0),
     ("cpu", "constant", 1.0, 2, 0), ("cpu", "constant", 1.0, 2, 1)],
)  # fmt: skip
def test_structure_kernels_in_each_shape(device, monkeypatch, kind, mode, rho, block, flat):
    """Tiles cut by the volume's edges along axes 1 and 2 (the GPU's 32 x 64 over 40 x 70),
    slab seams every 5 rows, rho's reach past the slab, blocks of rows in a slab; FLAT: the
    tiles of the zero background skipped (or their pass along axis 2) and its diagonal
    matrices by a branch
    (constant mode: a nonzero cval around them): within the Weyl bound of the float64
    definition's eigenvalues."""
    shape = dict(st.ST_SHAPES[kind], XG=None, FLAT=flat)  # XG: the driver's on PoCL
    if block is not None:
        shape["BLOCK"] = block
    monkeypatch.setitem(st.ST_SHAPES, "cpu", shape)
    volume = scene((12, 40, 70), seed=3)
    cval = 2.0 if mode == "constant" else 0.0
    sigma = 1.0
    feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": sigma,
                             "rho": rho, "name": "st"}])  # fmt: skip
    options = {"slab_depth": 5, "multi": True, "xfirst": False}
    out = run(volume, [], feats, mode, cval, device, **options)
    ex = expand([], feats)
    conv = SeparableConvolver(ex.filters, volume.shape, volume.dtype, mode, cval, device=device,
                              expanded=ex, **options)  # fmt: skip
    assert conv._tensors[0][0]._st is not None  # these kernels ran
    m = max(float(np.abs(volume).max()), abs(cval))
    g = [gauss(volume, sigma, o, mode, cval) for o in AXES]
    entries = [ndi.gaussian_filter(g[a] * g[b], rho, mode=mode, cval=cval) for a, b in PAIRS]
    t = [tol(kernel_l1(sigma, o), m) for o in AXES]
    gmax = [float(np.abs(x).max()) for x in g]
    bound = weyl([gmax[a] * t[b] + gmax[b] * t[a] + t[a] * t[b]
                  + SPEC_RTOL * (gmax[a] * gmax[b] + abs(cval)) + SPEC_ATOL
                  for a, b in PAIRS])  # fmt: skip
    err = np.abs(out - eig_ref(entries)).max()
    assert err <= bound, (err, bound)


def test_kernel_time_is_the_named_kernels_and_the_gradients_pads_are_pad(device):
    """A structure tensor's slab counts its gradients' uploads and pads as "upload" and
    "pad", and as "kernel" exactly the kernels `kernel_seconds` names (the benchmarks' split
    of where a slab's time goes)."""
    volume = scene((12, 20, 24), seed=5)
    feats = build_features([{"type": "structure_tensor_eigenvalues", "sigma": 1.0,
                             "rho": 1.0, "name": "st"}])  # fmt: skip
    ex = expand([], feats)
    conv = SeparableConvolver(ex.filters, volume.shape, volume.dtype, "reflect", 0.0,
                              device=device, expanded=ex, slab_depth=5)  # fmt: skip
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, frame=volume)
    named = sum(conv.kernel_seconds.values())
    assert conv.timings["pad"] > 0 and conv.timings["kernel"] > 0
    assert conv.timings["kernel"] == pytest.approx(named, rel=1e-9), (conv.timings, named)
