"""The skimage preset's first stage on CPUs (`RowGaussians`): each scale's Gaussian in mode
'nearest' over the rows a slab's stencils read, by kernels/skimage_rows.cl's passes along axes
0, 1 and 2 (scipy's order), in vectors along axis 2, their indices clamped to the volume: each
pass computes only the rows the next one reads. (GPUs run `volconv.engines.smoothing`'s
`NearestGaussians`, which keeps rows between slabs; on CPUs its kernels, shaped for GPUs, run
a voxel at a time.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyopencl as cl

from volconv.bank.features import radius
from volconv.bank.kernels import gaussian_kernel1d
from volconv.engines.clock import KernelClock
from volconv.engines.smoothing import NearestGaussians

LANES = 8  # voxels along axis 2 a work-item (kernels/skimage_rows.cl's L)
ROWS = 8  # gauss_x's and gauss_y's outputs a work-item along their axis (U)


def row_gaussians_bytes(radii: Sequence[int], shape: tuple[int, int, int], rows: int) -> int:
    """Device memory of `RowGaussians` whose field holds ``rows`` rows: the input rows
    uploaded (float32), two passes' rows, the field and the taps."""
    n0, ny, nz = shape
    rows = min(rows, n0)
    top = min(n0, rows + 2 * max(radii))
    return 4 * ((top + (2 + len(radii)) * rows) * ny * nz + sum(2 * (r + ROWS) + 1 for r in radii))


class RowGaussians:
    """The Gaussians of ``sigmas`` (at ``truncate``, mode 'nearest') of a volume of ``shape``
    over field rows ``[g0, g1)`` (at most ``rows`` of them): `smooth` leaves scale ``s``'s in
    plane ``s`` of ``field`` (``rows`` rows each; row g0 first). The same interface as
    `volconv.engines.smoothing.NearestGaussians`; nothing is kept between calls."""

    def __init__(
        self, ctx: cl.Context, queue: cl.CommandQueue, sigmas: Sequence[float], truncate: float,
        shape: tuple[int, int, int], rows: int, clock: KernelClock,
    ) -> None:  # fmt: skip
        from volconv.engines.features import build_with_features

        self.ctx, self.queue, self.clock = ctx, queue, clock
        self.shape, self.rows = tuple(shape), min(rows, shape[0])
        n0, ny, nz = self.shape
        self.radii = [radius(s, truncate) for s in sigmas]
        prog = build_with_features(ctx, "skimage_rows.cl", (("EV", 2 * LANES), ("U", ROWS)))
        self._k = {n: cl.Kernel(prog, n) for n in ("gauss_x", "gauss_y", "gauss_z")}
        mf, plane = cl.mem_flags, ny * nz
        pad = np.zeros(ROWS, np.float32)  # the taps between ROWS zeros on each side
        self._w = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.concatenate(
                       [pad, gaussian_kernel1d(s, 0, r).astype(np.float32), pad]))
                   for s, r in zip(sigmas, self.radii, strict=True)]  # fmt: skip
        self.field = cl.Buffer(ctx, mf.READ_WRITE, len(sigmas) * self.rows * plane * 4)
        self._a = cl.Buffer(ctx, mf.READ_WRITE, self.rows * plane * 4)
        self._b = cl.Buffer(ctx, mf.READ_WRITE, self.rows * plane * 4)
        top = min(n0, self.rows + 2 * max(self.radii))
        self._up = cl.Buffer(ctx, mf.READ_ONLY, top * plane * 4)

    @property
    def device_bytes(self) -> int:
        return row_gaussians_bytes(self.radii, self.shape, self.rows)

    input_rows = NearestGaussians.input_rows  # the input rows field rows [g0, g1) read

    def smooth(
        self, g0: int, g1: int, rows_of: Callable[[int, int], np.ndarray]
    ) -> tuple[list[cl.Event], list[cl.Event]]:
        """As `NearestGaussians.smooth`: every scale's field rows ``[g0, g1)`` from the input's
        rows ``rows_of(*self.input_rows(g0, g1))``; the upload's events and the kernels'."""
        n0, ny, nz = self.shape
        lo, hi = self.input_rows(g0, g1)
        rows = np.ascontiguousarray(rows_of(lo, hi), np.float32)  # what the passes convert to
        events = [cl.enqueue_copy(self.queue, self._up, rows, is_blocking=False)]
        i32, ng, nb = np.int32, g1 - g0, -(-nz // LANES)
        kx, ky, kz = self._k["gauss_x"], self._k["gauss_y"], self._k["gauss_z"]
        work: list[cl.Event] = []
        for s, r in enumerate(self.radii):
            kx.set_args(self._up, i32(lo), i32(g0), i32(ng), i32(n0), i32(ny), i32(nz),
                        self._w[s], i32(r), self._a)  # fmt: skip
            ky.set_args(self._a, i32(ng), i32(ny), i32(nz), self._w[s], i32(r), self._b)
            kz.set_args(self._b, i32(ng), i32(ny), i32(nz), self._w[s], i32(r), self.field,
                        np.int64(s * self.rows * ny * nz),
                        cl.LocalMemory(4 * (nz + 2 * r + 4 * LANES)))  # fmt: skip
            for name, k, size in (("gauss_x", kx, (nb, ny, -(-ng // ROWS))),
                                  ("gauss_y", ky, (nb, -(-ny // ROWS), ng)),
                                  ("gauss_z", kz, (ny, ng))):  # fmt: skip
                local = (min(size[0], 16), 1, 1) if len(size) == 3 else (1, 1)
                event = cl.enqueue_nd_range_kernel(self.queue, k, size, local)
                work.append(self.clock.add(name, event))
        return events, work
