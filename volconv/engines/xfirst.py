"""The pass tree axis 0 first in two launches (kernels/tree_yz.cl), for a plan's tree with its
axes reversed (`reversed_tree`): first_x filters the padded slab along axis 0 by every distinct
axis-0 factor from one read of it, into A (a block of output rows at a time); last_yz filters
A along axes 1 and 2 through local memory, a root at a time, and ends in the device features
as its epilogue. The form of long windows (the Hessian at sigma 3) and, on GPUs, of small banks
of device features (one Hessian, a gradient magnitude): `volconv.plan.trees` says where it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.engines.features import ZeroBands, build_with_features, zero_bands_bytes
from volconv.engines.tree import TreeKernels, tree_tables
from volconv.plan.direct import CL_TYPES

if TYPE_CHECKING:
    from volconv.engines.passes import FusedTree
    from volconv.plan.separable import SeparablePlan

# kernels/tree_yz.cl's shape per kind of device: last_yz's tile (TY x TZ of a row), UB rows of
# a mid and VC outputs along axis 2 a work-item, MG mids at a time (0: a root's), PREFETCH
# (the next root's tile loaded to registers while a root's combos are computed), first_x's UA
# rows a work-item and its work-group (FX: along axes 2, 1; 0: the driver's), and the output
# rows both run over at a time (BLOCK, the plan's block_rows; 0: the slab), FLAT (a zero
# background, ZERO_SKIP: first_x stores no column of zeros where A holds zeros already, last_yz
# skips the tiles where A is zero; eigen_sym3 takes diagonal matrices by a branch, EIG_FLAT; on
# CPUs, which run work-items in SIMD lanes, none of it). The
# GPU's as measured fastest on the H100 (benchmarks/results/h100-feature-sweep-8-*.json: the
# Hessian at sigma 3 and 1 on the demo scan).
XFIRST_SHAPE = {
    "gpu": {"TY": 16, "TZ": 64, "UB": 4, "VC": 4, "MG": 0, "UA": 8, "BLOCK": 64,
            "PREFETCH": 1, "FX": (64, 4), "FLAT": 1},
    "cpu": {"TY": 4, "TZ": 16, "UB": 2, "VC": 4, "MG": 0, "UA": 4, "BLOCK": 0,
            "PREFETCH": 0, "FX": 0, "FLAT": 0},
}  # fmt: skip


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


def mid_slots(tree: FusedTree) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each mid's place among its root's mids, and each root's count of mids."""
    counts = [0] * len(tree.wz)
    slots = []
    for r in tree.mid_root:
        slots.append(counts[r])
        counts[r] += 1
    return tuple(slots), tuple(counts)


def mids_at_once(tree: FusedTree, shape: dict[str, int]) -> int:
    """MG: the mids last_yz holds in local memory at a time (the shape's MG, 0: every mid of
    a root)."""
    most = max(mid_slots(tree)[1])
    return min(shape.get("MG") or most, most)


def mid_pitch(tree: FusedTree, shape: dict[str, int]) -> int:
    """PM: the elements between two rows of a mid in last_yz's local memory, odd, so that a
    warp's loads across TL rows fall in distinct banks."""
    return (shape["TZ"] + tree.taps[0] - 1) | 1


