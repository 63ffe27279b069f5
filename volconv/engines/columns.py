"""The separable pass tree in one kernel on CPUs (kernels/columns.cl): `ColumnKernel`, built for
a `volconv.plan.separable.SeparablePlan` from the tables `volconv.engines.passes.fused_tree`
makes, with the device features as its epilogue; where it fits (`columns_fits`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.engines.clock import KernelClock
from volconv.engines.features import build_with_features
from volconv.engines.passes import fused_defines

if TYPE_CHECKING:
    from volconv.engines.passes import FusedTree
    from volconv.plan.separable import SeparablePlan

# A work-item's outputs: V lanes along axis 2 (AVX2's eight floats), TY along axis 1 and CX
# rows along axis 0 (0: every row of the launch), a work-item a work-group (PoCL's own choice
# gives two groups a slab at 128^3); measured fastest on PoCL (benchmarks/README.md).
COLUMN_SHAPE = {"V": 8, "TY": 32, "CX": 0}
# Floats a work-item's ring of mids (2 KX planes x mids x TY x V) may hold by default.
MAX_COLUMN_VALUES = 96 * 1024
# Floats of a ring that a core's first caches hold: a tree whose ring at TY rows passes it and
# at TY / 2 does not takes half the rows (the Hessian's six mids of 9 taps; the gradient's
# three keep 32 rows, wide trees too: half the rows would add more taps along axis 2 than the
# ring's reads save; benchmarks/results/pocl-features-grad2.json).
HALF_ROWS_VALUES = 16 * 1024


def columns_fits(tree: FusedTree | None) -> bool:
    """Whether kernels/columns.cl runs ``tree`` by default: its ring within
    `MAX_COLUMN_VALUES`."""
    if tree is None:
        return False
    ring = 2 * tree.taps[0] * len(tree.wy) * COLUMN_SHAPE["TY"] * COLUMN_SHAPE["V"]
    return ring <= MAX_COLUMN_VALUES


def column_shape(tree: FusedTree) -> dict[str, int]:
    """`COLUMN_SHAPE` for ``tree``: half the rows along axis 1 where that brings its ring of
    mids within `HALF_ROWS_VALUES` floats."""
    shape = dict(COLUMN_SHAPE)
    ring = 2 * tree.taps[0] * len(tree.wy) * shape["V"]  # floats a row
    if ring * shape["TY"] > HALF_ROWS_VALUES >= ring * (shape["TY"] // 2):
        shape["TY"] //= 2
    return shape


class ColumnKernel:
    """kernels/columns.cl for a plan's tree, with ``epilogue`` (kernels/fused.cl's FEATURES)
    and the first ``n_stored`` responses written; every response without an epilogue. Has
    `volconv.engines.passes.PassTree`'s `launch`, `counts` and `work`."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, plan: SeparablePlan,
                 tree: FusedTree, epilogue: str, n_stored: int, feature_planes: int,
                 clock: KernelClock) -> None:  # fmt: skip
        self.plan, self.queue, self.tree, self.clock = plan, queue, tree, clock
        self.epilogue, self.n_stored, self.feature_planes = epilogue, n_stored, feature_planes
        v, ty, cx = (column_shape(tree)[k] for k in ("V", "TY", "CX"))
        self.v, self.ty, self.cx = v, ty, cx
        defines = (
            *fused_defines(tree, plan.pad_dtype),
            ("V", v), ("EV", v), ("TY", ty), ("CX", cx or 1 << 30),
        )  # fmt: skip
        if epilogue:
            defines += (("FEATURES", epilogue),)
        self._kernel = cl.Kernel(build_with_features(ctx, "columns.cl", defines), "columns")
        self._args: tuple = ()  # the kernel's arguments as last set

    @property
    def counts(self) -> tuple[int, int, int]:
        """The tables' roots, mids and combos."""
        return len(self.tree.wz), len(self.tree.wy), len(self.tree.wx)

    def launch(self, padded: cl.Buffer, out: cl.Buffer, depth: int,
               spans: Sequence[tuple[int, int]] | None = None, feat: cl.Buffer | None = None,
               every: bool = True) -> list[cl.Event]:  # fmt: skip
        """Enqueue the kernel over the padded slab of ``depth`` output rows (or only the
        output rows ``[c0, c0 + rows)`` of each ``(c0, rows)`` of ``spans``): the stored
        responses into ``out`` and the features into ``feat``, or (``every``) every response
        and no feature."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        s0, s1, s2 = self.tree.start
        i32 = np.int32
        n_stored = -1 if every or not self.epilogue else self.n_stored
        events = []
        for c0, rows in spans or [(0, depth)]:
            args = (
                padded, out, out if feat is None else feat, i32(c0), i32(c0 + rows), i32(depth),
                i32(ny), i32(nz), i32(p1), i32(p2), i32(s0), i32(s1), i32(s2), i32(n_stored),
            )  # fmt: skip
            if args != self._args:  # a slab's differ at most in its rows: set once a run
                self._kernel.set_args(*args)
                self._args = args
            chunks = -(-rows // self.cx) if self.cx else 1
            glob = (-(-nz // self.v), -(-ny // self.ty), chunks)
            event = cl.enqueue_nd_range_kernel(self.queue, self._kernel, glob, (1, 1, 1))
            events.append(self.clock.add("columns", event))
        return events

    def work(self, slabs: Iterable[tuple[int, int]]) -> tuple[float, int]:
        """(flop, bytes) over ``slabs``: every work-item's taps over its V x TY columns (the
        rows past the volume's edge included), the padded rows it reads and the planes
        written."""
        plan, tree = self.plan, self.tree
        ny, nz = plan.shape[1:]
        kx, ky, kz = tree.taps
        cols = -(-nz // self.v) * self.v * -(-ny // self.ty)
        per_plane = 2 * cols * (
            kz * len(tree.wz) * (self.ty + ky - 1) + ky * len(tree.wy) * self.ty
        )  # fmt: skip
        per_row = 2 * cols * self.ty * kx * len(tree.wx)
        written = self.n_stored + self.feature_planes if self.epilogue else tree.n_out
        flop, moved = 0.0, 0
        for a, b in slabs:
            depth = b - a
            chunks = -(-depth // self.cx) if self.cx else 1
            planes = depth + chunks * (kx - 1)
            flop += per_plane * planes + per_row * depth
            moved += planes * (ny + ky - 1) * (nz + kz - 1) * plan.pad_dtype.itemsize
            moved += written * depth * ny * nz * 4
        return flop, moved
