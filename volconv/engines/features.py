"""Derived features on the device: kernels/features.cl over a slab's responses
(`FeatureKernels`), their float64 host forms (`host_feature`, `eigenvalues`) and the structure
tensor's second smoothing (`StructureTensorStage`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyopencl as cl

from volconv.bank.features import PAIRS, Feature
from volconv.device.programs import build, device_seconds
from volconv.engines.boundary import sources


class FeatureKernels:
    """kernels/features.cl on one context: `launch` runs features over a slab's responses."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, jacobi: bool = False) -> None:
        """``jacobi``: eigenvalues by float32 Jacobi rotations also where the device has
        doubles (its default there: the closed form in float64)."""
        self.ctx, self.queue = ctx, queue
        prog = build(ctx, "features.cl", (("JACOBI", 1),) if jacobi else ())
        names = ("magnitude", "eigen3", "pick", "difference", "product_pad")
        self._k = {name: cl.Kernel(prog, name) for name in names}

    def launch(
        self, kernel: str, src: cl.Buffer, slots: Sequence[int], dst: cl.Buffer, o: int, n: int
    ) -> cl.Event:
        """Enqueue ``kernel`` over ``n`` voxels: reading planes ``slots`` of ``src`` (plane s
        at s * n) and writing planes from ``o`` of ``dst``."""
        k = self._k[kernel]
        i32 = np.int32
        if kernel == "magnitude":
            c = slots[2] if len(slots) == 3 else -1
            k.set_args(src, i32(slots[0]), i32(slots[1]), i32(c), dst, i32(o), np.int64(n))
        elif kernel == "pick":
            k.set_args(src, i32(slots[0]), dst, i32(o), np.int64(n))
        elif kernel == "difference":
            k.set_args(src, i32(slots[0]), i32(slots[1]), dst, i32(o), np.int64(n))
        else:
            k.set_args(src, *map(i32, slots), dst, i32(o), np.int64(n))
        return cl.enqueue_nd_range_kernel(self.queue, k, (n,), None)

    def eigen(self, entries: np.ndarray) -> tuple[np.ndarray, float]:
        """Eigenvalues (3, ...) of the float32 entries (6, ...) (00, 11, 22, 01, 02, 12), on the
        device; and the kernel's device seconds."""
        entries = np.ascontiguousarray(entries, np.float32)
        n = entries[0].size
        mf = cl.mem_flags
        src = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=entries)
        dst = cl.Buffer(self.ctx, mf.WRITE_ONLY, 3 * n * 4)
        event = self.launch("eigen3", src, range(6), dst, 0, n)
        out = np.empty((3, *entries.shape[1:]), np.float32)
        cl.enqueue_copy(self.queue, out, dst, wait_for=[event])
        return out, device_seconds([event])


def host_feature(kernel: str, planes: Sequence[np.ndarray]) -> list[np.ndarray]:
    """What kernels/features.cl's ``kernel`` computes, on the host in float64 (slabs whose
    source holds NaN or Inf, whose responses the host sets)."""
    p = [np.asarray(x, np.float64) for x in planes]
    if kernel == "pick":
        return p
    if kernel == "difference":
        with np.errstate(invalid="ignore"):
            return [p[0] - p[1]]
    if kernel == "magnitude":
        with np.errstate(over="ignore", invalid="ignore"):
            return [np.sqrt(sum(x * x for x in p))]
    return eigenvalues(p)


