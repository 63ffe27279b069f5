"""Which form of the pass tree a bank's separable filters take on a device, besides the fused
kernel (`volconv.plan.separable.fused_fits`): three multi-output launches (kernels/tree.cl,
`multi_fits`) or two with axis 0 first (kernels/tree_yz.cl, `xfirst_fits`), which small banks
of device features take over the fused kernel (`xfirst_over_fused`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyopencl as cl

from volconv.engines.xfirst import reversed_tree, xfirst_shape

if TYPE_CHECKING:
    from volconv.engines.passes import FusedTree
    from volconv.plan.separable import Choice

# The pass tree as three multi-output launches (kernels/tree.cl, `multi_fits`) where its
# factors, zero-padded to each axis's window, cost at most this many times their own taps, and
# a work-item's partial sums (responses x rows along axis 0 x vector lanes) at most
# MAX_TREE_VALUES; by default only up to MAX_TREE_TAPS a window (its loops are unrolled).
MAX_TREE_WASTE = 1.25
MAX_TREE_VALUES = 96
MAX_TREE_TAPS = 31
TREE_SHAPE = {"cpu": (4, 2), "gpu": (2, 4)}  # (V, UX) of kernels/tree.cl, as PASS_SHAPE


def multi_fits(
    tree: FusedTree | None, choices: Sequence[Choice], rows: int, lanes: int, forced: bool = True
) -> bool:
    """Whether kernels/tree.cl can run ``tree`` with ``rows`` outputs along axis 0 and
    ``lanes`` along axis 2 per work-item: its partial sums in registers; and, unless
    ``forced``, whether it pays by default (the factors zero-padded to each axis's window cost
    at most `MAX_TREE_WASTE` times their own taps, no window past `MAX_TREE_TAPS`)."""
    if tree is None or tree.n_out * rows * lanes > MAX_TREE_VALUES:
        return False
    if forced:
        return True
    if max(tree.taps) > MAX_TREE_TAPS:
        return False
    terms = [t for c in choices if c.path != "direct" for t in c.terms]
    own = {(d, len(t.axes[d]), t.axes[d].tobytes()) for t in terms for d in range(3)}
    taps = sum(k for _, k, _ in own)
    padded = sum(tree.taps[d] for d, _, _ in own)
    return padded <= MAX_TREE_WASTE * taps


def xfirst_fits(tree: FusedTree | None, device: cl.Device) -> bool:
    """Whether kernels/tree_yz.cl can run the reversed ``tree`` (`reversed_tree`): last_yz's
    tiles in local memory, its partial sums (responses x outputs a work-item) and first_x's
    in registers."""
    shape = None if tree is None else xfirst_shape(tree, device)
    if shape is None:
        return False
    return (
        tree.n_out * shape["VC"] <= MAX_TREE_VALUES
        and len(tree.wz) * shape["UA"] <= MAX_TREE_VALUES
    )


# On GPUs a bank with device features and at most this many separable responses (one
# Hessian's six) runs axis 0 first rather than in the fused kernel, where it fits: faster at
# sigma 1 too (benchmarks/results/h100-hessian-sweep-3.json, the Hessian eigenvalues and the
# gradient magnitude).
XFIRST_OVER_FUSED_OUTS = 6


def xfirst_over_fused(tree: FusedTree | None, choices: Sequence[Choice],
                      halo_lo: tuple[int, int, int], feature_planes: int,
                      device: cl.Device) -> bool:  # fmt: skip
    """Whether a bank (``choices``, its pass ``tree``, its common halo before the outputs
    ``halo_lo``) with ``feature_planes`` device features runs its tree axis 0 first by
    default on ``device`` rather than in the fused kernel: where the tree takes that form by
    default (`multi_fits` in kernels/tree.cl's shape unforced, `xfirst_fits`)."""
    if feature_planes <= 0 or device.type & cl.device_type.CPU:
        return False
    if tree is None or tree.n_out > XFIRST_OVER_FUSED_OUTS:
        return False
    lanes, rows = TREE_SHAPE["gpu"]
    return multi_fits(tree, choices, rows, lanes, forced=False) and xfirst_fits(
        reversed_tree(choices, halo_lo), device
    )
