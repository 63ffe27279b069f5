"""The separable path's kernels over a padded slab: the pass tree (kernels/separable.cl) and
the fused kernel (kernels/fused.cl), built for a `volconv.plan.separable.SeparablePlan`.

`PassTree` runs, for each distinct axis-2 factor, `pass_fast` over the padded slab; for each
distinct (axis-2, axis-1) pair `pass_mid`; for each distinct term `pass_out`, adding the term
with its coefficient into every response that holds it. `FusedKernel` runs the same tree in
one kernel from tables (`fused_tree`), with the device features as its epilogue. Both count
their work (`work`: flop and bytes over one volume) and report each launch to a
`volconv.engines.clock.KernelClock`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.device.programs import build
from volconv.engines.boundary import halo
from volconv.engines.clock import KernelClock
from volconv.engines.features import build_with_features
from volconv.plan.direct import CL_TYPES

if TYPE_CHECKING:
    from volconv.plan.separable import Choice, SeparablePlan

MID_ROWS = 2  # outputs per work-item along axis 1 in pass_mid


@dataclass
class _Node:
    """One 1D pass: its flipped taps (a weights buffer) and the passes that read its output.

    ``off`` is where its taps start inside the common halo; ``lo`` and ``extra`` bound the
    rows (axis 0; for the roots also axis 1) its output is needed on: ``[lo, lo + n + extra)``.
    """

    k: int
    off: int
    taps: np.ndarray
    children: dict = field(default_factory=dict)
    targets: list = field(default_factory=list)  # leaves: (slot, coef)
    lo: int = 0
    extra: int = 0
    y_lo: int = 0  # roots: rows along axis 1, [y_lo, y_lo + ny + y_n)
    y_n: int = 0
    buf: cl.Buffer | None = None
    target_buf: cl.Buffer | None = None
    coef_buf: cl.Buffer | None = None


def _key(a: np.ndarray) -> tuple[int, bytes]:
    return len(a), np.ascontiguousarray(a[::-1], np.float32).tobytes()


class PassTree:
    """The pass tree of a plan's separable filters (slot order), its kernels and its
    intermediate buffers."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, plan: SeparablePlan,
                 slots: Sequence[int], clock: KernelClock) -> None:  # fmt: skip
        self.plan, self.queue, self.clock = plan, queue, clock
        mf = cl.mem_flags
        lo = plan.halo_lo
        self.roots: dict = {}

        def node(parent: dict, a: np.ndarray, d: int) -> _Node:
            k = len(a)
            key = _key(a)
            if key not in parent:
                off = lo[d] - halo(k)[0]
                parent[key] = _Node(k, off, np.ascontiguousarray(a[::-1], np.float32))
            return parent[key]

        for slot, f in enumerate(slots):
            for t in plan.choices[f].terms:
                a0, a1, a2 = t.axes
                leaf = node(node(node(self.roots, a2, 2).children, a1, 1).children, a0, 0)
                leaf.targets.append((slot, t.coef))
        # the order of launches fixes which term writes a response first
        written: set[int] = set()
        for root in self.roots.values():
            for mid in root.children.values():
                for leaf in mid.children.values():
                    codes = []
                    for slot, _ in leaf.targets:
                        codes.append(slot if slot in written else -1 - slot)
                        written.add(slot)
                    coefs = np.array([c for _, c in leaf.targets], np.float32)
                    leaf.target_buf = cl.Buffer(
                        ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.array(codes, np.int32)
                    )
                    leaf.coef_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=coefs)
        # rows each pass must produce: leaves need [off, off + depth + k - 1) along axis 0
        for root in self.roots.values():
            for mid in root.children.values():
                mid.lo = min(leaf.off for leaf in mid.children.values())
                mid.extra = max(leaf.off + leaf.k - 1 for leaf in mid.children.values()) - mid.lo
            root.lo = min(m.lo for m in root.children.values())
            root.extra = max(m.lo + m.extra for m in root.children.values()) - root.lo
            root.y_lo = min(m.off for m in root.children.values())
            root.y_n = max(m.off + m.k - 1 for m in root.children.values()) - root.y_lo
        for n in self.nodes():
            n.buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=n.taps)
        self._programs: dict[int, dict[str, cl.Kernel]] = {}
        for n in self.nodes():
            if n.k not in self._programs:
                defines = (
                    ("K", n.k), ("V", plan.vector_width), ("U", plan.rows), ("UM", MID_ROWS),
                    ("IN_T", CL_TYPES[plan.pad_dtype]),
                )  # fmt: skip
                prog = build(ctx, "separable.cl", defines)
                self._programs[n.k] = {
                    name: cl.Kernel(prog, name) for name in ("pass_fast", "pass_mid", "pass_out")
                }
        sizes = plan.slab_bytes(plan.slab_depth)
        self._fast = cl.Buffer(ctx, mf.READ_WRITE, sizes["fast"])
        self._mid = cl.Buffer(ctx, mf.READ_WRITE, sizes["mid"])

    def nodes(self) -> Iterator[_Node]:
        for root in self.roots.values():
            yield root
            for mid in root.children.values():
                yield mid
                yield from mid.children.values()

    @property
    def counts(self) -> tuple[int, int, int]:
        """Distinct axis-2 factors, (axis-2, axis-1) pairs and terms."""
        mids = [m for r in self.roots.values() for m in r.children.values()]
        return len(self.roots), len(mids), sum(len(m.children) for m in mids)

    def launch(self, padded: cl.Buffer, out: cl.Buffer, depth: int,
               spans: Sequence[tuple[int, int]] | None = None) -> list[cl.Event]:  # fmt: skip
        """Enqueue the tree over the padded slab of ``depth`` output rows, into ``out``'s
        response planes: every row, or only the output rows ``[c0, c0 + rows)`` of each
        ``(c0, rows)`` of ``spans``."""
        if spans is None:
            block = self.plan.block_rows or depth
            spans = [(c0, min(block, depth - c0)) for c0 in range(0, depth, block)]
        events = []
        for root in self.roots.values():
            for c0, rows in spans:
                events += self._launch_root(root, padded, out, c0, rows, depth)
        return events

    def _launch_root(self, root: _Node, padded: cl.Buffer, out: cl.Buffer, c0: int, rows: int,
                     depth: int) -> list[cl.Event]:  # fmt: skip
        """Enqueue one root's subtree for output rows ``[c0, c0 + rows)`` of the slab."""
        plan, queue, clock = self.plan, self.queue, self.clock
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        r, v, u = plan.row, plan.vector_width, plan.rows
        i32 = np.int32
        knl = self._programs[root.k]["pass_fast"]
        nx, n1 = rows + root.extra, ny + root.y_n
        knl.set_args(
            padded, self._fast, root.buf, i32(root.lo + c0), i32(root.y_lo), i32(nx),
            i32(n1), i32(p1), i32(p2), i32(r), i32(root.off),
        )  # fmt: skip
        glob = (r // v, n1, nx)
        events = [clock.add("pass_fast", cl.enqueue_nd_range_kernel(queue, knl, glob, None))]
        for mid in root.children.values():
            knl = self._programs[mid.k]["pass_mid"]
            nx = rows + mid.extra
            knl.set_args(
                self._fast, self._mid, mid.buf, i32(mid.lo + c0), i32(nx), i32(ny), i32(p1),
                i32(r), i32(mid.off),
            )  # fmt: skip
            glob = (r // v, -(-ny // MID_ROWS), nx)
            events.append(clock.add("pass_mid", cl.enqueue_nd_range_kernel(queue, knl, glob, None)))
            for leaf in mid.children.values():
                knl = self._programs[leaf.k]["pass_out"]
                knl.set_args(
                    self._mid, out, leaf.buf, leaf.target_buf, leaf.coef_buf,
                    i32(len(leaf.targets)), i32(c0), i32(c0 + rows), i32(depth), i32(ny),
                    i32(nz), i32(r), i32(leaf.off),
                )  # fmt: skip
                glob = (-(-nz // v), ny, -(-rows // u))
                event = cl.enqueue_nd_range_kernel(queue, knl, glob, None)
                events.append(clock.add("pass_out", event))
        return events

    def work(self, slabs: Iterable[tuple[int, int]]) -> tuple[float, int]:
        """(flop, bytes) of the passes over ``slabs``: their taps over every output they
        produce (halo rows and the row tail included) and the coefficient multiply-adds; each
        input element counted once per pass."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        r = plan.row
        isz = plan.pad_dtype.itemsize
        flop = 0.0
        moved = 0
        for a, b in slabs:
            depth = b - a
            block = plan.block_rows or depth
            for c0 in range(0, depth, block):
                rows = min(block, depth - c0)
                for root in self.roots.values():
                    outs = (rows + root.extra) * (ny + root.y_n) * r
                    flop += 2 * root.k * outs
                    moved += outs * (isz + 4)
                    for mid in root.children.values():
                        outs = (rows + mid.extra) * ny * r
                        flop += 2 * mid.k * outs
                        moved += (outs + (rows + mid.extra) * (ny + mid.k - 1) * r) * 4
                        for leaf in mid.children.values():
                            outs = rows * ny * nz
                            flop += 2 * (leaf.k + len(leaf.targets)) * outs
                            moved += (rows + leaf.k - 1) * ny * r * 4
                            moved += outs * 4 * (2 * len(leaf.targets) - 1)
        return flop, moved


# -- the fused kernel ----------------------------------------------------------------------


@dataclass(frozen=True)
class FusedTree:
    """The pass tree as kernels/fused.cl reads it: flipped factors zero-padded to each axis's
    window (``taps[d]`` taps from ``start[d]`` of the bank's halo), one row per root (wz),
    mid (wy) and combo (wx: a response's terms through one mid, coefficients folded in)."""

    start: tuple[int, int, int]
    taps: tuple[int, int, int]
    wz: np.ndarray  # (roots, KZ) float32
    wy: np.ndarray  # (mids, KY)
    wx: np.ndarray  # (combos, KX)
    mid_root: tuple[int, ...]
    combo_mid: tuple[int, ...]
    combo_out: tuple[int, ...]
    n_out: int

    @property
    def values(self) -> int:
        """Values a work-item holds across a plane: every response's partial sums at each of
        the KX rows in flight, and the mids' values."""
        return self.n_out * self.taps[0] + len(self.wy)


def fused_tree(choices: Sequence[Choice], halo_lo: tuple[int, int, int]) -> FusedTree | None:
    """The tables of the separable filters of ``choices`` (in slot order), or None if none."""
    terms = [c.terms for c in choices if c.path != "direct"]
    if not terms:
        return None
    # the window along each axis: the widest halo before and after of the factors on it
    extents = [[len(t.axes[d]) for ts in terms for t in ts] for d in range(3)]
    before = [max(halo(k)[0] for k in e) for e in extents]
    after = [max(halo(k)[1] for k in e) for e in extents]
    start = tuple(halo_lo[d] - before[d] for d in range(3))
    taps = tuple(b + a + 1 for b, a in zip(before, after, strict=True))

    def padded(a: np.ndarray, d: int) -> np.ndarray:
        row = np.zeros(taps[d])
        at = halo_lo[d] - halo(len(a))[0] - start[d]
        row[at : at + len(a)] = a[::-1]
        return row

    roots: dict = {}
    mids: dict = {}
    combos: dict = {}
    for slot, ts in enumerate(terms):
        for t in ts:
            a0, a1, a2 = t.axes
            root = roots.setdefault(_key(a2), (len(roots), padded(a2, 2)))[0]
            mid = mids.setdefault((_key(a2), _key(a1)), (len(mids), padded(a1, 1), root))[0]
            row = combos.setdefault((slot, mid), np.zeros(taps[0]))
            row += t.coef * padded(a0, 0)
    f32 = np.float32
    return FusedTree(
        start, taps,
        np.array([w for _, w in roots.values()], f32).reshape(-1, taps[2]),
        np.array([w for _, w, _ in mids.values()], f32).reshape(-1, taps[1]),
        np.array(list(combos.values()), f32).reshape(-1, taps[0]),
        tuple(r for _, _, r in mids.values()),
        tuple(mid for _, mid in combos),
        tuple(slot for slot, _ in combos),
        len(terms),
    )  # fmt: skip


def cl_table(t: object) -> str:
    """Indices, or float32 taps as exact hex literals, comma-separated (a kernel's table)."""
    if isinstance(t, np.ndarray):
        return ",".join(f"{float(w).hex()}f" for w in t.ravel())
    return ",".join(map(str, t))


def fused_defines(tree: FusedTree, pad_dtype: object) -> tuple[tuple[str, object], ...]:
    """Build options of ``tree`` as one kernel's tables (kernels/fused.cl, columns.cl): its
    taps, its roots', mids' and combos' counts and links, their taps, the padded type."""
    return (
        ("KX", tree.taps[0]), ("KY", tree.taps[1]), ("KZ", tree.taps[2]),
        ("N_ROOTS", len(tree.wz)), ("N_MIDS", len(tree.wy)),
        ("N_COMBOS", len(tree.wx)), ("N_OUT", tree.n_out),
        ("MID_ROOT", cl_table(tree.mid_root)), ("COMBO_MID", cl_table(tree.combo_mid)),
        ("COMBO_OUT", cl_table(tree.combo_out)), ("WZ", cl_table(tree.wz)),
        ("WY", cl_table(tree.wy)), ("WX", cl_table(tree.wx)),
        ("IN_T", CL_TYPES[pad_dtype]),
    )  # fmt: skip


# Whether kernels/fused.cl may skip the passes of a plane of a tile whose input is zero (a zero
# background; ZERO_SKIP) per kind of device: on GPUs, for the kernels that feed derived
# features (`FusedKernel`'s zero_skip); on CPUs, which run work-items in SIMD lanes, not. On the
# H100 it took the structure tensor's gradients from 0.30 to 0.20 ms on the demo scan and a
# bank's responses on random data from 0.39 to 0.45 ms
# (benchmarks/results/h100-feature-sweep-11-*.json, h100-separable-fused-flat-*.json).
FUSED_FLAT = {"gpu": True, "cpu": False}


class FusedKernel:
    """kernels/fused.cl built for a plan's tree, with ``epilogue`` (its FEATURES: the device
    features, reading responses by slot) and the first ``n_stored`` responses written; every
    response when there is no epilogue; ``zero_skip``: the planes of a zero background skipped
    where the device's kind may (`FUSED_FLAT`)."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, plan: SeparablePlan,
                 tree: FusedTree, epilogue: str, n_stored: int, feature_planes: int,
                 clock: KernelClock, zero_skip: bool = False) -> None:  # fmt: skip
        self.plan, self.queue, self.tree, self.clock = plan, queue, tree, clock
        self.epilogue, self.n_stored, self.feature_planes = epilogue, n_stored, feature_planes

        defines = (
            *fused_defines(tree, plan.pad_dtype),
            ("TY", plan.tile[0]), ("TZ", plan.tile[1]), ("CX", plan.tile[2]),
            ("ZERO_SKIP", int(zero_skip and FUSED_FLAT[
                "cpu" if ctx.devices[0].type & cl.device_type.CPU else "gpu"])),
        )  # fmt: skip
        if epilogue:
            defines += (("FEATURES", epilogue),)
        self._kernel = cl.Kernel(build_with_features(ctx, "fused.cl", defines), "fused")

    @property
    def counts(self) -> tuple[int, int, int]:
        """The tables' roots, mids and combos."""
        return len(self.tree.wz), len(self.tree.wy), len(self.tree.wx)

    def launch(self, padded: cl.Buffer, out: cl.Buffer, feat: cl.Buffer, depth: int,
               every: bool) -> cl.Event:  # fmt: skip
        """Enqueue the kernel over the padded slab of ``depth`` output rows: the stored
        responses into ``out`` and the features into ``feat``, or (``every``) every response
        and no feature."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        ty, tz, cx = plan.tile
        i32 = np.int32
        s0, s1, s2 = self.tree.start
        n_stored = -1 if every or not self.epilogue else self.n_stored
        self._kernel.set_args(
            padded, out, feat, i32(depth), i32(ny), i32(nz), i32(p1), i32(p2), i32(s0), i32(s1),
            i32(s2), i32(n_stored),
        )  # fmt: skip
        glob = (-(-nz // tz) * tz, -(-ny // ty) * ty, -(-depth // cx))
        event = cl.enqueue_nd_range_kernel(self.queue, self._kernel, glob, (tz, ty, 1))
        return self.clock.add("fused", event)

    def work(self, slabs: Iterable[tuple[int, int]]) -> tuple[float, int]:
        """(flop, bytes) over ``slabs``: every work-group's taps over its whole tile (edge
        tiles included), the padded rows each chunk reads and the planes written."""
        plan, tree = self.plan, self.tree
        ny, nz = plan.shape[1:]
        ty, tz, cx = plan.tile
        kx, ky, kz = tree.taps
        tiles = -(-ny // ty) * -(-nz // tz)
        per_plane = 2 * tiles * (
            kz * len(tree.wz) * (ty + ky - 1) * tz + ky * len(tree.wy) * ty * tz
            + kx * len(tree.wx) * ty * tz
        )  # fmt: skip
        written = self.n_stored + self.feature_planes if self.epilogue else tree.n_out
        flop, moved = 0.0, 0
        for a, b in slabs:
            for x0 in range(0, b - a, cx):
                planes = min(cx, b - a - x0) + kx - 1
                flop += per_plane * planes
                moved += planes * (ny + ky - 1) * (nz + kz - 1) * plan.pad_dtype.itemsize
            moved += written * (b - a) * ny * nz * 4
        return flop, moved
