"""The pass tree as one kernel for CPUs (kernels/columns.cl) on a general bank, against
scipy.ndimage (float64) at the contract's tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage as ndi
from conftest import assert_spec_close, reference
from test_separable import FUSED, rank_r, volume

from volconv.bank.features import build_features, expand
from volconv.bank.filters import build_bank
from volconv.checks import SPEC_ATOL, SPEC_RTOL
from volconv.engines import columns
from volconv.engines.columns import COLUMN_SHAPE
from volconv.engines.separable import SeparableConvolver, convolve_separable
from volconv.plan.separable import make_separable_plan, plan_bank


@pytest.mark.parametrize("half", [False, True], ids=["rows", "half-rows"])
@pytest.mark.parametrize(("mode", "cval"), [("reflect", 0.0), ("constant", -7.5), ("wrap", 0.0)])
def test_a_mixed_bank_with_seams_and_edges(device, mode, cval, half, monkeypatch):
    """Every kind of factor (symmetric, antisymmetric, neither: a custom rank-2 kernel of even
    extents), extents that differ per axis and per filter; slabs of 3 rows; axis 1 past a
    work-item's TY rows (all of them, or half where its ring of mids is large) and axis 2 past
    its V lanes, both with a tail."""
    rows = COLUMN_SHAPE["TY"] // (2 if half else 1)
    monkeypatch.setattr(columns, "column_shape", lambda tree: {**COLUMN_SHAPE, "TY": rows})
    bank = [*build_bank(FUSED), rank_r((4, 3, 6), 2)]
    shape = (11, COLUMN_SHAPE["TY"] + 5, 2 * COLUMN_SHAPE["V"] + 3)
    vol = volume(shape)
    options = {"choices": plan_bank(bank, force="separable"), "columns": True, "fused": False,
               "multi": False, "slab_depth": 3}  # fmt: skip
    conv = SeparableConvolver(bank, shape, vol.dtype, mode, cval, device=device, **options)
    assert conv.plan.columns and conv.pass_counts[2] >= len(bank)
    assert conv._passes.ty == rows
    out = convolve_separable(vol, bank, mode, cval, device=device, **options)
    for f, k in enumerate(bank):
        k = getattr(k, "kernel", k)
        assert_spec_close(out[f : f + 1], vol, k[None], reference(vol, k[None], mode, cval))


def test_the_default_on_cpus(device):
    """CPUs take the kernel for a bank with device features (the gradient magnitude), not for
    a plain bank; a stored response beside the feature comes out of it too."""
    feats = build_features([{"type": "gradient_magnitude", "sigma": 1.0, "name": "g"}])
    ex = expand(build_bank([{"type": "gaussian", "sigma": 1.0, "order": [1, 0, 0]}]), feats)
    cpu = bool(device.type & 2)  # CL_DEVICE_TYPE_CPU
    plan = make_separable_plan(ex.filters, (9, 10, 11), np.uint8, "reflect", 0.0, device,
                               **ex.plan_sizes())  # fmt: skip
    assert plan.columns == cpu
    plain = make_separable_plan(ex.filters, (9, 10, 11), np.uint8, "reflect", 0.0, device)
    assert not plain.columns
    # a bank with a direct filter beside its separable ones (its group planned first) keeps
    # its own path: the kernel is a bool of the plan, never a group's buffer sizes
    mixed = make_separable_plan([*build_bank([{"type": "gaussian", "sigma": 1.0}]),
                                 rank_r((3, 3, 3), 3)], (9, 10, 11), np.uint8, "reflect", 0.0,
                                device)  # fmt: skip
    assert mixed.groups and mixed.columns is False
    vol = volume((9, 10, 11))
    out = convolve_separable(vol, ex.filters[:1], "reflect", device=device, features=feats)
    k = ex.filters[0].kernel
    assert_spec_close(out[:1], vol, k[None], reference(vol, k[None], "reflect"))
    ref = ndi.gaussian_gradient_magnitude(vol.astype(np.float64), 1.0, mode="reflect")
    assert np.abs(out[-1] - ref).max() <= 2 * SPEC_RTOL * 255 + SPEC_ATOL  # sum|k| < 1


@pytest.mark.parametrize("scale", [1.0, 1e22])
def test_the_gradient_magnitude_in_float32_and_where_it_overflows(device, scale):
    """The kernel's magnitude: in float32 where the sum of squares is finite, through float64
    where it overflows float32 (components near 2^64, some lanes of a vector only); zero
    where the volume is flat; an odd tail along axis 2 and slabs of 5 rows."""
    feats = build_features([{"type": "gradient_magnitude", "sigma": 1.0, "name": "g"}])
    shape = (13, 12, COLUMN_SHAPE["V"] + 5)
    vol = (volume(shape).astype(np.float64) * scale).astype(np.float32)
    vol[:, :, : COLUMN_SHAPE["V"]] = 0.0  # flat: its lanes' magnitudes exactly 0
    ex = expand([], feats)
    conv = SeparableConvolver(ex.filters, shape, vol.dtype, "reflect", device=device,
                              expanded=ex, slab_depth=5)  # fmt: skip
    assert conv.plan.columns == bool(device.type & 2)
    out = convolve_separable(vol, [], "reflect", device=device, features=feats, slab_depth=5)
    ref = ndi.gaussian_gradient_magnitude(vol.astype(np.float64), 1.0, mode="reflect")
    if scale > 1:
        assert (ref > np.sqrt(np.finfo(np.float32).max)).any()  # squares past float32
    assert np.isfinite(out).all()
    assert (out[0][ref == 0] == 0).all() and (ref == 0).any()
    atol = 2 * SPEC_RTOL * np.abs(vol).max() + SPEC_ATOL  # sum|k| < 1 per component
    np.testing.assert_allclose(out[0], ref, rtol=0, atol=atol)
