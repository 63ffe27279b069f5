"""The pass tree in three multi-output launches (kernels/tree.cl), built for a
`volconv.plan.separable.SeparablePlan`: tree_z computes every root from one read of each input
row, tree_y every mid, tree_x every response with the device features as its epilogue, so a
response only features read is never written. The tree comes as the fused kernel's tables
(`volconv.engines.passes.fused_tree`); several input slabs (``root_in``) let a structure
tensor's six products be smoothed as one tree with the eigenvalues as its epilogue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.engines.clock import KernelClock
from volconv.engines.features import build_with_features
from volconv.engines.passes import cl_table
from volconv.plan.direct import CL_TYPES

if TYPE_CHECKING:
    from volconv.engines.passes import FusedTree
    from volconv.plan.separable import SeparablePlan

TREE_ROWS = 2  # outputs per work-item along axis 1 in tree_y (UY)
# Work-group shapes per kind of device (None: the driver's): on GPUs work-items along the
# axis a pass sums share the rows they load (in cache), so each is read from memory about once.
TREE_GROUPS: dict[str, dict[str, tuple[int, int, int] | None]] = {
    "gpu": {"tree_z": None, "tree_y": (32, 8, 1), "tree_x": (32, 1, 8)},
    "cpu": {"tree_z": None, "tree_y": None, "tree_x": None},
}  # fmt: skip


def tree_tables(tree: FusedTree, root_in: Sequence[int] | None,
            products: Sequence[tuple[int, int]] | None,
            weights: tuple[str, str, str]) -> tuple[tuple[str, object], ...]:  # fmt: skip
    """Build options of ``tree``'s tables (its taps as ``weights``: roots', mids', combos'),
    each root's input slab and, with ``products``, each root's pair of planes."""
    roots = tuple(root_in) if root_in is not None else (0,) * len(tree.wz)
    defines = (
        ("N_ROOTS", len(tree.wz)), ("N_MIDS", len(tree.wy)), ("N_COMBOS", len(tree.wx)),
        ("N_OUT", tree.n_out), ("ROOT_IN", cl_table(roots)),
        ("ROOT_FIRST", cl_table([int(r not in roots[:k]) for k, r in enumerate(roots)])),
        ("MID_ROOT", cl_table(tree.mid_root)),
        ("COMBO_MID", cl_table(tree.combo_mid)), ("COMBO_OUT", cl_table(tree.combo_out)),
        *zip(weights, map(cl_table, (tree.wz, tree.wy, tree.wx)), strict=True),
    )  # fmt: skip
    if products is not None:
        defines += (("PAIR_A", cl_table([a for a, _ in products])),
                    ("PAIR_B", cl_table([b for _, b in products])))  # fmt: skip
    return defines


class TreeKernels:
    """A multi-output pass tree's kernels, built for ``tree`` (in slot order), with
    ``epilogue`` (the FEATURES of kernels/fused.cl's form) and the first ``n_stored``
    responses written (every response when there is no epilogue); ``root_in`` the input slab
    of each root (default: one slab); ``depth`` bounds the output rows of a launch (default:
    the plan's slab depth); ``products``: each root's pair of planes, for
    ``launch_products``."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, plan: SeparablePlan,
                 tree: FusedTree, epilogue: str, n_stored: int, feature_planes: int,
                 clock: KernelClock, root_in: Sequence[int] | None = None,
                 depth: int | None = None,
                 products: Sequence[tuple[int, int]] | None = None) -> None:  # fmt: skip
        self.plan, self.queue, self.tree, self.clock = plan, queue, tree, clock
        self.epilogue, self.n_stored, self.feature_planes = epilogue, n_stored, feature_planes
        self.root_in = tuple(root_in) if root_in is not None else (0,) * len(tree.wz)
        self._build(ctx, plan.slab_depth if depth is None else depth, products)

    def _build(self, ctx: cl.Context, depth: int,
               products: Sequence[tuple[int, int]] | None) -> None:  # fmt: skip
        raise NotImplementedError

    @property
    def counts(self) -> tuple[int, int, int]:
        """The tables' roots, mids and combos."""
        return len(self.tree.wz), len(self.tree.wy), len(self.tree.wx)


class MultiTree(TreeKernels):
    """kernels/tree.cl: three launches, axis 2 first (see `TreeKernels`)."""

    def _build(self, ctx: cl.Context, depth: int,
               products: Sequence[tuple[int, int]] | None) -> None:  # fmt: skip
        plan, tree, root_in = self.plan, self.tree, self.root_in
        v, ux = plan.vector_width, plan.rows
        defines = (
            ("KX", tree.taps[0]), ("KY", tree.taps[1]), ("KZ", tree.taps[2]),
            ("S0", tree.start[0]), ("S1", tree.start[1]), ("S2", tree.start[2]),
            *tree_tables(tree, root_in, products, ("WZ", "WY", "WX")),
            ("V", v), ("EV", v), ("UY", TREE_ROWS), ("UX", ux),
            ("IN_T", CL_TYPES[plan.pad_dtype]),
        )  # fmt: skip
        if self.epilogue:
            defines += (("FEATURES", self.epilogue),)
        names = ["tree_z", "tree_y", "tree_x"] + ["tree_z_products"] * (products is not None)
        prog = build_with_features(ctx, "tree.cl", defines)
        self._k = {name: cl.Kernel(prog, name) for name in names}
        kind = "cpu" if ctx.devices[0].type & cl.device_type.CPU else "gpu"
        self.groups = dict(TREE_GROUPS[kind])
        self.groups["tree_z_products"] = self.groups["tree_z"]
        sizes = tree_bytes(plan, tree, depth)
        mf = cl.mem_flags
        self._a = cl.Buffer(ctx, mf.READ_WRITE, sizes["fast"])
        self._b = cl.Buffer(ctx, mf.READ_WRITE, sizes["mid"])

    def launch(self, padded: cl.Buffer, out: cl.Buffer, feat: cl.Buffer, depth: int,
               every: bool, in_stride: int = 0) -> list[cl.Event]:  # fmt: skip
        """Enqueue the three passes over the padded slab(s) (``in_stride`` elements apart) of
        ``depth`` output rows: the stored responses into ``out`` and the features into
        ``feat``, or (``every``) every response and no feature."""
        p1, p2 = self.plan.padded_yz
        px, py = depth + self.tree.taps[0] - 1, self.plan.shape[1] + self.tree.taps[1] - 1
        i32 = np.int32
        self._k["tree_z"].set_args(padded, self._a, i32(px), i32(py), i32(p1), i32(p2),
                                   i32(self.plan.row), np.int64(in_stride))  # fmt: skip
        return self._launch("tree_z", out, feat, depth, every)

    def launch_products(self, g: cl.Buffer, g_plane: int, m0: cl.Buffer, m1: cl.Buffer,
                        m2: cl.Buffer, cval: float, out: cl.Buffer, feat: cl.Buffer,
                        depth: int) -> list[cl.Event]:  # fmt: skip
        """`launch` with each root's input the product of its pair of the three planes
        ``g`` (``g_plane`` elements apart), read through the index maps ``m0`` (the padded
        rows' rows of ``g``), ``m1``, ``m2`` (-1: ``cval``)."""
        ny, nz = self.plan.shape[1:]
        px, py = depth + self.tree.taps[0] - 1, ny + self.tree.taps[1] - 1
        i32 = np.int32
        self._k["tree_z_products"].set_args(
            g, np.int64(g_plane), self._a, m0, m1, m2, i32(px), i32(py), i32(ny), i32(nz),
            i32(self.plan.row), np.float32(cval),
        )  # fmt: skip
        return self._launch("tree_z_products", out, feat, depth, False)

    def _launch(self, first: str, out: cl.Buffer, feat: cl.Buffer, depth: int,
                every: bool) -> list[cl.Event]:  # fmt: skip
        """Enqueue ``first`` (its arguments set), tree_y and tree_x."""
        plan, tree, queue = self.plan, self.tree, self.queue
        ny, nz = plan.shape[1:]
        r, v, ux = plan.row, plan.vector_width, plan.rows
        kx, ky, _ = tree.taps
        px, py = depth + kx - 1, ny + ky - 1
        i32 = np.int32
        kyy, kxx = self._k["tree_y"], self._k["tree_x"]
        kyy.set_args(self._a, self._b, i32(px), i32(py), i32(ny), i32(r))
        n_stored = -1 if every or not self.epilogue else self.n_stored
        kxx.set_args(self._b, out, feat, i32(depth), i32(px), i32(ny), i32(nz), i32(r),
                     i32(n_stored))  # fmt: skip
        launches = (
            (first, self._k[first], (r // v, py, px)),
            ("tree_y", kyy, (r // v, -(-ny // TREE_ROWS), px)),
            ("tree_x", kxx, (-(-nz // v), ny, -(-depth // ux))),
        )
        events = []
        for name, k, glob in launches:
            group = self.groups[name]
            if group is not None:  # whole groups: the kernels skip what lies past the edges
                glob = tuple(-(-n // g) * g for n, g in zip(glob, group, strict=True))
            event = cl.enqueue_nd_range_kernel(queue, k, glob, group)
            events.append(self.clock.add(name, event))
        return events

    def work(self, slabs: Iterable[tuple[int, int]]) -> tuple[float, int]:
        """(flop, bytes) over ``slabs``: every pass's taps over every output it produces
        (halo rows and the row tail included), each intermediate written and read once, the
        padded slab read once and the planes written."""
        plan, tree = self.plan, self.tree
        ny, nz = plan.shape[1:]
        r = plan.row
        kx, ky, kz = tree.taps
        written = self.n_stored + self.feature_planes if self.epilogue else tree.n_out
        n_in = len(set(self.root_in))
        flop, moved = 0.0, 0
        for a, b in slabs:
            px, py = b - a + kx - 1, ny + ky - 1
            flop += 2 * kz * len(tree.wz) * px * py * r
            flop += 2 * ky * len(tree.wy) * px * ny * r
            flop += 2 * kx * len(tree.wx) * (b - a) * ny * nz
            moved += n_in * px * py * (r + kz - 1) * plan.pad_dtype.itemsize
            moved += 2 * 4 * (len(tree.wz) * px * py * r + len(tree.wy) * px * ny * r)
            moved += written * (b - a) * ny * nz * 4
        return flop, moved


def tree_bytes(plan: SeparablePlan, tree: FusedTree, depth: int) -> dict[str, int]:
    """Device bytes of the intermediates for ``depth`` output rows: A ("fast", every root)
    and B ("mid", every mid)."""
    ny = plan.shape[1]
    kx, ky, _ = tree.taps
    px, py = depth + kx - 1, ny + ky - 1
    return {"fast": len(tree.wz) * px * py * plan.row * 4,
            "mid": len(tree.wy) * px * ny * plan.row * 4}  # fmt: skip
