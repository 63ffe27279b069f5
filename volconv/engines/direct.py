"""The OpenCL side: one build path for kernels/*.cl, buffers, launches, per-stage timing.

`BankConvolver` applies a bank of N kernels to a 3D volume slab by slab along axis 0. A slab of
output rows ``[a, b)`` needs the source rows `source_rows(a, b)`; the caller reads them (from an
array, a memory map, a NIfTI or HDF5 file) and `convolve_slab` returns the N responses.
`convolve_bank` is the whole-array API on top of it. A slab holding NaN or Inf is filtered as
scipy filters it (`volconv.engines.nonfinite`); finite slabs take the kernel alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pyopencl as cl

from volconv.bank.spec import MAX_EXTENT
from volconv.checks import (
    check_cval,
    check_mode,
    check_positive_int,
    docfiller,
    fits_float32,
)
from volconv.device.devices import select_device
from volconv.device.programs import build, context_for, device_seconds
from volconv.engines.convert import DeviceEncoder, encode
from volconv.engines.nonfinite import NonFiniteOverride, finite_part, has_nonfinite
from volconv.engines.padder import Padder, frame_bytes, native_volume, slab_rows
from volconv.plan.direct import MAX_FILTERS, Plan, make_plan
from volconv.report import work_gflop

# Device stages each convolver times (OpenCL profiling), in seconds: `timings`.
STAGES = ("upload", "pad", "kernel", "convert", "download")


def as_kernel_bank(kernels: object) -> np.ndarray:
    """Validate ``kernels`` as a real (N, kx, ky, kz) bank and return it as float64."""
    arr = np.asarray(kernels)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"kernels must be real numbers; got dtype {arr.dtype}")
    if arr.ndim != 4:
        raise ValueError(f"kernels must have shape (N, kx, ky, kz); got shape {arr.shape}")
    n, *ext = arr.shape
    if not 1 <= n <= MAX_FILTERS:
        raise ValueError(f"kernels: N must be 1..{MAX_FILTERS}; got {n}")
    if not all(1 <= k <= MAX_EXTENT for k in ext):
        raise ValueError(f"kernels: every extent must be 1..{MAX_EXTENT}; got {tuple(ext)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("kernels must be finite (no NaN or inf)")
    if not fits_float32(arr):
        raise ValueError(
            f"kernels hold values beyond float32's range (|v| <= 3.4e38); got "
            f"{float(np.abs(arr).max()):g}"
        )
    return arr.astype(np.float64)


def check_out(
    out: object, shape: tuple[int, ...], stored: np.dtype = np.dtype(np.float32)
) -> np.ndarray:
    """``out`` of `convolve_slab`: a writeable float32 (or ``stored``) array of ``shape``
    whose filter planes are each contiguous (the device writes each plane whole); else a
    ValueError naming it."""
    types = " or ".join(dict.fromkeys(("float32", np.dtype(stored).name)))
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a {types} array of shape {shape}; got {type(out).__name__}")
    if out.shape != shape or out.dtype not in (np.float32, stored):
        got = f"{out.dtype} {out.shape}"
        raise ValueError(f"out must be a {types} array of shape {shape}; got {got}")
    if not (out.flags.writeable and out[0].flags.c_contiguous):
        raise ValueError("out must be writeable, with each filter's plane out[f] contiguous")
    return out


def check_volume_dtype(dtype: np.dtype) -> None:
    if np.dtype(dtype).kind not in "biuf":
        raise TypeError(f"volume must be real numbers; got dtype {np.dtype(dtype)}")


class SlabConvolver:
    """What every convolver shares (`BankConvolver`, `separable.SeparableConvolver`):
    slabs along axis 0 of ``plan.slab_depth`` rows, page-locked buffers to download them
    into, and the stored type (`store`) they are converted to on the device before the
    download. Subclasses set ``plan`` (``shape``, ``slab_depth``, ``n_filters``), ``ctx``,
    ``queue`` and ``timings``."""

    plan: Any
    ctx: cl.Context
    queue: cl.CommandQueue
    timings: dict[str, float]
    stored = np.dtype(np.float32)  # what `convolve_slab` gives by default (`store`)
    _scale, _offset = 1.0, 0.0
    _encoder: DeviceEncoder | None = None
    _host_counts = (0, 0)  # NaNs and clipped voxels of the slabs converted on the host

    def store(self, dtype: str, scale: float = 1.0, offset: float = 0.0) -> None:
        """Give the responses as ``dtype`` (float32, float16 or uint8, `volconv.engines.convert`):
        `convolve_slab` then takes an ``out`` of that type (or float32) and, by default,
        returns one. The conversion runs on the device after the filtering, before the
        download; a slab whose source holds NaN or Inf is filtered in float32, set as scipy
        sets it (`volconv.engines.nonfinite`) and converted on the host, to the same bytes."""
        self.stored = np.dtype(dtype)
        self._scale, self._offset = float(scale), float(offset)
        self._encoder = None
        planes = self._planes()  # built here, with the other programs: not in a slab's time
        if self.stored != np.float32 and planes:
            n = planes * self.plan.slab_depth * math.prod(self.plan.shape[1:])
            self._encoder = DeviceEncoder(self.ctx, self.queue, self.stored.name, n,
                                          self._scale, self._offset)  # fmt: skip

    def _planes(self) -> int:
        """How many filters' planes this convolver downloads itself (`_download`)."""
        return self.plan.n_filters

    @property
    def counts(self) -> tuple[int, int]:
        """uint8: the NaN voxels stored as 0 and the voxels clipped, over every slab so far
        converted to the stored type (on the device or the host)."""
        nans, clipped = self._host_counts
        if self._encoder is not None:
            nans, clipped = nans + self._encoder.nans, clipped + self._encoder.clipped
        return nans, clipped

    def _store_on_host(self, a: int, b: int, out: np.ndarray, **given: Any) -> np.ndarray:
        """Output rows ``[a, b)`` filtered in float32, then converted into ``out`` (of the
        stored type) on the host: for slabs whose non-finite voxels the host sets."""
        exact = self.convolve_slab(a, b, out=np.empty(out.shape, np.float32), **given)
        nans, clipped = encode(exact, out, self._scale, self._offset)
        self._host_counts = (self._host_counts[0] + nans, self._host_counts[1] + clipped)
        return out

    def _download(
        self, source: cl.Buffer, out: np.ndarray, targets: list[tuple[int, int]], plane: int
    ) -> list[cl.Event]:
        """Download planes of ``plane`` float32 values of ``source`` into ``out``: plane ``s``
        into ``out[f]`` for each ``(s, f)`` of ``targets`` (``s`` = 0, 1, ...), converted on
        the device first when ``out`` is of the stored type. Waits for them; returns the
        download events (their device seconds are the caller's; conversion's are
        ``timings["convert"]``)."""
        encoder, waits = None, []
        if out.dtype != np.float32:
            encoder = self._encoder
            converted, waits = encoder(source, len(targets) * plane)
            source = encoder.stored
        item = out.dtype.itemsize
        down = [
            cl.enqueue_copy(self.queue, out[f], source, src_offset=s * plane * item,
                            is_blocking=False)
            for s, f in targets
        ]  # fmt: skip
        cl.wait_for_events(down + waits)
        if encoder is not None:
            encoder.add_counts()
            self.timings["convert"] += device_seconds(converted)
        return down

    def slabs(self) -> Iterator[tuple[int, int]]:
        """Output row ranges ``[a, b)`` along axis 0, in order."""
        n0, depth = self.plan.shape[0], self.plan.slab_depth
        for a in range(0, n0, depth):
            yield a, min(a + depth, n0)

    def pinned_slab(self) -> np.ndarray:
        """A ``(N, slab_depth, ny, nz)`` array of the stored type (`store`; float32 by
        default) in page-locked host memory.

        Pass ``out=pinned[:, : b - a]`` to `convolve_slab`: downloads into pinned memory run
        at the bus's speed, into fresh pageable memory at a fraction of it (2.5 GB/s on the
        H100 node). The mapping lives as long as the array.
        """
        plan = self.plan
        shape = (plan.n_filters, plan.slab_depth, *plan.shape[1:])
        mf = cl.mem_flags
        size = self.stored.itemsize * math.prod(shape)
        buf = cl.Buffer(self.ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, size)
        flags = cl.map_flags.READ | cl.map_flags.WRITE
        array, _ = cl.enqueue_map_buffer(self.queue, buf, flags, 0, shape, self.stored)
        return array


