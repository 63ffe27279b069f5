"""The pass tree in three multi-output launches (kernels/tree.cl), built for a
`volconv.plan.separable.SeparablePlan`: tree_z computes every root from one read of each input
row, tree_y every mid, tree_x every response with the device features as its epilogue, so a
response only features read is never written. The tree comes as the fused kernel's tables
(`volconv.engines.passes.fused_tree`); several input slabs (``root_in``) let a structure
tensor's six products be smoothed as one tree with the eigenvalues as its epilogue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.engines.clock import KernelClock
from volconv.engines.features import build_with_features
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


def _table(t: object) -> str:
    """Indices, or float32 taps as exact hex literals, comma-separated."""
    if isinstance(t, np.ndarray):
        return ",".join(f"{float(w).hex()}f" for w in t.ravel())
    return ",".join(map(str, t))


def _tables(tree: FusedTree, root_in: Sequence[int] | None,
            products: Sequence[tuple[int, int]] | None,
            weights: tuple[str, str, str]) -> tuple[tuple[str, object], ...]:  # fmt: skip
    """Build options of ``tree``'s tables (its taps as ``weights``: roots', mids', combos'),
    each root's input slab and, with ``products``, each root's pair of planes."""
    roots = tuple(root_in) if root_in is not None else (0,) * len(tree.wz)
    defines = (
        ("N_ROOTS", len(tree.wz)), ("N_MIDS", len(tree.wy)), ("N_COMBOS", len(tree.wx)),
        ("N_OUT", tree.n_out), ("ROOT_IN", _table(roots)),
        ("ROOT_FIRST", _table([int(r not in roots[:k]) for k, r in enumerate(roots)])),
        ("MID_ROOT", _table(tree.mid_root)),
        ("COMBO_MID", _table(tree.combo_mid)), ("COMBO_OUT", _table(tree.combo_out)),
        *zip(weights, map(_table, (tree.wz, tree.wy, tree.wx)), strict=True),
    )  # fmt: skip
    if products is not None:
        defines += (("PAIR_A", _table([a for a, _ in products])),
                    ("PAIR_B", _table([b for _, b in products])))  # fmt: skip
    return defines


class _Tree:
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


class MultiTree(_Tree):
    """kernels/tree.cl: three launches, axis 2 first (see `_Tree`)."""

    def _build(self, ctx: cl.Context, depth: int,
               products: Sequence[tuple[int, int]] | None) -> None:  # fmt: skip
        plan, tree, root_in = self.plan, self.tree, self.root_in
        v, ux = plan.vector_width, plan.rows
        defines = (
            ("KX", tree.taps[0]), ("KY", tree.taps[1]), ("KZ", tree.taps[2]),
            ("S0", tree.start[0]), ("S1", tree.start[1]), ("S2", tree.start[2]),
            *_tables(tree, root_in, products, ("WZ", "WY", "WX")),
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


# -- axis 0 first -------------------------------------------------------------------------
# kernels/tree_yz.cl's shape per kind of device: last_yz's tile (TY x TZ of a row), UB rows of
# a mid and VC outputs along axis 2 a work-item, first_x's UA rows a work-item, and the output
# rows both run over at a time (BLOCK, the plan's block_rows; 0: the slab); ONE_ROOT: last_yz
# holds one root's tile at a time (larger tiles fit). The GPU's as measured fastest on the H100
# (benchmarks/results/h100-feature-sweep-*.json).
XFIRST_SHAPE = {
    "gpu": {"TY": 16, "TZ": 32, "UB": 4, "VC": 2, "UA": 8, "BLOCK": 64, "ONE_ROOT": 0},
    "cpu": {"TY": 4, "TZ": 16, "UB": 2, "VC": 4, "UA": 4, "BLOCK": 0, "ONE_ROOT": 0},
}


def reversed_tree(choices: Sequence, halo_lo: tuple[int, int, int]) -> FusedTree | None:
    """`volconv.engines.passes.fused_tree` with the axes taken in reverse order: its roots
    are the distinct axis-0 factors, its combos' taps lie along axis 2 (``start`` and
    ``taps`` reversed too)."""
    from types import SimpleNamespace

    from volconv.bank.factor import Term
    from volconv.engines.passes import fused_tree

    flipped = [
        SimpleNamespace(path=c.path, terms=None if c.terms is None else tuple(
            Term(t.coef, t.axes[::-1]) for t in c.terms))
        for c in choices
    ]  # fmt: skip
    return fused_tree(flipped, tuple(halo_lo[::-1]))


def xfirst_local_bytes(tree: FusedTree, shape: dict[str, int]) -> int:
    """Local memory of last_yz for the reversed ``tree``: the roots' tiles (one with
    ONE_ROOT) and every mid's."""
    ly, lz = shape["TY"] + tree.taps[1] - 1, shape["TZ"] + tree.taps[0] - 1
    tiles = 1 if shape.get("ONE_ROOT") else len(tree.wz)
    return 4 * lz * (tiles * ly + len(tree.wy) * shape["TY"])


