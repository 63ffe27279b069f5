"""The presets on the device, two stages per scale (`PresetStage`): one Gaussian smoothing of
the input per scale (skimage: `volconv.engines.smoothing.NearestGaussians` on GPUs,
`volconv.engines.gaussians.RowGaussians` on CPUs; ilastik: the separable passes), then the
kernels that write all of that scale's channels from the smoothed field (kernels/stencils.cl
on GPUs; on CPUs, in vectors along axis 2, kernels/skimage_rows.cl and ilastik_rows.cl)."""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl

from volconv.bank.presets import PresetPlan, skimage_scale
from volconv.device.programs import context_for, device_seconds
from volconv.engines.boundary import extend_indices, sources
from volconv.engines.clock import KernelClock
from volconv.engines.features import build_with_features, lanes_for
from volconv.engines.gaussians import RowGaussians
from volconv.engines.nonfinite import has_nonfinite
from volconv.engines.preset_memory import (
    SLACK,
    SUB_ROWS,
    buffer_bytes,
    reach,
    skimage_smoother,
    smoothing_filters,
)
from volconv.engines.smoothing import NearestGaussians

TILE = (32, 4, 2)  # stage 2's work-groups on GPUs (axes 2, 1, 0)
SKIMAGE_ROWS = 16  # skimage_tile's and skimage_scale's rows per work-item (VX), at most
SKIMAGE_TILE: tuple[int, int] | None = (32, 8)  # skimage_tile's group (TZ, TY); None: skimage_scale
ROW_LANES = 16  # skimage_rows' voxels per work-item along axis 2 (two float8 blocks; its EV)
XYZ_GROUP = (32, 8, 1)  # ilastik_xyz's work-groups (its local memory: 32 is its LZ)


def stencil_program(
    ctx: cl.Context, radii: tuple[int, int, int] = (2, 1, 1), flat: bool = False,
    rows: int | None = None,
) -> cl.Program:  # fmt: skip
    """kernels/stencils.cl behind kernels/eigen.cl (its eigen_sym3 and magnitude3), the ilastik
    kernels built for the radii (inner, DoG's second, outer) of one scale and work-groups of
    `XYZ_GROUP`; ``flat``: eigen_sym3 takes diagonal matrices (skimage's flat regions: a zero
    background) by a branch (EIG_FLAT); ``rows``: skimage's rows per work-item (default
    `SKIMAGE_ROWS`)."""
    defines = (*zip(("R", "RD", "RO"), radii, strict=True), ("LY", XYZ_GROUP[1]),
               ("VX", SKIMAGE_ROWS if rows is None else rows))  # fmt: skip
    if SKIMAGE_TILE:
        defines += (("TZ", SKIMAGE_TILE[0]), ("TY", SKIMAGE_TILE[1]))
    if flat:
        defines += (("EIG_FLAT", 1),)
    return build_with_features(ctx, "stencils.cl", defines)


