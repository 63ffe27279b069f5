"""Derived features on the device: kernels/features.cl over a slab's responses
(`FeatureKernels`), their float64 host forms (`host_feature`, `eigenvalues`) and the structure
tensor's second smoothing (`StructureTensorStage`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pyopencl as cl

from volconv.bank.features import PAIRS, Feature
from volconv.device.programs import binary_build, device_seconds, kernel_source
from volconv.engines.boundary import sources
from volconv.engines.clock import KernelClock

if TYPE_CHECKING:
    from volconv.engines.structure import StructureKernels

# Voxels per work-item of the element-wise feature kernels: CPUs run explicit vectors in
# their SIMD lanes (benchmarks/results/pocl-features-eigen.json, "eigen3_lanes"), GPUs one
# voxel a work-item.
FEATURE_LANES = {"cpu": 8, "gpu": 1}


def lanes_for(device: cl.Device) -> int:
    """`FEATURE_LANES` of ``device``'s kind (accelerators count as GPUs)."""
    return FEATURE_LANES["cpu" if device.type & cl.device_type.CPU else "gpu"]


# kernels/bands.cl's columns a band (BAND_Y, BAND_Z): a zero background's tiles skipped by the
# second launch of kernels/tree_yz.cl and structure.cl (ZERO_SKIP); along axis 2 a warp's
ZERO_BANDS = (8, 32)