def xfirst_shape(tree: FusedTree, device: cl.Device) -> dict[str, int] | None:
    """`XFIRST_SHAPE` of ``device``'s kind, one root's tile at a time, then its tile's rows
    halved (down to UB), until last_yz's tiles fit the device's local memory; None if they
    never do."""
    kind = "cpu" if device.type & cl.device_type.CPU else "gpu"
    shape = dict(XFIRST_SHAPE[kind])
    while xfirst_local_bytes(tree, shape) > device.local_mem_size:
        if not shape["ONE_ROOT"]:
            shape["ONE_ROOT"] = 1
            continue
        if shape["TY"] // 2 < shape["UB"] or shape["TY"] % (2 * shape["UB"]):
            return None
        shape["TY"] //= 2
    return shape


def xfirst_bytes(plan: SeparablePlan, tree: FusedTree, depth: int) -> int:
    """Device bytes of A for ``depth`` output rows (at most the plan's block of them)."""
    block = plan.block_rows or depth
    ny, nz = plan.shape[1:]
    py, rz = ny + tree.taps[1] - 1, -(-(nz + tree.taps[0] - 1) // 4) * 4
    return len(tree.wz) * min(block, depth) * py * rz * 4


class XFirstTree(_Tree):
    """kernels/tree_yz.cl: two launches, axis 0 first, for a plan's reversed tree
    (`reversed_tree`; see `_Tree`)."""

    def _build(self, ctx: cl.Context, depth: int,
               products: Sequence[tuple[int, int]] | None) -> None:  # fmt: skip
        plan, tree, root_in = self.plan, self.tree, self.root_in
        self.shape = xfirst_shape(tree, ctx.devices[0])
        if self.shape is None:
            raise ValueError("xfirst: the tree's tiles do not fit local memory")
        s = self.shape
        defines = (
            ("KA", tree.taps[2]), ("KB", tree.taps[1]), ("KC", tree.taps[0]),
            ("SA", tree.start[2]), ("SB", tree.start[1]), ("SC", tree.start[0]),
            *_tables(tree, root_in, products, ("WA", "WB", "WC")),
            ("UA", s["UA"]), ("TY", s["TY"]), ("TZ", s["TZ"]), ("UB", s["UB"]),
            ("VC", s["VC"]), ("IN_T", CL_TYPES[plan.pad_dtype]),
        )  # fmt: skip
        if s["ONE_ROOT"]:
            defines += (("ONE_ROOT", 1),)
        if self.epilogue:
            defines += (("FEATURES", self.epilogue),)
        names = ["first_x", "last_yz"] + ["first_x_products"] * (products is not None)
        prog = build_with_features(ctx, "tree_yz.cl", defines)
        self._k = {name: cl.Kernel(prog, name) for name in names}
        self.block = min(plan.block_rows or depth, depth)
        ny, nz = plan.shape[1:]
        self.py, self.pz = ny + tree.taps[1] - 1, nz + tree.taps[0] - 1
        self.rz = -(-self.pz // 4) * 4
        self._a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, xfirst_bytes(plan, tree, depth))

    def launch(self, padded: cl.Buffer, out: cl.Buffer, feat: cl.Buffer, depth: int,
               every: bool, in_stride: int = 0) -> list[cl.Event]:  # fmt: skip
        """Enqueue the two kernels over the padded slab(s) of ``depth`` output rows, a block
        of rows at a time (see `MultiTree.launch`)."""
        p1, p2 = self.plan.padded_yz
        i32 = np.int32

        def first(x0: int, nx: int) -> None:
            self._k["first_x"].set_args(padded, self._a, i32(x0), i32(nx), i32(self.py),
                                        i32(self.pz), i32(p1), i32(p2), i32(self.rz),
                                        np.int64(in_stride))  # fmt: skip

        return self._launch("first_x", first, out, feat, depth, every)

    def launch_products(self, g: cl.Buffer, g_plane: int, m0: cl.Buffer, m1: cl.Buffer,
                        m2: cl.Buffer, cval: float, out: cl.Buffer, feat: cl.Buffer,
                        depth: int) -> list[cl.Event]:  # fmt: skip
        """`launch` with the roots' inputs products of three planes (`MultiTree`'s)."""
        ny, nz = self.plan.shape[1:]
        i32 = np.int32

        def first(x0: int, nx: int) -> None:
            self._k["first_x_products"].set_args(
                g, np.int64(g_plane), self._a, m0, m1, m2, i32(x0), i32(nx), i32(self.py),
                i32(self.pz), i32(ny), i32(nz), i32(self.rz), np.float32(cval),
            )  # fmt: skip

        return self._launch("first_x_products", first, out, feat, depth, False)

    def _launch(self, name: str, first: Callable[[int, int], None], out: cl.Buffer,
                feat: cl.Buffer, depth: int, every: bool) -> list[cl.Event]:  # fmt: skip
        """Enqueue ``name`` (its arguments set by ``first(x0, rows)``) and last_yz over each
        block of rows."""
        plan, s, queue = self.plan, self.shape, self.queue
        ny, nz = plan.shape[1:]
        i32 = np.int32
        last = self._k["last_yz"]
        n_stored = -1 if every or not self.epilogue else self.n_stored
        group = (s["TZ"] // s["VC"], s["TY"], 1)
        events = []
        for x0 in range(0, depth, self.block):
            nx = min(self.block, depth - x0)
            first(x0, nx)
            glob = (self.pz, self.py, -(-nx // s["UA"]))
            event = cl.enqueue_nd_range_kernel(queue, self._k[name], glob, None)
            events.append(self.clock.add(name, event))
            last.set_args(self._a, out, feat, i32(x0), i32(nx), i32(depth), i32(ny), i32(nz),
                          i32(self.py), i32(self.rz), i32(n_stored))  # fmt: skip
            glob = (-(-nz // s["TZ"]) * group[0], -(-ny // s["TY"]) * group[1], nx)
            events.append(
                self.clock.add("last_yz", cl.enqueue_nd_range_kernel(queue, last, glob, group))
            )
        return events

    def work(self, slabs: Iterable[tuple[int, int]]) -> tuple[float, int]:
        """(flop, bytes) over ``slabs``: first_x's taps over A, last_yz's over every tile
        (edge tiles included); the padded slab read once, A written and read once, the planes
        written."""
        plan, tree, s = self.plan, self.tree, self.shape
        ny, nz = plan.shape[1:]
        ka, kb, kc = tree.taps[2], tree.taps[1], tree.taps[0]
        tiles = -(-ny // s["TY"]) * -(-nz // s["TZ"])
        lz = s["TZ"] + kc - 1
        per_row = 2 * tiles * (kb * len(tree.wy) * s["TY"] * lz
                               + kc * len(tree.wx) * s["TY"] * s["TZ"])  # fmt: skip
        written = self.n_stored + self.feature_planes if self.epilogue else tree.n_out
        flop, moved = 0.0, 0
        for a, b in slabs:
            d = b - a
            flop += 2 * ka * len(tree.wz) * d * self.py * self.pz + per_row * d
            moved += (d + ka - 1) * self.py * self.pz * plan.pad_dtype.itemsize
            moved += 2 * 4 * len(tree.wz) * d * self.py * self.pz + written * d * ny * nz * 4
        return flop, moved