class PresetStage:
    """A preset's outputs for a slab of output rows, in its order (`PresetPlan`).

    Stage 1 smooths the input by every scale's Gaussian, kept on the device; stage 2 runs
    per scale over sub-slabs of at most `SUB_ROWS` rows (its outputs' buffer), each downloaded
    into ``out``.

    skimage: the Gaussians take mode 'nearest' (skimage.filters.gaussian), over the slab's rows
    and 2 more on each side inside the volume (Sobel's 'reflect' and np.gradient's one-sided
    differences stay inside it): on GPUs by `NearestGaussians` (the rows smoothed along axes 2
    and 1 kept for the next slab), on CPUs by `RowGaussians`; one kernel per scale writes its
    five channels. Slabs with NaN or Inf are refused.

    ilastik: one `SeparableConvolver` (forced separable, the scales' Gaussians as its filters)
    over the rows stage 2 reads, in chunks of at most its slab depth. The presmoothing takes
    the bank's mode and cval; stage 2 reads it over the rows the bank's mode maps the slab's,
    widened by the inner radius (2) and the structure tensor's outer one (1), through row
    tables: ilastik_xyz (the passes along axes 0, 1 and 2 through local memory) gives the
    smoothing, DoG's second one, the gradients and the Hessian over the rows the outer
    smoothing reads and writes the structure tensor's products and every channel but its
    eigenvalues, which ilastik_outer_xy and ilastik_outer write (CPUs: kernels/ilastik_rows.cl's
    ilastik_yz and ilastik_st, the same sums in vectors along axis 2). A slab whose source holds NaN
    or Inf is smoothed through the convolver's host path (scipy's non-finite responses),
    uploaded, and goes through the same stage 2, whose sums take every tap as scipy's
    correlate1d does (0 * Inf is NaN there too).
    """

    def __init__(
        self,
        preset: PresetPlan,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str,
        cval: float,
        device: cl.Device,
        slab_depth: int,
    ) -> None:
        from volconv.engines.separable import SeparableConvolver
        from volconv.plan.separable import plan_bank

        self.preset, self.shape, self.dtype = preset, tuple(shape), np.dtype(dtype)
        self.device = device
        self.skimage = preset.kind == "skimage"
        self.mode = "nearest" if self.skimage else mode
        self.cval = 0.0 if self.skimage else float(cval)
        self.reach = reach(preset)
        self.depth = slab_depth
        self.sub = min(slab_depth, SUB_ROWS)
        self.seconds = 0.0
        self.clock = KernelClock()  # the stencils' (and skimage's stage 1's) seconds by name
        self.timings = {"upload": 0.0, "download": 0.0}  # skimage's
        if self.skimage:
            self.conv = None
            self.ctx, self.queue = context_for(device)
            sigmas, truncate = [s.smooth for s in preset.scales], preset.scales[0].truncate
            field = min(shape[0], slab_depth + 2 * self.reach)
            if skimage_smoother(device) is RowGaussians:
                self.smoother = RowGaussians(self.ctx, self.queue, sigmas, truncate, shape,
                                             field, self.clock)  # fmt: skip
            else:
                self.smoother = NearestGaussians(self.ctx, self.queue, sigmas, truncate, shape,
                                                 dtype, field, self.clock)  # fmt: skip
            self.convolvers = (self,)
        else:
            filters = smoothing_filters(preset)
            self.conv = SeparableConvolver(
                filters, shape, dtype, self.mode, self.cval, device=device,
                slab_depth=min(shape[0], slab_depth + 2 * self.reach),
                choices=plan_bank(filters, force="separable"), fused=False,
            )  # fmt: skip
            self.convolvers = (self.conv,)
            self.ctx, self.queue = self.conv.ctx, self.conv.queue
        # CPUs: stage 2 in vectors along axis 2 (kernels/skimage_rows.cl, ilastik_rows.cl)
        self._vectors = lanes_for(device) > 1
        if self.skimage and self._vectors:
            prog = build_with_features(self.ctx, "skimage_rows.cl", (("EV", ROW_LANES),))
            self._k = [cl.Kernel(prog, "skimage_rows")]
        elif self.skimage:
            name = "skimage_tile" if SKIMAGE_TILE else "skimage_scale"
            tz, ty = SKIMAGE_TILE or (0, 0)
            self._vx = SKIMAGE_ROWS  # halved until skimage_tile's tile fits local memory
            while self._vx > 1 and (self._vx + 4) * (tz + 4) * (ty + 4) * 4 > device.local_mem_size:
                self._vx //= 2
            prog = stencil_program(self.ctx, flat=True, rows=self._vx)
            self._k = [cl.Kernel(prog, name)]
        else:
            self._k = []
            for scale in preset.scales:
                if self._vectors:
                    radii = (*zip(("R", "RD", "RO"), scale.radii(), strict=True), ("EV", 8))
                    prog = build_with_features(self.ctx, "ilastik_rows.cl", radii)
                    names = ("ilastik_yz", "ilastik_st")
                else:
                    prog = stencil_program(self.ctx, scale.radii(), rows=4)  # VX: unused
                    names = ("ilastik_xyz", "ilastik_outer_xy", "ilastik_outer")
                self._k.append(tuple(cl.Kernel(prog, name) for name in names))
            maps = [extend_indices(n, -2, n + 2, self.mode).astype(np.int32) for n in shape[1:]]
            self._maps = [cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                    hostbuf=m) for m in maps]  # fmt: skip
        self._group = min(32, device.max_work_group_size)
        # GPUs: work-groups of TILE; CPUs (PoCL runs a group's items as loops along axis 2)
        # and small groups: rows of axis 2
        self._tiles = not device.type & cl.device_type.CPU and (
            device.max_work_group_size >= TILE[0] * TILE[1] * TILE[2]
        )
        # its `volconv.engines.clock.KernelClock`s: stage 1's, the stencils'
        self.clocks = [self.clock] if self.conv is None else [self.conv.clock, self.clock]
        self._smooth: cl.Buffer | None = None  # stage 1 over the rows stage 2 reads
        self._passes: dict[str, cl.Buffer] = {}  # stage 2's passes' planes
        self._dst: cl.Buffer | None = None  # the preset's planes of a slab
        self._tables: dict = {}  # skimage's stage 2: tables of each scale's planes
        mf = cl.mem_flags
        self._taps = (
            []
            if self.skimage
            else [
                cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=s.taps())
                for s in preset.scales
            ]
        )
        self.clip = self.skimage and self.dtype.kind == "i"  # img_as_float32: min -> -1
        self.factor = np.float32(skimage_scale(self.dtype) if self.skimage else 1.0)

    @property
    def device_bytes(self) -> int:
        """Device memory of the stage at its slab depth
        (`volconv.engines.preset_memory.preset_bytes`)."""
        first = self.smoother.device_bytes if self.conv is None else self.conv.plan.device_bytes
        return first + buffer_bytes(self.preset, self.shape, self.depth, self.device)

    @property
    def held_bytes(self) -> int:
        """Device memory the stage holds (as a structure tensor's stage says it)."""
        return self.device_bytes

    @property
    def executed_gflop(self) -> float:
        """GFLOP of its first stage for one volume, each scale's smoothing (the stencils of
        stage 2 uncounted)."""
        return 2.0 * math.prod(self.shape) * self.preset.smoothing_taps() / 1e9

    # -- rows -------------------------------------------------------------------------------
    def _rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows of stage 1 that stage 2 reads for output rows ``[a, b)``, and (ilastik) the
        rows of the structure tensor's product field."""
        n0 = self.shape[0]
        if self.skimage:
            return np.arange(max(0, a - 2), min(n0, b + 2)), np.arange(0)
        q = sources(extend_indices(n0, a - 1, b + 1, self.mode))
        near = (q[:, None] + np.arange(-2, 3)[None, :]).ravel()
        lo = int(near.min())
        folded = extend_indices(n0, lo, int(near.max()) + 1, self.mode)[near - lo]
        return sources(folded), q

    def _chunks(self, rows: np.ndarray) -> list[tuple[int, int]]:
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        out = []
        for run in np.split(rows, breaks):
            r0, r1 = int(run[0]), int(run[-1]) + 1
            step = self.conv.plan.slab_depth
            out += [(c, min(c + step, r1)) for c in range(r0, r1, step)]
        return out

    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows of the volume that output rows ``[a, b)`` read."""
        rows, _ = self._rows(a, b)
        if self.skimage:
            return np.arange(*self.smoother.input_rows(int(rows[0]), int(rows[-1]) + 1))
        parts = [self.conv.source_rows(c0, c1) for c0, c1 in self._chunks(rows)]
        return sources(np.concatenate(parts))

    def _table(self, targets: np.ndarray, local: np.ndarray, reach: int) -> np.ndarray:
        """For each row of ``targets``, the local index in ``local`` of its neighbours at
        -reach .. reach, extended by the mode (-1: cval)."""
        n0 = self.shape[0]
        out = np.empty((len(targets), 2 * reach + 1), np.int32)
        for i, t in enumerate(targets):
            m = extend_indices(n0, int(t) - reach, int(t) + reach + 1, self.mode)
            out[i] = np.where(m >= 0, np.searchsorted(local, m), -1)
        return out

    # -- a slab -----------------------------------------------------------------------------
    fills_out = True  # `compute` takes ``out`` and downloads into it

    def compute(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None, out: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """The preset's outputs (n_outputs, b - a, ny, nz) float32 of output rows ``[a, b)``,
        from the volume's ``rows`` at ``needed`` (sorted, covering `source_rows`) or its whole
        ``frame``; downloaded into ``out`` if given (float32, each plane contiguous)."""
        if self.skimage:
            return self._compute_skimage(a, b, rows, needed, frame, out)
        conv, queue, mf = self.conv, self.queue, cl.mem_flags
        ny, nz = self.shape[1:]
        plane = ny * nz
        depth, k = b - a, len(self.preset.scales)
        srows, _ = self._rows(a, b)
        ns = len(srows)
        chunks = self._chunks(srows)
        host = rows is not None and has_nonfinite(rows)
        events: list[cl.Event] = []  # stage 1's uploads and pads, copies
        work: list[cl.Event] = []  # the passes and the stencils
        if len(chunks) == 1 and not host:  # stage 1's responses are the field: no copy
            smooth = None
        else:
            if self._smooth is None or self._smooth.size < k * ns * plane * 4:
                self._smooth = cl.Buffer(self.ctx, mf.READ_WRITE, k * ns * plane * 4)
            smooth = self._smooth
        at = 0
        for c0, c1 in chunks:
            own = None if rows is None else rows[np.searchsorted(needed, conv.source_rows(c0, c1))]
            n = (c1 - c0) * plane
            if host:
                field = np.ascontiguousarray(conv.convolve_slab(c0, c1, rows=own), np.float32)
                for s in range(k):
                    events.append(cl.enqueue_copy(queue, smooth, field[s],
                                                  dst_offset=(s * ns + at) * plane * 4,
                                                  is_blocking=False))  # fmt: skip
                cl.wait_for_events(events[-k:])
            else:
                given = {"frame": frame} if own is None else {"rows": own}
                up, pad = conv.padder(c0, c1, conv._padded, **given)
                events += [*up, pad]
                work += conv._launch_passes(c1 - c0)
                if smooth is not None:
                    for s in range(k):
                        slot = conv._slots.index(s)
                        events.append(cl.enqueue_copy(
                            queue, smooth, conv._out, byte_count=n * 4, src_offset=slot * n * 4,
                            dst_offset=(s * ns + at) * plane * 4))  # fmt: skip
            at += c1 - c0
        field = conv._out if smooth is None else smooth
        slots = conv._slots if smooth is None else list(range(k))
        n_out = self.preset.n_outputs
        if self._dst is None:
            self._dst = cl.Buffer(self.ctx, mf.READ_WRITE, n_out * self.sub * plane * 4)
        values = np.empty((n_out, depth, ny, nz), np.float32) if out is None else out
        downloads: list[cl.Event] = []
        for a2 in range(a, b, self.sub):  # stage 2 by sub-slabs: its outputs' memory bounded
            b2 = min(a2 + self.sub, b)
            n = (b2 - a2) * plane
            qrows = sources(extend_indices(self.shape[0], a2 - 1, b2 + 1, self.mode))
            work += self._ilastik(a2, b2, field, slots, srows, qrows)
            for o in range(n_out):  # in order after the kernels
                downloads.append(cl.enqueue_copy(
                    queue, values[o, a2 - a : b2 - a], self._dst, src_offset=o * n * 4,
                    is_blocking=False))  # fmt: skip
        cl.wait_for_events(events + work + downloads)
        self.seconds += device_seconds(work)
        conv.timings["upload"] += device_seconds(events)  # with the copies of stage 1's field
        conv.timings["download"] += device_seconds(downloads)
        return values

    def _compute_skimage(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None, out: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        """`compute` for skimage: stage 1 by its smoother (`skimage_smoother`), then stage 2 per
        sub-slab."""
        n0, ny, nz = self.shape
        g0, g1 = max(0, a - 2), min(n0, b + 2)

        def rows_of(lo: int, hi: int) -> np.ndarray:
            own = frame[lo:hi] if rows is None else rows[np.searchsorted(needed, np.arange(lo, hi))]
            if has_nonfinite(own):
                raise ValueError(
                    f"non-finite voxels (NaN, Inf) in rows [{a}, {b}): the skimage preset does "
                    "not take them (replace the non-finite voxels first)"
                )
            if self.clip:  # img_as_float32: the minimum maps to -1
                own = np.maximum(own, -np.iinfo(self.dtype).max).astype(self.dtype)
            return own

        events, work = self.smoother.smooth(g0, g1, rows_of)
        if self._dst is None:
            self._dst = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE,
                                  self.preset.n_outputs * self.sub * ny * nz * 4)  # fmt: skip
        shape = (self.preset.n_outputs, b - a, ny, nz)
        values = np.empty(shape, np.float32) if out is None else out
        downloads: list[cl.Event] = []
        for a2 in range(a, b, self.sub):
            b2 = min(a2 + self.sub, b)
            n = (b2 - a2) * ny * nz
            sm = self.smoother
            work += self._skimage(a2, b2, sm.field, list(range(len(sm.radii))), g0, sm.rows)
            for o in range(self.preset.n_outputs):  # in order after the kernels
                downloads.append(cl.enqueue_copy(
                    self.queue, values[o, a2 - a : b2 - a], self._dst, src_offset=o * n * 4,
                    is_blocking=False))  # fmt: skip
        cl.wait_for_events(events + work + downloads)
        self.seconds += device_seconds(work)
        self.timings["upload"] += device_seconds(events)
        self.timings["download"] += device_seconds(downloads)
        return values

    def _skimage(
        self, a: int, b: int, field: cl.Buffer, planes: list[int], r0: int, nr: int
    ) -> list[cl.Event]:
        """Enqueue skimage's stage 2 over output rows ``[a, b)`` of every scale, scale s's field
        (rows from ``r0``) at plane ``planes[s]`` of ``field`` (``nr`` rows each)."""
        n0, ny, nz = self.shape
        n, k = (b - a) * ny * nz, len(planes)
        key = tuple(planes)
        if key not in self._tables:  # each scale's field plane and first output plane
            mf = cl.mem_flags
            at = [s.at[0] for s in self.preset.scales]
            self._tables[key] = [cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR,
                                           hostbuf=np.array(t, np.int32))
                                 for t in (planes, at)]  # fmt: skip
        gps, os_ = self._tables[key]
        (kernel,) = self._k
        i32 = np.int32
        args = [field, gps, i32(nr), i32(r0), i32(a), i32(n0), i32(ny), i32(nz), i32(b - a),
                i32(k), self.factor, self._dst, np.int64(n), os_]  # fmt: skip
        if self._vectors:  # skimage_rows: ROW_LANES voxels along axis 2 a work-item
            nb = -(-nz // ROW_LANES)
            size, local = (nb, ny, k * (b - a)), (min(nb, 8), 1, 1)
        else:  # skimage_tile (a work-group a tile) or skimage_scale (`_launch_tiles`)
            args.append(self._entries())
            size = (nz, ny, k * -(-(b - a) // self._vx))
            local = (*SKIMAGE_TILE, 1) if SKIMAGE_TILE else None
        kernel.set_args(*args)
        if local is None:
            return [self.clock.add(kernel.function_name, self._launch_tiles(kernel, size))]
        glob = tuple(-(-m // g) * g for m, g in zip(size, local, strict=True))
        event = cl.enqueue_nd_range_kernel(self.queue, kernel, glob, local)
        return [self.clock.add(kernel.function_name, event)]

    def _launch_tiles(self, kernel: cl.Kernel, size: tuple[int, int, int]) -> cl.Event:
        """Work-groups of `TILE` (the kernel checks its bounds): neighbours along axes 1 and 0
        in one group, so that the voxels they share are read from cache."""
        tile = TILE if self._tiles else (self._group, 1, 1)
        glob = tuple(-(-n // t) * t for n, t in zip(size, tile, strict=True))
        return cl.enqueue_nd_range_kernel(self.queue, kernel, glob, tile)

    def _entries(self) -> cl.Buffer:
        """The stencils' argument for the eigenvalues' entries (kernels/stencils.cl's E, which
        GPUs do not write): one float."""
        if "e" not in self._passes:
            self._passes["e"] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 4)
        return self._passes["e"]

    def _ilastik(
        self, a: int, b: int, field: cl.Buffer, slots: list[int], srows: np.ndarray,
        qrows: np.ndarray,
    ) -> list[cl.Event]:  # fmt: skip
        """Enqueue ilastik's stage 2 for every scale: the passes over the product rows
        ``qrows``, then the channels of output rows ``[a, b)``."""
        mf, ctx = cl.mem_flags, self.ctx
        ny, nz = self.shape[1:]
        depth, nq, ns = b - a, len(qrows), len(srows)
        tables = [self._table(qrows, srows, 2), self._table(np.arange(a, b), qrows, 1)]
        qout = np.full(nq, -1, np.int32)
        qout[tables[1][:, 1]] = np.arange(depth)  # each output row's own row among qrows
        rows, grows, qo = (cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=t)
                           for t in (*tables, qout))  # fmt: skip
        sizes = {"t": 6 * nq * ny * nz}
        sizes["v" if not self._vectors else "c"] = (
            6 * depth * ny * nz + 2 * SLACK if not self._vectors else nz
        )
        for key, size in sizes.items():
            if key not in self._passes or self._passes[key].size < size * 4:
                self._passes[key] = cl.Buffer(ctx, mf.READ_WRITE, size * 4)
        if self._vectors:
            return self._ilastik_rows(a, b, field, slots, srows, qrows, rows, grows, qo)
        bt, bv = self._passes["t"], self._passes["v"]
        i32, cval = np.int32, np.float32(self.cval)
        my, mz = self._maps
        n = np.int64(depth * ny * nz)
        events = []
        for s, scale in enumerate(self.preset.scales):
            kxyz, kxo, ko = self._k[s]
            taps = self._taps[s]
            os_, ol, om, od, ot, oh = map(i32, scale.at)
            entries = self._entries()
            kxyz.set_args(field, i32(slots.index(s)), i32(ns), rows, i32(nq), taps, my, mz, qo,
                          i32(ny), i32(nz), cval, bt, self._dst, n, os_, ol, om, od, oh,
                          entries)  # fmt: skip
            kxo.set_args(bt, i32(nq), grows, taps, my, i32(depth), i32(ny), i32(nz), cval, bv)
            ko.set_args(bv, taps, mz, i32(depth), i32(ny), i32(nz), cval, self._dst, n, ot,
                        entries)  # fmt: skip
            glob = tuple(-(-m // g) * g for m, g in zip((nz, ny, nq), XYZ_GROUP, strict=True))
            events.append(self.clock.add("ilastik_xyz", cl.enqueue_nd_range_kernel(
                self.queue, kxyz, glob, XYZ_GROUP)))  # fmt: skip
            for name, k in (("ilastik_outer_xy", kxo), ("ilastik_outer", ko)):
                events.append(self.clock.add(name, self._launch_tiles(k, (nz, ny, depth))))
        return events

    def _ilastik_rows(
        self, a: int, b: int, field: cl.Buffer, slots: list[int], srows: np.ndarray,
        qrows: np.ndarray, rows: cl.Buffer, grows: cl.Buffer, qo: cl.Buffer,
    ) -> list[cl.Event]:  # fmt: skip
        """`_ilastik` on CPUs: kernels/ilastik_rows.cl, a work-item a row along axis 2."""
        ny, nz = self.shape[1:]
        depth, nq, ns = b - a, len(qrows), len(srows)
        bt, bc = self._passes["t"], self._passes["c"]
        i32, cval = np.int32, np.float32(self.cval)
        my, mz = self._maps
        n = np.int64(depth * ny * nz)
        events = [cl.enqueue_fill_buffer(self.queue, bc, cval, 0, nz * 4)]
        for s, scale in enumerate(self.preset.scales):
            kyz, kst = self._k[s]
            taps = self._taps[s]
            os_, ol, om, od, ot, oh = map(i32, scale.at)
            kyz.set_args(
                field,
                i32(slots.index(s)),
                i32(ns),
                rows,
                i32(nq),
                taps,
                my,
                mz,
                qo,
                i32(ny),
                i32(nz),
                cval,
                bc,
                bt,
                self._dst,
                n,
                os_,
                ol,
                om,
                od,
                oh,
            )
            kst.set_args(bt, i32(nq), grows, taps, my, mz, i32(depth), i32(ny), i32(nz), cval,
                         bc, self._dst, n, ot)  # fmt: skip
            for name, k, m in (("ilastik_yz", kyz, nq), ("ilastik_st", kst, depth)):
                event = cl.enqueue_nd_range_kernel(self.queue, k, (ny, m), None)
                events.append(self.clock.add(name, event))
        return events