def eigenvalues(entries: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Descending eigenvalues of symmetric 3x3 matrices given by their entries (00, 11, 22,
    01, 02, 12), in float64 (`numpy.linalg.eigvalsh`); NaN where an entry is not finite."""
    e = [np.asarray(x, np.float64) for x in entries]
    shape = e[0].shape
    m = np.empty((*shape, 3, 3))
    for v, (a, b) in zip(e, PAIRS, strict=True):
        m[..., a, b] = m[..., b, a] = v
    m = m.reshape(-1, 3, 3)
    finite = np.isfinite(m).all(axis=(1, 2))
    out = np.full((len(m), 3), np.nan)
    if finite.any():
        out[finite] = np.linalg.eigvalsh(m[finite])[:, ::-1]
    return [out[:, i].reshape(shape) for i in range(3)]


# -- the structure tensor's second smoothing ------------------------------------------------


class StructureTensorStage:
    """A structure tensor's eigenvalues for a slab of output rows.

    The outer smoothing reads the product field g_a * g_b over the slab widened by rho's
    radius, extended by the bank's mode at the volume's borders (scipy's ``gaussian_filter``
    of the products), so the gradients are computed over the product rows that smoothing
    reads (`volconv.engines.boundary.extend_indices`), in chunks of at most the slab's depth,
    and kept on the device; each product is gathered into the outer smoothing's padded slab through
    pad.cl's index maps (kernels/features.cl's product_pad: mode and cval applied to the
    product field), smoothed by the outer convolver's passes, and the six entries give the
    eigenvalues (eigen3); only those are downloaded. A slab whose source holds NaN or Inf
    goes through the host (`_compute_host`): the gradients set as scipy sets them, the
    products smoothed as a float32 volume's rows.
    """

    def __init__(
        self,
        feature: Feature,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str,
        cval: float,
        device: cl.Device,
        slab_depth: int,
        kernels: FeatureKernels,
    ) -> None:
        from volconv.engines.separable import SeparableConvolver, plan_bank

        self.feature, self.shape, self.mode = feature, tuple(shape), mode
        self.kernels = kernels
        grads = list(feature.inputs)
        self.grad = SeparableConvolver(
            grads, shape, dtype, mode, cval, device=device, slab_depth=slab_depth,
            choices=plan_bank(grads, force="separable"), fused=False,
        )  # fmt: skip
        rho = [feature.rho_filter]
        self.outer = SeparableConvolver(
            rho, shape, np.float32, mode, cval, device=device, slab_depth=slab_depth,
            choices=plan_bank(rho, force="separable"), fused=False,
        )  # fmt: skip
        self.depth = slab_depth
        self.seconds = 0.0
        if self.outer.plan.pad_dtype != np.float32:
            raise ValueError("structure tensor: the outer smoothing pads float32")
        self._g: cl.Buffer | None = None  # the gradients over the product rows
        self._entries: cl.Buffer | None = None  # S's six planes, then the eigenvalues

    @property
    def convolvers(self) -> tuple:
        """The convolvers whose timings the slab's count (`SeparableConvolver.convolve_slab`)."""
        return (self.grad, self.outer)

    def product_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted rows of the product field the outer smoothing of ``[a, b)`` reads."""
        return self.outer.source_rows(a, b)

    def _chunks(self, a: int, b: int) -> list[tuple[int, int]]:
        rows = self.product_rows(a, b)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        out = []
        for run in np.split(rows, breaks):
            r0, r1 = int(run[0]), int(run[-1]) + 1
            out += [(c, min(c + self.depth, r1)) for c in range(r0, r1, self.depth)]
        return out

    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows of the volume that output rows ``[a, b)`` read."""
        parts = [self.grad.source_rows(c0, c1) for c0, c1 in self._chunks(a, b)]
        return sources(np.concatenate(parts))

    def compute(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        """The three eigenvalue volumes (3, b - a, ny, nz) float32 of output rows ``[a, b)``,
        from the volume's ``rows`` at ``needed`` (sorted, covering `source_rows`) or its
        whole ``frame``."""
        from volconv.engines.nonfinite import has_nonfinite

        if rows is not None and has_nonfinite(rows):
            return self._compute_host(a, b, rows, needed, frame)
        from volconv.device.programs import device_seconds

        grad, outer, queue = self.grad, self.outer, self.grad.queue
        ctx = grad.ctx
        mf = cl.mem_flags
        ny, nz = self.shape[1:]
        prows = self.product_rows(a, b)
        nr, depth = len(prows), b - a
        if self._g is None or self._g.size < 3 * nr * ny * nz * 4:
            self._g = cl.Buffer(ctx, mf.READ_WRITE, 3 * nr * ny * nz * 4)
        if self._entries is None or self._entries.size < 9 * depth * ny * nz * 4:
            self._entries = cl.Buffer(ctx, mf.READ_WRITE, 9 * self.depth * ny * nz * 4)
        events: list[cl.Event] = []
        at = 0
        for c0, c1 in self._chunks(a, b):  # the gradients, each chunk copied beside the others
            if rows is None:
                up, pad = grad.padder(c0, c1, grad._padded, frame=frame)
            else:
                own = rows[np.searchsorted(needed, grad.source_rows(c0, c1))]
                up, pad = grad.padder(c0, c1, grad._padded, rows=own)
            events += [*up, pad, *grad._launch_passes(c1 - c0)]
            plane = (c1 - c0) * ny * nz * 4
            for s in range(3):
                slot = grad._slots.index(s)
                events.append(cl.enqueue_copy(queue, self._g, grad._out, byte_count=plane,
                                              src_offset=slot * plane,
                                              dst_offset=(s * nr + at) * ny * nz * 4))  # fmt: skip
            at += c1 - c0
        m0 = outer.padder.row_map(a, b)
        local = np.where(m0 >= 0, np.searchsorted(prows, m0), -1).astype(np.int32)
        m0_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=local)
        p1, p2 = outer.plan.padded_yz
        i32 = np.int32
        k = self.kernels._k["product_pad"]
        n = depth * ny * nz
        for i, (p, q) in enumerate(PAIRS):
            k.set_args(self._g, i32(p), i32(q), i32(nr), outer._padded, m0_buf,
                       outer.padder._m1, outer.padder._m2, i32(len(local)), i32(p1), i32(p2),
                       i32(ny), i32(nz), np.float32(outer.plan.cval))  # fmt: skip
            events.append(cl.enqueue_nd_range_kernel(queue, k, (p2, p1, len(local)), None))
            events += outer._launch_passes(depth)
            events.append(cl.enqueue_copy(queue, self._entries, outer._out, byte_count=n * 4,
                                          dst_offset=i * n * 4))  # fmt: skip
        events.append(self.kernels.launch("eigen3", self._entries, range(6), self._entries, 6, n))
        values = np.empty((3, depth, ny, nz), np.float32)
        cl.enqueue_copy(queue, values, self._entries, src_offset=6 * n * 4, wait_for=events[-1:])
        cl.wait_for_events(events)
        self.seconds += device_seconds(events)
        return values

    def _compute_host(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        """`compute` through the host: for slabs whose source holds NaN or Inf."""
        ny, nz = self.shape[1:]
        prows = self.product_rows(a, b)
        g = np.empty((3, len(prows), ny, nz), np.float32)
        at = 0
        for c0, c1 in self._chunks(a, b):
            if frame is not None:
                given = {"frame": frame}
            else:
                given = {"rows": rows[np.searchsorted(needed, self.grad.source_rows(c0, c1))]}
            g[:, at : at + c1 - c0] = self.grad.convolve_slab(c0, c1, **given)
            at += c1 - c0
        entries = np.empty((6, b - a, ny, nz), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for i, (p, q) in enumerate(PAIRS):
                prod = (g[p].astype(np.float64) * g[q]).astype(np.float32)
                entries[i] = self.outer.convolve_slab(a, b, rows=prod)[0]
        values, seconds = self.kernels.eigen(entries)
        self.seconds += seconds
        return values
