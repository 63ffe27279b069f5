"""The skimage preset's first stage (`NearestGaussians`): each scale's Gaussian in mode
'nearest' over the rows a slab's stencils read, by kernels/smoothing.cl's 1D passes, with the
rows smoothed along axes 2 and 1 kept on the device between slabs, so that consecutive slabs
smooth each row along those axes once, however far a scale's Gaussian overhangs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyopencl as cl

from volconv.bank.features import radius
from volconv.bank.kernels import gaussian_kernel1d
from volconv.device.programs import build
from volconv.engines.clock import KernelClock
from volconv.plan.direct import CL_TYPES

OUT_PER_ITEM = 16  # outputs per work-item along smooth_y's axis (M)
X_PER_ITEM = 17  # ... along smooth_x's at most (MX: the field's rows in blocks of equal size)
ROW_PER_ITEM = 8  # ... along smooth_z's (MZ)
UNROLL: bool | None = None  # the tap loops fully unrolled (None: on GPUs, not on CPUs)
TAP_CHUNK = 16  # smooth_y's taps in rolled chunks of this many (0: no) ...
CHUNK_FROM = 64  # ... at radii from this one (the shorter ones unrolled whole)
ROW_GROUP = 32  # smooth_z's work-group (WG): a segment of ROW_GROUP * MZ outputs of a row
ROW_LINES = 8  # ... and its rows of axis 1 (LINES)
LINE_GROUP = 32  # smooth_y's and smooth_x's work-groups along axis 2
BLOCKS = 8  # ... and along their pass's axis: blocks of M outputs whose windows overlap, so
# that what one loads the others find in the same multiprocessor's cache


def ring_rows(radii: Sequence[int], n0: int, rows: int) -> list[int]:
    """Each scale's ring: the field's ``rows`` and its radius on each side (at most n0), up to
    a power of two (a row's slot is a mask of its index)."""
    return [1 << (min(n0, rows + 2 * r) - 1).bit_length() for r in radii]


def nearest_gaussians_bytes(
    radii: Sequence[int], shape: tuple[int, int, int], dtype: np.dtype, rows: int
) -> int:
    """Device memory of `NearestGaussians` whose field holds ``rows`` rows: the rings, the
    field, the rows smoothed along axis 2 and the input rows uploaded."""
    n0, ny, nz = shape
    caps = ring_rows(radii, n0, rows)
    most = min(n0, rows + 2 * max(radii))  # rows smoothed at once, at most
    item = np.dtype(dtype).itemsize if np.dtype(dtype) in CL_TYPES else 4
    return (4 * (sum(caps) + len(radii) * min(n0, rows) + most) + item * most) * ny * nz


class NearestGaussians:
    """The Gaussians of ``sigmas`` (at ``truncate``, mode 'nearest') of a volume of ``shape``
    over field rows ``[g0, g1)`` (at most ``rows`` of them): `smooth` leaves scale ``s``'s in
    plane ``s`` of ``field`` (``rows`` rows each; row g0 first).

    Rows smoothed along axes 2 and 1 stay in a ring per scale (row r at slot r % its size). A
    row is reused only while the input rows seen since it was smoothed are the same (the host
    keeps the last call's input rows and compares them), so that another volume of the same
    shape (a 4D input's next frame) or a slab out of order smooths afresh."""

    def __init__(
        self, ctx: cl.Context, queue: cl.CommandQueue, sigmas: Sequence[float], truncate: float,
        shape: tuple[int, int, int], dtype: np.dtype, rows: int, clock: KernelClock,
        per_item: int | None = None,
    ) -> None:  # fmt: skip
        """``per_item``: outputs per work-item along a pass's axis (default `OUT_PER_ITEM` and
        `ROW_PER_ITEM` on GPUs, 1 on CPUs)."""
        self.ctx, self.queue, self.clock = ctx, queue, clock
        self.shape, self.rows = tuple(shape), min(rows, shape[0])
        n0, ny, nz = self.shape
        self.radii = [radius(s, truncate) for s in sigmas]
        self.caps = ring_rows(self.radii, n0, self.rows)
        dtype = np.dtype(dtype)
        self.up_dtype = dtype if dtype in CL_TYPES else np.dtype(np.float32)
        device = ctx.devices[0]
        unroll = not device.type & cl.device_type.CPU if UNROLL is None else UNROLL
        # CPUs: one output per work-item, so that the tap loop is the same for every item
        self.m = per_item or (OUT_PER_ITEM if unroll else 1)
        blocks = -(-self.rows // X_PER_ITEM)  # smooth_x's blocks of the field's rows
        self.mx = per_item or (-(-self.rows // blocks) if unroll else 1)
        self.mz = per_item or (ROW_PER_ITEM if unroll else 1)
        self._k = []
        for s, r in zip(sigmas, self.radii, strict=True):
            w = gaussian_kernel1d(s, 0, r).astype(np.float32)
            defines = (("R", r), ("WEIGHTS", ",".join(f"{float(x):.9e}f" for x in w)),
                       ("M", self.m), ("MX", self.mx), ("MZ", self.mz), ("WG", ROW_GROUP),
                       ("LINES", ROW_LINES), ("IN_T", CL_TYPES[self.up_dtype]))  # fmt: skip
            if unroll:
                defines += (("UNROLL_TAPS", 1),)
            if TAP_CHUNK and r >= CHUNK_FROM:
                defines += (("TAP_CHUNK", TAP_CHUNK),)
            prog = build(ctx, "smoothing.cl", defines)
            self._k.append({n: cl.Kernel(prog, n) for n in ("smooth_z", "smooth_y", "smooth_x")})
        mf, plane = cl.mem_flags, ny * nz
        self.rings = [cl.Buffer(ctx, mf.READ_WRITE, c * plane * 4) for c in self.caps]
        # every scale's field: scale s at plane s (of `rows` rows)
        self.field = cl.Buffer(ctx, mf.READ_WRITE, len(sigmas) * self.rows * plane * 4)
        top = min(n0, self.rows + 2 * max(self.radii))
        self._t = cl.Buffer(ctx, mf.READ_WRITE, top * plane * 4)
        self._up = cl.Buffer(ctx, mf.READ_ONLY, top * plane * self.up_dtype.itemsize)
        self._valid: list[tuple[int, int] | None] = [None] * len(sigmas)
        self._host: np.ndarray | None = None  # the last call's input rows
        self._host_lo = 0

    @property
    def device_bytes(self) -> int:
        return nearest_gaussians_bytes(self.radii, self.shape, self.up_dtype, self.rows)

    def input_rows(self, g0: int, g1: int) -> tuple[int, int]:
        """The input rows field rows ``[g0, g1)`` read."""
        r = max(self.radii)
        return max(0, g0 - r), min(self.shape[0], g1 + r)

    def smooth(
        self, g0: int, g1: int, rows_of: Callable[[int, int], np.ndarray]
    ) -> tuple[list[cl.Event], list[cl.Event]]:
        """Every scale's field rows ``[g0, g1)``; ``rows_of(lo, hi)`` gives the input's rows
        ``[lo, hi)`` (`input_rows`). Returns the upload's events and the kernels'."""
        n0, ny, nz = self.shape
        lo, hi = self.input_rows(g0, g1)
        cur = np.ascontiguousarray(rows_of(lo, hi), self.up_dtype)
        if self._host is not None:  # the rows kept stay valid where the input is the same
            h0, h1 = self._host_lo, self._host_lo + len(self._host)
            o0, o1 = max(h0, lo), min(h1, hi)
            same = o0 < o1 and np.array_equal(self._host[o0 - h0 : o1 - h0], cur[o0 - lo : o1 - lo])
            if not same:
                self._valid = [None] * len(self._valid)
        todo = []
        for s, r in enumerate(self.radii):
            u0, u1 = max(0, g0 - r), min(n0, g1 + r)
            kept = self._valid[s]
            # rows past [u0, u1) are let go: those kept are always among the input rows kept
            c0, c1 = (kept[1], max(kept[1], u1)) if kept and kept[0] <= u0 <= kept[1] else (u0, u1)
            self._valid[s] = (u0, u1)
            todo.append((c0, c1))
        self._host, self._host_lo = cur, lo
        spans = [(c0, c1) for c0, c1 in todo if c1 > c0]
        events: list[cl.Event] = []
        work: list[cl.Event] = []
        i32 = np.int32
        if spans:
            a0, a1 = min(c0 for c0, _ in spans), max(c1 for _, c1 in spans)
            events.append(cl.enqueue_copy(self.queue, self._up, cur[a0 - lo : a1 - lo],
                                          is_blocking=False))  # fmt: skip
        seg, m = ROW_GROUP * self.mz, self.m
        zs = -(-nz // LINE_GROUP) * LINE_GROUP

        def blocks(n: int, m: int) -> tuple[int, int]:
            """Work-items along a pass's axis for n outputs (m each), and the group's."""
            nb = -(-n // m)
            group = min(BLOCKS, nb)
            return -(-nb // group) * group, group

        for s, (c0, c1) in enumerate(todo):
            k = self._k[s]
            if c1 > c0:
                k["smooth_z"].set_args(self._up, i32(c0 - a0), i32(ny), i32(nz), self._t)
                k["smooth_y"].set_args(self._t, i32(c0), i32(ny), i32(nz), i32(self.caps[s]),
                                       self.rings[s])  # fmt: skip
                size = (-(-nz // seg) * ROW_GROUP, -(-ny // ROW_LINES) * ROW_LINES, c1 - c0)
                work.append(self.clock.add("smooth_z", cl.enqueue_nd_range_kernel(
                    self.queue, k["smooth_z"], size, (ROW_GROUP, ROW_LINES, 1))))  # fmt: skip
                ys, group = blocks(ny, m)
                work.append(self.clock.add("smooth_y", cl.enqueue_nd_range_kernel(
                    self.queue, k["smooth_y"], (zs, ys, c1 - c0),
                    (LINE_GROUP, group, 1))))  # fmt: skip
            k["smooth_x"].set_args(self.rings[s], i32(self.caps[s]), i32(g0), i32(g1 - g0),
                                   i32(n0), i32(ny), i32(nz), self.field,
                                   np.int64(s * self.rows * ny * nz))  # fmt: skip
            xs, group = blocks(g1 - g0, self.mx)
            work.append(self.clock.add("smooth_x", cl.enqueue_nd_range_kernel(
                self.queue, k["smooth_x"], (zs, ny, xs), (LINE_GROUP, 1, group))))  # fmt: skip
        return events, work