def warp_rows(shape: dict[str, int]) -> int:
    """TL: the rows of a warp (32 work-items) in last_yz's combos, VC where the tile splits
    into whole warps of VC rows by 32 / VC runs; else 1 (work-items along axis 2 first)."""
    ty, vc = shape["TY"], shape["VC"]
    runs = shape["TZ"] // vc
    if vc > 32 or 32 % vc or ty % vc or runs % (32 // vc) or ty * runs % 32:
        return 1
    return vc


def staged(tree: FusedTree, shape: dict[str, int]) -> tuple[int, int]:
    """(ROUNDS, LBUF) of last_yz: the rounds its features' epilogue stages the responses in
    (the fewest, halving each work-item's outputs a round, whose responses fit the local
    memory a root's tile and MG mids take) and the floats of its local memory."""
    ty, tz, vc = shape["TY"], shape["TZ"], shape["VC"]
    ly, lz = ty + tree.taps[1] - 1, tz + tree.taps[0] - 1
    tiles = ly * lz + mids_at_once(tree, shape) * ty * mid_pitch(tree, shape)
    rounds = 1
    while tree.n_out * ty * (tz // rounds + 1) > tiles and vc % (2 * rounds) == 0:
        rounds *= 2
    return rounds, max(tiles, tree.n_out * ty * (tz // rounds + 1))


def xfirst_local_bytes(tree: FusedTree, shape: dict[str, int]) -> int:
    """Local memory of last_yz for the reversed ``tree``: a root's tile and MG mids', or
    a round of staged responses."""
    return 4 * staged(tree, shape)[1]


def xfirst_shape(tree: FusedTree, device: cl.Device) -> dict[str, int] | None:
    """`XFIRST_SHAPE` of ``device``'s kind, its tile's rows halved (down to UB) until
    last_yz's tiles fit the device's local memory and its work-group the device; None if they
    never do."""
    kind = "cpu" if device.type & cl.device_type.CPU else "gpu"
    shape = {"PREFETCH": 0, "FX": 0, "FLAT": 0, **XFIRST_SHAPE[kind]}
    while (xfirst_local_bytes(tree, shape) > device.local_mem_size
           or shape["TY"] * shape["TZ"] // shape["VC"] > device.max_work_group_size):  # fmt: skip
        if shape["TY"] // 2 < shape["UB"] or shape["TY"] % (2 * shape["UB"]):
            return None
        shape["TY"] //= 2
    return shape


def xfirst_bytes(plan: SeparablePlan, tree: FusedTree, depth: int) -> int:
    """Device bytes of A and of its bands (at most: a band a row) for ``depth`` output rows (at
    most the plan's block of them)."""
    rows = min(plan.block_rows or depth, depth)
    ny, nz = plan.shape[1:]
    py, rz = ny + tree.taps[1] - 1, -(-(nz + tree.taps[0] - 1) // 4) * 4
    return len(tree.wz) * rows * py * rz * 4 + zero_bands_bytes(rows, 1, py, rz)


class XFirstTree(TreeKernels):
    """kernels/tree_yz.cl: two launches, axis 0 first, for a plan's reversed tree
    (`reversed_tree`; see `TreeKernels`)."""

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
            *tree_tables(tree, root_in, products, ("WA", "WB", "WC")),
            ("UA", s["UA"]), ("TY", s["TY"]), ("TZ", s["TZ"]), ("UB", s["UB"]),
            ("VC", s["VC"]), ("PM", mid_pitch(tree, s)), ("TL", warp_rows(s)),
            ("PREFETCH", int(bool(s["PREFETCH"]))), ("IN_T", CL_TYPES[plan.pad_dtype]),
            ("ZERO_SKIP", int(bool(s["FLAT"]))),
            ("FEATURE_PLANES", self.feature_planes if self.epilogue else 0),
        )  # fmt: skip
        if s["FLAT"]:
            defines += (("EIG_FLAT", 1),)
        slots, counts = mid_slots(tree)
        rounds, lbuf = staged(tree, s)
        defines += (("MID_SLOT", ",".join(map(str, slots))),
                    ("ROOT_MIDS", ",".join(map(str, counts))), ("MAXM", max(counts)),
                    ("MG", mids_at_once(tree, s)), ("ROUNDS", rounds), ("LBUF", lbuf))  # fmt: skip
        if self.epilogue:
            defines += (("FEATURES", self.epilogue),)
        names = ["first_x", "last_yz"] + ["first_x_products"] * (products is not None)
        prog = build_with_features(ctx, "tree_yz.cl", defines)
        self._k = {name: cl.Kernel(prog, name) for name in names}
        self.block = min(plan.block_rows or depth, depth)
        ny, nz = plan.shape[1:]
        self.py, self.pz = ny + tree.taps[1] - 1, nz + tree.taps[0] - 1
        self.rz = -(-self.pz // 4) * 4
        a_bytes = len(tree.wz) * self.block * self.py * self.rz * 4  # xfirst_bytes's A
        self._a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, a_bytes)
        self._bands = ZeroBands(ctx, self.block, s["UA"], self.py, self.rz)

    def launch(self, padded: cl.Buffer, out: cl.Buffer, feat: cl.Buffer, depth: int,
               every: bool, in_stride: int = 0) -> list[cl.Event]:  # fmt: skip
        """Enqueue the two kernels over the padded slab(s) of ``depth`` output rows, a block
        of rows at a time (see `MultiTree.launch`)."""
        p1, p2 = self.plan.padded_yz
        i32 = np.int32

        def first(x0: int, nx: int) -> None:
            self._k["first_x"].set_args(padded, self._a, i32(x0), i32(nx), i32(self.block),
                                        i32(self.py), i32(self.pz), i32(p1), i32(p2),
                                        i32(self.rz), np.int64(in_stride), self._bands.buffer,
                                        self._bands.epoch, self._bands.held)  # fmt: skip

        return self._launch("first_x", first, out, feat, depth, every)

    def launch_products(self, g: cl.Buffer, g_plane: int, m0: cl.Buffer, m1: cl.Buffer,
                        m2: cl.Buffer, cval: float, out: cl.Buffer, feat: cl.Buffer,
                        depth: int) -> list[cl.Event]:  # fmt: skip
        """`launch` with the roots' inputs products of three planes (`MultiTree`'s)."""
        ny, nz = self.plan.shape[1:]
        i32 = np.int32

        def first(x0: int, nx: int) -> None:
            self._k["first_x_products"].set_args(
                g, np.int64(g_plane), self._a, m0, m1, m2, i32(x0), i32(nx), i32(self.block),
                i32(self.py), i32(self.pz), i32(ny), i32(nz), i32(self.rz), np.float32(cval),
                self._bands.buffer, self._bands.epoch, self._bands.held,
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
        items = s["TY"] * s["TZ"] // s["VC"]
        fx = (*s["FX"], 1) if s["FX"] else None
        events = []
        for x0 in range(0, depth, self.block):
            nx = min(self.block, depth - x0)
            self._bands.advance()
            first(x0, nx)
            glob = (self.pz, self.py, -(-nx // s["UA"]))
            if fx is not None:  # whole groups: the kernel skips what lies past the edges
                glob = tuple(-(-n // g) * g for n, g in zip(glob, fx, strict=True))
            event = cl.enqueue_nd_range_kernel(queue, self._k[name], glob, fx)
            events.append(self.clock.add(name, event))
            last.set_args(self._a, out, feat, i32(x0), i32(nx), i32(self.block), i32(depth),
                          i32(ny), i32(nz), i32(self.py), i32(self.rz), i32(n_stored),
                          self._bands.buffer, self._bands.epoch)  # fmt: skip
            glob = (-(-nz // s["TZ"]) * items, -(-ny // s["TY"]), nx)
            event = cl.enqueue_nd_range_kernel(queue, last, glob, (items, 1, 1))
            events.append(self.clock.add("last_yz", event))
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