@docfiller
class BankConvolver(SlabConvolver):
    """A planned, compiled bank convolution for volumes of one shape and type.

    Parameters
    ----------
    kernels : (N, kx, ky, kz) array
        The filters, applied as scipy.ndimage.convolve applies them.
    shape, dtype
        Shape and element type of the 3D volumes to filter.
    %(mode)s
    %(cval)s
    %(device)s
    plan
        A plan made by `volconv.plan.direct.make_plan` for this bank, shape and type on ``device``
        (the pipeline plans each input once and hands the plan over); default: plan here.
    **overrides
        Plan knobs (``slab_depth``, ``memory_budget``, ``unroll``, ``rows``, ``vector_width``,
        ``local_size``) when planning here; see `volconv.plan.direct.make_plan`.
    """

    engine = "fp32"  # the record's name of this engine
    plan_defaults: ClassVar[dict[str, object]] = {}  # an engine's own knobs (`plan_for`)
    tensor_gflop = 0.0  # no tensor-core work (`volconv.engines.tensor.TensorConvolver` has some)

    def __init__(
        self,
        kernels: object,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str = "reflect",
        cval: float = 0.0,
        *,
        device: cl.Device | str | None = None,
        plan: Plan | None = None,
        **overrides: object,
    ) -> None:
        bank = as_kernel_bank(kernels)
        mode, cval = check_mode(mode), check_cval(cval)
        check_volume_dtype(dtype)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"volume must be 3D and non-empty; got shape {tuple(shape)}")
        self.device = device if isinstance(device, cl.Device) else select_device(device)
        self.ctx, self.queue = context_for(self.device)
        src = native_volume(np.empty(0, dtype)).dtype
        shape = tuple(int(s) for s in shape)
        if plan is None:
            plan = self.plan_for(bank, shape, dtype, mode, cval, self.device, **overrides)
        elif (plan.shape, plan.extents, plan.n_filters, plan.src_dtype, plan.mode, plan.cval) != (
            shape,
            bank.shape[1:],
            bank.shape[0],
            src,
            mode,
            cval,
        ):
            raise ValueError("plan: made for another shape, bank, type or boundary")
        self.plan: Plan = plan
        self.kernels = bank
        self.timings = dict.fromkeys(STAGES, 0.0)
        self._override: NonFiniteOverride | None = None
        self._setup()

    @classmethod
    def plan_for(
        cls,
        bank: np.ndarray,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str,
        cval: float,
        device: cl.Device,
        **overrides: object,
    ) -> Plan:
        """The plan this engine makes for ``bank`` over volumes of ``shape`` and ``dtype`` on
        ``device`` (`volconv.plan.direct.make_plan` with ``overrides``): what its ``plan``
        parameter takes, so that a bank may be planned once and built later."""
        src = native_volume(np.empty(0, dtype)).dtype
        return make_plan(tuple(int(s) for s in shape), src, bank.shape[1:], bank.shape[0],
                         check_mode(mode), check_cval(cval), device,
                         **{**cls.plan_defaults, **overrides})  # fmt: skip

    # -- set-up ------------------------------------------------------------------------
    def _setup(self) -> None:
        plan, ctx = self.plan, self.ctx
        mf = cl.mem_flags
        self.padder = Padder(
            ctx, self.queue, plan.shape, plan.src_dtype, plan.pad_dtype, plan.halo_lo,
            plan.halo_hi, plan.mode, plan.cval, plan.padded_yz, plan.slab_depth,
            frame_bytes(self.device),
        )  # fmt: skip
        self._build_passes()
        sizes = plan.slab_bytes(plan.slab_depth)
        self._padded = cl.Buffer(ctx, mf.READ_WRITE, sizes["padded"])
        self._out = cl.Buffer(ctx, mf.WRITE_ONLY, sizes["responses"])

    def _build_passes(self) -> None:
        """Compile the kernel and upload the coefficients of every pass."""
        plan, ctx = self.plan, self.ctx
        mf = cl.mem_flags
        # The kernel correlates, so it gets each filter flipped; lanes beyond a pass's
        # filters stay zero. Layout (taps, width) matches the kernel's vecf array.
        flipped = self.kernels[:, ::-1, ::-1, ::-1].reshape(plan.n_filters, -1)
        self._passes = []
        for p in plan.passes:
            coeffs = np.zeros((flipped.shape[1], p.width), np.float32)
            coeffs[:, : p.count] = flipped[p.first : p.first + p.count].T
            buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=coeffs)
            defines = tuple(plan.build_options(p).items())
            self._passes.append(
                (p, cl.Kernel(build(ctx, "bank_conv.cl", defines), "bank_conv"), buf)
            )

    # -- slabs -------------------------------------------------------------------------
    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows (axis 0) that output rows ``[a, b)`` read."""
        return self.padder.source_rows(a, b)

    def convolve_slab(
        self,
        a: int,
        b: int,
        rows: np.ndarray | None = None,
        out: np.ndarray | None = None,
        *,
        frame: np.ndarray | None = None,
    ) -> np.ndarray:
        """Responses ``(N, b - a, ny, nz)`` of output rows ``[a, b)``.

        ``rows`` holds the volume at `source_rows(a, b)`, in that order; or ``frame`` holds
        the whole 3D volume, in any layout (C order or x-fastest of the source type is
        uploaded as it is, without a host transpose; on a GPU it is uploaded at its first
        slab and kept while the same array object comes back, so do not change it between
        slabs). ``out``, if given, is a float32 array
        of that shape (or a view with contiguous filter planes), or one of the stored type
        (`store`), which is the default. Non-finite voxels reach the outputs their kept taps
        reach, as in scipy.
        """
        plan = self.plan
        ny, nz = plan.shape[1:]
        if not 0 <= a < b <= plan.shape[0] or b - a > plan.slab_depth:
            raise ValueError(
                f"[a, b) = [{a}, {b}) is not a slab of at most {plan.slab_depth} rows in "
                f"[0, {plan.shape[0]})"
            )
        shape = (plan.n_filters, b - a, ny, nz)
        out = np.empty(shape, self.stored) if out is None else check_out(out, shape, self.stored)
        rows = slab_rows(a, b, self.source_rows(a, b), plan.shape, plan.src_dtype, rows, frame)
        if rows is None:  # the frame uploads as it is: an integer type, never non-finite
            return self._convolve(a, b, out, frame=frame)
        if not has_nonfinite(rows):
            return self._convolve(a, b, out, rows=rows)
        if out.dtype != np.float32:
            return self._store_on_host(a, b, out, rows=rows)
        self._convolve(a, b, out, rows=finite_part(rows))
        for stage, seconds in self._nonfinite().apply(a, b, rows, out).items():
            self.timings[stage] += seconds
        return out

    def _nonfinite(self) -> NonFiniteOverride:
        """The override, built at the first slab holding NaN or Inf: finite volumes never
        compile or allocate it."""
        if self._override is None:
            plan = self.plan

            def counting(supports: np.ndarray) -> BankConvolver:
                return BankConvolver(supports, plan.shape, np.uint8, plan.mode, 0.0,
                                     device=self.device, slab_depth=plan.slab_depth)  # fmt: skip

            self._override = NonFiniteOverride(self.kernels, counting)
        return self._override

    def _convolve(
        self,
        a: int,
        b: int,
        out: np.ndarray,
        rows: np.ndarray | None = None,
        frame: np.ndarray | None = None,
    ) -> np.ndarray:
        """Upload, pad, filter (convert) and download one slab."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        depth = b - a
        t_up, t_pad = self.padder(a, b, self._padded, rows=rows, frame=frame)
        t_conv = self._launch_passes(depth)
        targets = [(f, f) for f in range(plan.n_filters)]
        t_down = self._download(self._out, out, targets, depth * ny * nz)
        for stage, events in (("upload", t_up), ("pad", [t_pad]), ("kernel", t_conv),
                              ("download", t_down)):  # fmt: skip
            self.timings[stage] += device_seconds(events)
        return out

    def _launch_passes(self, depth: int) -> list[cl.Event]:
        """Enqueue one bank_conv launch per pass over the padded slab of ``depth`` rows."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        events = []
        for p, knl, coeffs in self._passes:
            block = plan.block(p)
            lz, ly, _ = block.local_size
            gz = -(-nz // block.unroll)
            gy = -(-ny // block.rows)
            glob = (-(-gz // lz) * lz, -(-gy // ly) * ly, depth)
            knl.set_args(
                self._padded, self._out, coeffs, np.int32(depth), np.int32(ny), np.int32(nz),
                np.int32(p1), np.int32(p2), np.int64(depth * ny * nz), np.int32(p.first),
                np.int32(p.count),
            )  # fmt: skip
            events.append(cl.enqueue_nd_range_kernel(self.queue, knl, glob, (lz, ly, 1)))
        return events

    def time_kernel(self, a: int, b: int, repeats: int = 10) -> np.ndarray:
        """Seconds of the bank passes alone for output rows ``[a, b)``, once per repeat.

        Re-launches the passes over the padded slab the last `convolve_slab` (for the same
        ``[a, b)``) left on the device; for benchmarks, which time the kernel apart from I/O.
        """
        seconds = np.empty(repeats)
        for r in range(repeats):
            events = self._launch_passes(b - a)
            cl.wait_for_events(events)
            seconds[r] = device_seconds(events)
        return seconds

    @property
    def executed_gflop(self) -> float:
        """What the kernel computes for one volume: every filter at the bank's common extent
        (`volconv.report.work_gflop`; the useful work counts each filter's own extent)."""
        plan = self.plan
        return work_gflop([plan.extents] * plan.n_filters, math.prod(plan.shape))


@docfiller
def convolve_bank(
    volume: np.ndarray,
    kernels: object,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device | str | None = None,
    slab_depth: int | None = None,
    memory_budget: int | None = None,
    **overrides: object,
) -> np.ndarray:
    """Apply a bank of N kernels to a volume, each exactly as scipy.ndimage.convolve does.

    Parameters
    ----------
    volume : (x, y, z) or (x, y, z, t) array
        Any real dtype; uint8, int8, uint16, int16 and float32 are read as they are, others
        converted to float32. A 4D volume is filtered as t independent 3D volumes. NaN and
        +-Inf voxels propagate as in scipy, which leaves out taps of zero weight.
    kernels : (N, kx, ky, kz) array
        1 <= N <= 64 filters, extents 1..31 (odd or even), centred as scipy centres them.
    %(mode)s
    %(cval)s
    %(device)s
    slab_depth, memory_budget
        Force the slab depth along axis 0, or bound the device memory used (bytes).

    Returns
    -------
    (N, *volume.shape) float32 array
    """
    if not isinstance(volume, np.ndarray):
        raise TypeError(f"volume must be a numpy array; got {type(volume).__name__}")
    check_volume_dtype(volume.dtype)
    if volume.ndim not in (3, 4):
        raise ValueError(f"volume must be 3D or 4D; got shape {volume.shape}")
    if slab_depth is not None:
        check_positive_int(slab_depth, "slab_depth")
    conv = BankConvolver(
        kernels, volume.shape[:3], volume.dtype, mode, cval, device=device,
        slab_depth=slab_depth, memory_budget=memory_budget, **overrides,
    )  # fmt: skip
    out = np.empty((conv.plan.n_filters, *volume.shape), np.float32)
    frames = [volume] if volume.ndim == 3 else [volume[..., t] for t in range(volume.shape[3])]
    for t, frame in enumerate(frames):
        target = out if volume.ndim == 3 else None
        for a, b in conv.slabs():
            if target is not None:
                conv.convolve_slab(a, b, frame[conv.source_rows(a, b)], target[:, a:b])
            else:
                out[:, a:b, ..., t] = conv.convolve_slab(a, b, frame[conv.source_rows(a, b)])
    return out