def zero_bands(rows: int, band_rows: int, ny: int, nz: int) -> int:
    """kernels/bands.cl's bands over ``rows`` rows of ``ny`` x ``nz`` columns, ``band_rows``
    rows a band."""
    return -(-rows // band_rows) * -(-ny // ZERO_BANDS[0]) * -(-nz // ZERO_BANDS[1])


def zero_held(rows: int, band_rows: int, ny: int, nz: int) -> int:
    """kernels/bands.cl's held bytes over ``rows`` rows of ``ny`` x ``nz`` columns, one a
    column of ``band_rows`` rows."""
    return -(-rows // band_rows) * ny * nz


def zero_bands_bytes(rows: int, band_rows: int, ny: int, nz: int) -> int:
    """Device bytes of `ZeroBands` over ``rows`` rows of ``ny`` x ``nz`` columns."""
    return 4 * zero_bands(rows, band_rows, ny, nz) + zero_held(rows, band_rows, ny, nz)


class ZeroBands:
    """kernels/bands.cl's marks on the device (`zero_bands` of them, zeroed once): each launch
    of a tree's first kernel marks with a new epoch (`advance`), so they are never cleared;
    and its ``held`` bytes, one a column of ``band_rows`` rows, all set at first (the
    intermediate, not yet written, may hold anything)."""

    def __init__(self, ctx: cl.Context, rows: int, band_rows: int, ny: int, nz: int) -> None:
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        marks = np.zeros(zero_bands(rows, band_rows, ny, nz), np.int32)
        self.buffer = cl.Buffer(ctx, flags, hostbuf=marks)
        held = np.ones(zero_held(rows, band_rows, ny, nz), np.uint8)
        self.held = cl.Buffer(ctx, flags, hostbuf=held)
        self.epoch = np.int32(0)

    @property
    def nbytes(self) -> int:
        """Device bytes it holds (`zero_bands_bytes`)."""
        return self.buffer.size + self.held.size

    def advance(self) -> np.int32:
        """The next launch's epoch (1 after 2**31 - 1: never 0, the zeroed marks')."""
        self.epoch = np.int32(int(self.epoch) % (2**31 - 1) + 1)
        return self.epoch


@cache
def build_with_features(ctx: cl.Context, name: str, defines: tuple[tuple[str, object], ...]):
    """kernels/``name`` built behind kernels/eigen.cl (the feature functions it calls) and
    kernels/bands.cl, once per process, through the binary cache."""
    source = "\n".join(kernel_source(f) for f in ("eigen.cl", "bands.cl", name))
    bands = (("BAND_Y", ZERO_BANDS[0]), ("BAND_Z", ZERO_BANDS[1]))
    return binary_build(ctx, source, [f"-D{k}={v}" for k, v in (*bands, *defines)])


class FeatureKernels:
    """kernels/features.cl on one context: `launch` runs features over a slab's responses."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, lanes: int | None = None) -> None:
        """``lanes``: voxels per work-item (1, 2, 4, 8 or 16; default `lanes_for` the
        device)."""
        self.ctx, self.queue = ctx, queue
        self.lanes = lanes_for(ctx.devices[0]) if lanes is None else int(lanes)
        if self.lanes not in (1, 2, 4, 8, 16):
            raise ValueError(f"lanes must be 1, 2, 4, 8 or 16; got {lanes}")
        prog = build_with_features(ctx, "features.cl", (("EV", self.lanes),))
        names = ("magnitude", "eigen3", "pick", "difference", "product_pad")
        self._k = {name: cl.Kernel(prog, name) for name in names}
        self.clock = KernelClock()

    def launch(
        self, kernel: str, src: cl.Buffer, slots: Sequence[int], dst: cl.Buffer, o: int, n: int,
        stride: int | None = None,
    ) -> cl.Event:  # fmt: skip
        """Enqueue ``kernel`` over ``n`` voxels: reading planes ``slots`` of ``src`` (plane s
        at s * n; eigen3: at s * ``stride``) and writing planes from ``o`` of ``dst``."""
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
            k.set_args(src, *map(i32, slots), dst, i32(o), np.int64(n),
                       np.int64(n if stride is None else stride))  # fmt: skip
        event = cl.enqueue_nd_range_kernel(self.queue, k, (-(-n // self.lanes),), None)
        return self.clock.add(kernel, event)

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
    reads (`volconv.engines.boundary.extend_indices`), in chunks of at most the slab's depth
    plus that reach (one chunk but where the mode wraps), and stay on the device; for each
    chunk one launch of kernels/features.cl's product_pad gathers the six products into six
    padded slabs, stacked along axis 0, through pad.cl's index maps (mode and cval applied to
    the product field); the outer smoothing (`outer`) runs over the stack (its pass tree over
    each slab's rows; its fused kernel over the whole stack, the rows between two slabs
    computed and never read) and eigen3 reads the six entries from it; only the
    eigenvalues are downloaded, into the caller's array (``out``). A slab whose source holds
    NaN or Inf goes through the host (`_compute_host`): the gradients set as scipy sets them,
    the products smoothed as a float32 volume's rows.
    """

    fills_out = True  # `compute` takes ``out`` and downloads into it
    # the gradients' convolver's path options over the caller's (fused, multi, xfirst), for
    # trials (scripts/bench/structure.py)
    GRAD_OPTIONS: ClassVar[dict[str, object]] = {}

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
        fused: bool | None = None,
        multi: bool | None = None,
        xfirst: bool | None = None,
    ) -> None:
        """``fused``: the gradients and the outer smoothing each as one fused kernel (default:
        on GPUs; `volconv.plan.separable.make_separable_plan`); ``multi``: the outer
        smoothing of the six products as one tree of kernels/tree.cl with the eigenvalues as
        its epilogue (default: on GPUs unless ``fused``), axis 0 first (kernels/tree_yz.cl)
        where ``xfirst`` (default: not, as measured on the H100,
        benchmarks/results/h100-feature-sweep-2.json) and its tiles fit."""
        from volconv.engines.padder import Padder
        from volconv.engines.separable import SeparableConvolver
        from volconv.engines.structure import StructureKernels
        from volconv.engines.tree import MultiTree
        from volconv.engines.xfirst import XFirstTree
        from volconv.plan.separable import plan_bank

        self.feature, self.shape, self.mode, self.cval = feature, tuple(shape), mode, cval
        self.device, self.kernels, self.depth = device, kernels, slab_depth
        self.reach = (feature.rho_filter.kernel.shape[0] - 1) // 2
        n0, ny, nz = self.shape
        grads = list(feature.inputs)
        self.grad = SeparableConvolver(
            grads, shape, dtype, mode, cval, device=device,
            slab_depth=min(n0, slab_depth + 2 * self.reach),
            choices=plan_bank(grads, force="separable"), zero_skip=True,  # they feed a feature
            **{"fused": fused, **self.GRAD_OPTIONS},
        )  # fmt: skip
        if self.grad._slots != [0, 1, 2]:
            raise ValueError("structure tensor: the gradients run as passes")
        # the six padded slabs stacked along axis 0, smoothed as one (its shape along axis 0
        # is the stack's: only its passes run; the index maps along axes 1, 2 are the volume's)
        rows = self.stacked_rows(slab_depth, self.reach)
        rho = [feature.rho_filter]
        self.multi = self.outer_multi(device, fused, multi)
        self.outer: SeparableConvolver | None = None
        self.xfirst = False
        self._st: StructureKernels | None = None
        if self.multi:  # the stack's padded slabs and maps, and the six-input tree
            self.outer_plan = self._outer_plan(feature, shape, mode, cval, device, slab_depth,
                                               fused, multi=True, xfirst=xfirst)  # fmt: skip
            plan = self.outer_plan
            self._padded: cl.Buffer | None = None  # where the products are gathered first
            self._maps = Padder(kernels.ctx, kernels.queue, plan.shape, plan.src_dtype,
                                plan.pad_dtype, plan.halo_lo, plan.halo_hi, mode, cval,
                                plan.padded_yz, 1)  # fmt: skip
            self._clock = KernelClock()
            self.xfirst = self.outer_xfirst(plan, device)
            if self.outer_st(self.xfirst, mode):  # kernels/structure.cl
                self._st = StructureKernels(kernels.ctx, kernels.queue, plan, six_inputs(plan),
                                            slab_depth, self._clock)  # fmt: skip
            else:
                kind = XFirstTree if self.xfirst else MultiTree
                self._tree = kind(kernels.ctx, kernels.queue, plan,
                                  six_inputs(plan, self.xfirst), "EIG3(0,1,2,3,4,5,0)", 0, 3,
                                  self._clock, range(6), slab_depth, products=PAIRS)  # fmt: skip
        else:
            self.outer = SeparableConvolver(
                rho, (rows, ny, nz), np.float32, mode, cval, device=device, slab_depth=rows,
                choices=plan_bank(rho, force="separable"), fused=fused, multi=False,
            )  # fmt: skip
            self.outer_plan, self._maps = self.outer.plan, self.outer.padder
        if self.outer_plan.pad_dtype != np.float32:
            raise ValueError("structure tensor: the outer smoothing pads float32")
        self._host_outer = None  # the outer smoothing over the volume's rows (host path)
        self.seconds = 0.0
        self._values = cl.Buffer(kernels.ctx, cl.mem_flags.READ_WRITE,
                                 3 * slab_depth * ny * nz * 4)  # fmt: skip

    @staticmethod
    def outer_multi(device: cl.Device, fused: bool | None, multi: bool | None) -> bool:
        """Whether the outer smoothing runs as kernels/tree.cl (``multi``; default: on GPUs
        unless ``fused``)."""
        if multi is not None:
            return bool(multi)
        return fused is not True and not device.type & cl.device_type.CPU

    @staticmethod
    def _outer_plan(
        feature: Feature, shape: tuple[int, int, int], mode: str, cval: float,
        device: cl.Device, slab_depth: int, fused: bool | None, multi: bool,
        xfirst: bool | None = None,
    ) -> object:  # fmt: skip
        """The plan of the outer smoothing over the six stacked padded slabs."""
        from volconv.plan.separable import make_separable_plan, plan_bank

        reach = (feature.rho_filter.kernel.shape[0] - 1) // 2
        rows = StructureTensorStage.stacked_rows(slab_depth, reach)
        rho = [feature.rho_filter]
        return make_separable_plan(
            rho, (rows, *shape[1:]), np.float32, mode, cval, device,
            choices=plan_bank(rho, force="separable"), slab_depth=rows,
            fused=False if multi else fused, multi=multi, xfirst=bool(multi and xfirst),
        )  # fmt: skip

    @staticmethod
    def outer_st(xfirst: bool, mode: str) -> bool:
        """Whether the six products' tree runs as kernels/structure.cl: unless axis 0 goes
        first through kernels/tree_yz.cl (``xfirst``) or the mode wraps (a slab's product rows
        then come in several chunks of gradients, which it does not read)."""
        return not xfirst and mode != "wrap"

    @staticmethod
    def outer_xfirst(plan: object, device: cl.Device) -> bool:
        """Whether the six products' tree runs axis 0 first (kernels/tree_yz.cl): where the
        plan takes it and the six roots' tiles fit."""
        from volconv.plan.separable import xfirst_fits

        return plan.xfirst and xfirst_fits(six_inputs(plan, True), device)

    @staticmethod
    def _outer_bytes(plan: object, device: cl.Device, slab_depth: int, mode: str) -> int:
        """Device memory of the six products' tree: the stacked padded slabs (where the
        products are gathered first) and its intermediates; kernels/structure.cl's C."""
        from volconv.engines.structure import st_bytes
        from volconv.engines.tree import tree_bytes
        from volconv.engines.xfirst import xfirst_bytes

        xfirst = StructureTensorStage.outer_xfirst(plan, device)
        if StructureTensorStage.outer_st(xfirst, mode):
            return st_bytes(plan, six_inputs(plan), device, slab_depth)
        rows = plan.slab_depth
        total = plan.slab_bytes(rows)["padded"]
        if xfirst:
            return total + xfirst_bytes(plan, six_inputs(plan, True), slab_depth)
        return total + sum(tree_bytes(plan, six_inputs(plan), slab_depth).values())

    @staticmethod
    def device_bytes(
        feature: Feature, shape: tuple[int, int, int], dtype: np.dtype, mode: str, cval: float,
        device: cl.Device, slab_depth: int, fused: bool | None = None,
        multi: bool | None = None, xfirst: bool | None = None,
    ) -> int:  # fmt: skip
        """Device memory of the stage for slabs of ``slab_depth`` rows: the gradients'
        convolver, the stacked outer smoothing's and the eigenvalues."""
        from volconv.plan.separable import make_separable_plan, plan_bank

        n0, ny, nz = shape
        reach = (feature.rho_filter.kernel.shape[0] - 1) // 2
        grads = list(feature.inputs)
        total = 3 * slab_depth * ny * nz * 4
        total += make_separable_plan(
            grads, shape, dtype, mode, cval, device, choices=plan_bank(grads, force="separable"),
            slab_depth=min(n0, slab_depth + 2 * reach),
            **{"fused": fused, **StructureTensorStage.GRAD_OPTIONS},
        ).device_bytes  # fmt: skip
        several = StructureTensorStage.outer_multi(device, fused, multi)
        outer = StructureTensorStage._outer_plan(feature, shape, mode, cval, device, slab_depth,
                                                 fused, several, xfirst)  # fmt: skip
        if several:
            return total + StructureTensorStage._outer_bytes(outer, device, slab_depth, mode)
        return total + outer.device_bytes

    @property
    def clocks(self) -> list:
        """The `volconv.engines.clock.KernelClock`s of its convolvers' launches (its own
        kernels report to ``kernels.clock``)."""
        return [self.grad.clock, self.outer.clock if self.outer else self._clock]

    @property
    def held_bytes(self) -> int:
        """Device memory the stage holds (`device_bytes` of its sizes)."""
        outer = (self.outer.plan.device_bytes if self.outer else
                 self._outer_bytes(self.outer_plan, self.device, self.depth,
                                   self.mode))  # fmt: skip
        return self.grad.plan.device_bytes + outer + self._values.size

    @staticmethod
    def stacked_rows(depth: int, reach: int) -> int:
        """Output rows of the stacked outer smoothing: six padded slabs of ``depth + 2
        reach`` rows, less one halo."""
        return 6 * (depth + 2 * reach) - 2 * reach

    @property
    def executed_gflop(self) -> float:
        """GFLOP its kernels compute for one volume: the gradients' passes, and the outer
        smoothing's three passes over each of the six products (the rows between slabs and the
        eigenvalues uncounted)."""
        outer = 2.0 * math.prod(self.shape) * self.feature.outer_taps / 1e9
        return self.grad.executed_gflop + outer

    @property
    def convolvers(self) -> tuple:
        """The convolvers whose timings the slab's count (`SeparableConvolver.convolve_slab`)."""
        return (self.grad, self.outer) if self.outer else (self.grad,)

    def product_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted rows of the product field the outer smoothing of ``[a, b)`` reads."""
        return sources(self._row_map(a, b))

    def _row_map(self, a: int, b: int) -> np.ndarray:
        """The product row (-1: cval) of each padded row of ``[a, b)``'s outer smoothing."""
        from volconv.engines.boundary import extend_indices

        return extend_indices(self.shape[0], a - self.reach, b + self.reach, self.mode)

    def _chunks(self, a: int, b: int) -> list[tuple[int, int]]:
        rows = self.product_rows(a, b)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        depth = self.grad.plan.slab_depth
        out = []
        for run in np.split(rows, breaks):
            r0, r1 = int(run[0]), int(run[-1]) + 1
            out += [(c, min(c + depth, r1)) for c in range(r0, r1, depth)]
        return out

    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows of the volume that output rows ``[a, b)`` read."""
        parts = [self.grad.source_rows(c0, c1) for c0, c1 in self._chunks(a, b)]
        return sources(np.concatenate(parts))

    def compute(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None, out: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """The three eigenvalue volumes (3, b - a, ny, nz) float32 of output rows ``[a, b)``,
        from the volume's ``rows`` at ``needed`` (sorted, covering `source_rows`) or its
        whole ``frame``; into ``out`` (float32, each plane contiguous) if given."""
        from volconv.engines.nonfinite import has_nonfinite

        ny, nz = self.shape[1:]
        depth = b - a
        out = np.empty((3, depth, ny, nz), np.float32) if out is None else out
        if rows is not None and has_nonfinite(rows):
            out[:] = self._compute_host(a, b, rows, needed, frame)
            return out
        grad, outer, queue = self.grad, self.outer, self.grad.queue
        mf = cl.mem_flags
        p1, p2 = self.outer_plan.padded_yz
        p0 = depth + 2 * self.reach
        m0 = self._row_map(a, b)
        i32 = np.int32
        k = self.kernels._k["product_pad"]
        events: list[cl.Event] = []
        ups: list[cl.Event] = []  # the gradients' uploads and pads: counted as theirs
        pads: list[cl.Event] = []
        chunks = self._chunks(a, b)
        # the products formed where the tree first reads them (one chunk of gradients: every
        # row the smoothing reads at once), else gathered by product_pad into padded slabs
        direct = outer is None and len(chunks) == 1
        if self._st is not None and not direct:
            raise RuntimeError("structure tensor: a slab's product rows in several chunks")
        if outer is None and not direct and self._padded is None:
            size = self.outer_plan.slab_bytes(self.outer_plan.slab_depth)["padded"]
            self._padded = cl.Buffer(grad.ctx, mf.READ_WRITE, size)
        padded = self._padded if outer is None else outer._padded
        for c0, c1 in chunks:
            if rows is None:
                up, pad = grad.padder(c0, c1, grad._padded, frame=frame)
            else:
                own = rows[np.searchsorted(needed, grad.source_rows(c0, c1))]
                up, pad = grad.padder(c0, c1, grad._padded, rows=own)
            ups += up
            pads.append(pad)
            events += grad._launch_passes(c1 - c0)
            if direct:
                local = np.where(m0 >= 0, m0 - c0, -1).astype(np.int32)
                if self._st is not None:
                    events += self._st.launch(grad._out, (c1 - c0) * ny * nz, local,
                                              self._maps._m1, self._maps._m2, self.cval,
                                              self._values, depth)  # fmt: skip
                    continue
                m0_buf = cl.Buffer(grad.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=local)
                events += self._tree.launch_products(
                    grad._out, (c1 - c0) * ny * nz, m0_buf, self._maps._m1, self._maps._m2,
                    self.cval, self._values, self._values, depth,
                )  # fmt: skip
                continue
            # the padded rows this chunk fills (the cval rows with the first chunk)
            inside = ((m0 >= c0) & (m0 < c1)) | ((m0 < 0) & (c0 == chunks[0][0]))
            fill = np.flatnonzero(inside).astype(np.int32)
            local = np.where(m0[fill] >= 0, m0[fill] - c0, -1).astype(np.int32)
            fill_buf, local_buf = (cl.Buffer(grad.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
                                   for x in (fill, local))  # fmt: skip
            k.set_args(grad._out, i32(c1 - c0), padded, fill_buf, local_buf,
                       self._maps._m1, self._maps._m2, i32(len(fill)), i32(p0), i32(p1),
                       i32(p2), i32(ny), i32(nz), np.float32(self.cval))  # fmt: skip
            event = cl.enqueue_nd_range_kernel(queue, k, (p2, p1, len(fill)), None)
            events.append(self.kernels.clock.add("product_pad", event))
        stacked = 6 * p0 - 2 * self.reach
        n = depth * ny * nz
        if direct:
            pass
        elif outer is None:  # the six slabs as one tree's inputs, the eigenvalues its epilogue
            events += self._tree.launch(padded, self._values, self._values, depth, False,
                                        in_stride=p0 * p1 * p2)  # fmt: skip
        else:
            if outer.plan.fused:  # one kernel over the stack, the rows between slabs included
                events += outer._launch_passes(stacked)
            else:  # the tree over each slab's own rows
                spans = [(i * p0, depth) for i in range(6)]
                events += outer._passes.launch(outer._padded, outer._out, stacked, spans)
            events.append(self.kernels.launch("eigen3", outer._out, range(6), self._values, 0,
                                              n, stride=p0 * ny * nz))  # fmt: skip
        down = [cl.enqueue_copy(queue, out[i], self._values, src_offset=i * n * 4,
                                is_blocking=False) for i in range(3)]  # fmt: skip
        cl.wait_for_events(events + ups + pads + down)
        self.seconds += device_seconds(events)
        grad.timings["upload"] += device_seconds(ups)
        grad.timings["pad"] += device_seconds(pads)
        return out

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
        if self._host_outer is None:
            from volconv.engines.separable import SeparableConvolver
            from volconv.plan.separable import plan_bank

            rho = [self.feature.rho_filter]
            self._host_outer = SeparableConvolver(
                rho, self.shape, np.float32, self.mode, self.cval, device=self.device,
                slab_depth=self.depth, choices=plan_bank(rho, force="separable"), fused=False,
            )  # fmt: skip
        entries = np.empty((6, b - a, ny, nz), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for i, (p, q) in enumerate(PAIRS):
                prod = (g[p].astype(np.float64) * g[q]).astype(np.float32)
                entries[i] = self._host_outer.convolve_slab(a, b, rows=prod)[0]
        values, seconds = self.kernels.eigen(entries)
        self.seconds += seconds
        return values


def six_inputs(plan: object, reverse: bool = False) -> object:
    """The tree of ``plan``'s one separable filter (`volconv.engines.passes.fused_tree`;
    ``reverse``: `volconv.engines.xfirst.reversed_tree`) over six inputs: a root, a mid and a
    response per input (a structure tensor's six products)."""
    from volconv.engines.passes import FusedTree, fused_tree
    from volconv.engines.xfirst import reversed_tree

    one = (reversed_tree if reverse else fused_tree)(plan.choices, plan.halo_lo)
    if len(one.wz) != 1 or len(one.wy) != 1 or one.n_out != 1:
        raise ValueError("structure tensor: the outer smoothing is one separable term")
    six = tuple(range(6))
    return FusedTree(one.start, one.taps, np.repeat(one.wz, 6, axis=0),
                     np.repeat(one.wy, 6, axis=0), np.repeat(one.wx, 6, axis=0), six, six, six,
                     6)  # fmt: skip
