"""The first device step of every engine: a slab's source rows, read in the type the kernels
take (`native_volume`), uploaded and extended by the boundary mode into the padded slab the
filters read (`Padder`, kernels/pad.cl).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from volconv.checks import as_float32
from volconv.device.programs import build
from volconv.engines.boundary import extend_indices, sources
from volconv.plan.direct import CL_TYPES

# kernels/pad.cl's pad_tiles: its tile's side and the work-items along its rows
PAD_TILE, PAD_ROWS = 32, 8


def native_volume(volume: np.ndarray) -> np.ndarray:
    """The volume in a type the kernels read: native byte order, else float32; a ValueError
    naming ``volume`` where a value is beyond float32's range."""
    dt = volume.dtype.newbyteorder("=")
    if dt in CL_TYPES:
        return volume.astype(dt, copy=False)
    if volume.dtype.kind == "b":
        return volume.astype(np.uint8)
    return as_float32(volume, "volume")


def frame_bytes(device: cl.Device) -> int:
    """The largest frame a `Padder` keeps on ``device``: a quarter of its memory within one
    allocation on a GPU; none on a CPU device, whose rows are host memory already."""
    if device.type & cl.device_type.CPU:
        return 0
    return min(device.max_mem_alloc_size, device.global_mem_size // 4)


def uploads_whole(frame: np.ndarray | None, src_dtype: np.dtype) -> bool:
    """Whether ``frame`` goes to the device as it is (`Padder`): integers (never non-finite)
    of the kernels' source type, in C order or x-fastest; else the caller gathers its rows."""
    return (
        frame is not None
        and frame.dtype.kind in "iu"
        and frame.dtype == src_dtype
        and (frame.flags.c_contiguous or frame.flags.f_contiguous)
    )


def slab_rows(
    a: int,
    b: int,
    needed: np.ndarray,
    shape: tuple[int, int, int],
    src_dtype: np.dtype,
    rows: np.ndarray | None,
    frame: np.ndarray | None,
) -> np.ndarray | None:
    """The ``needed`` source rows of output rows ``[a, b)`` as the kernels read them (native
    type, C order), checked; None where ``frame`` is given and uploads as it is."""
    if (rows is None) == (frame is None):
        raise ValueError("give the slab's source rows or the whole frame, one of them")
    if frame is not None:
        if frame.shape != tuple(shape):
            raise ValueError(f"frame: expected shape {tuple(shape)}; got {frame.shape}")
        if uploads_whole(frame, src_dtype):
            return None
        rows = frame[needed]
    rows = np.ascontiguousarray(native_volume(np.asarray(rows)), dtype=src_dtype)
    if rows.shape != (len(needed), *shape[1:]):
        raise ValueError(f"rows: expected the source rows of [{a}, {b}); got {rows.shape}")
    return rows


class Padder:
    """The first device step of every path: a slab's source rows uploaded and extended by the
    boundary mode into the padded slab the filters read (kernels/pad.cl), through scipy's
    index maps along each axis.

    The rows come either as an array of the slab's source rows in C order, or straight from a
    whole frame held in the file's own layout (C order, or x-fastest as NIfTI stores it):
    then each run of rows is uploaded by a (rectangular) copy and pad.cl gathers it through
    strides, so the host never transposes the volume.

    Parameters
    ----------
    ctx, queue
        The device's context and profiling queue.
    shape : (nx, ny, nz)
    src_dtype, pad_dtype
        The rows' element type, and the padded slab's.
    halo_lo, halo_hi : 3 ints
        Samples the filters read before and after an output along each axis.
    mode, cval
        The boundary mode and constant value.
    padded_yz : (P1, P2)
        The padded slab's extent along axes 1 and 2 (P2 may have an alignment tail).
    max_depth : int
        The deepest slab of output rows.
    frame_bytes : int
        The largest whole frame kept on the device: uploaded once, in one copy, and padded
        from there for every slab (a GPU: a rectangular copy from pageable memory goes row by
        row). 0 on a CPU device, whose rows are host memory already.
    """

    def __init__(
        self,
        ctx: cl.Context,
        queue: cl.CommandQueue,
        shape: tuple[int, int, int],
        src_dtype: np.dtype,
        pad_dtype: np.dtype,
        halo_lo: tuple[int, int, int],
        halo_hi: tuple[int, int, int],
        mode: str,
        cval: float,
        padded_yz: tuple[int, int],
        max_depth: int,
        frame_bytes: int = 0,
    ) -> None:
        self.ctx, self.frame_bytes = ctx, frame_bytes
        self._frame: np.ndarray | None = None  # the frame on the device, and its buffer
        self._frame_buf: cl.Buffer | None = None
        self.queue, self.shape, self.src_dtype = queue, shape, np.dtype(src_dtype)
        self.halo_lo, self.halo_hi, self.mode, self.cval = halo_lo, halo_hi, mode, cval
        self.padded_yz = padded_yz
        mf = cl.mem_flags
        defines = (("SRC_T", CL_TYPES[self.src_dtype]), ("DST_T", CL_TYPES[np.dtype(pad_dtype)]))
        self._rows = bool(ctx.devices[0].type & cl.device_type.CPU)  # a work-item a row
        tiles = (("PAD_TILE", PAD_TILE), ("PAD_ROWS", PAD_ROWS))
        defines += (("ROWS", 1),) if self._rows else tiles
        program = build(ctx, "pad.cl", defines)
        self._pad = cl.Kernel(program, "pad")
        self._tiles = None if self._rows else cl.Kernel(program, "pad_tiles")
        self._args: tuple = ()  # the kernel and its arguments as last set
        ny, nz = shape[1:]
        p2 = padded_yz[1]
        m1 = extend_indices(ny, -halo_lo[1], ny + halo_hi[1], mode)
        m2 = np.full(p2, -1, np.int64)
        m2[: nz + halo_lo[2] + halo_hi[2]] = extend_indices(nz, -halo_lo[2], nz + halo_hi[2], mode)
        self._m1 = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=m1.astype(np.int32))
        self._m2 = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=m2.astype(np.int32))
        reach = halo_lo[0] + halo_hi[0]
        rows_max = min(shape[0], max_depth + reach)
        self._src = cl.Buffer(ctx, mf.READ_ONLY, rows_max * ny * nz * self.src_dtype.itemsize)
        self._row_maps: dict[tuple[int, int, bool], tuple[int, cl.Buffer]] = {}

    def row_map(self, a: int, b: int) -> np.ndarray:
        """Source row (or -1: cval) of each padded row of output rows ``[a, b)``."""
        lo, hi = self.halo_lo[0], self.halo_hi[0]
        return extend_indices(self.shape[0], a - lo, b + hi, self.mode)

    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows (axis 0) that output rows ``[a, b)`` read."""
        m0 = self.row_map(a, b)
        return sources(m0)

    def __call__(
        self,
        a: int,
        b: int,
        padded: cl.Buffer,
        rows: np.ndarray | None = None,
        frame: np.ndarray | None = None,
    ) -> tuple[list[cl.Event], cl.Event]:
        """Enqueue the upload and padding of output rows ``[a, b)`` into ``padded``: from
        ``rows`` (the `source_rows`, C order) or from ``frame`` (the whole 3D volume, in
        C order or x-fastest, of `src_dtype`). Returns the upload events and the pad event."""
        ny, nz = self.shape[1:]
        whole = rows is None and frame.nbytes <= self.frame_bytes
        p0, m0 = self._row_map_buffer(a, b, whole)
        events: list[cl.Event] = []
        src = self._src
        if rows is not None:
            events.append(cl.enqueue_copy(self.queue, self._src, rows, is_blocking=False))
            strides = (ny * nz, nz, 1)
        elif whole:
            src, strides = self._upload_frame(frame, events)
        else:
            strides = self._upload_runs(frame, self.source_rows(a, b), events)
        p1, p2 = self.padded_yz
        # axis 0 the source's fastest (x-fastest) on a GPU: through tiles, both sides coalesced
        tiles = self._tiles is not None and strides[0] == 1 and strides[2] != 1
        kernel = self._tiles if tiles else self._pad
        args = (
            src, padded, m0, self._m1, self._m2,
            np.int32(p0), np.int32(p1), np.int32(p2), *map(np.int64, strides),
            np.float32(self.cval), np.int32(self.halo_lo[2]), np.int32(self.shape[2]),
        )  # fmt: skip
        if (kernel, *args) != self._args:  # a slab's differ at most in its rows: set once
            kernel.set_args(*args)
            self._args = (kernel, *args)
        if tiles:
            t, r = PAD_TILE, PAD_ROWS
            glob, local = (-(-p2 // t) * t, p1 * r, -(-p0 // t)), (t, r, 1)
        else:
            glob, local = (1 if self._rows else p2, p1, p0), None
        pad = cl.enqueue_nd_range_kernel(self.queue, kernel, glob, local)
        return events, pad

    def _row_map_buffer(self, a: int, b: int, whole: bool) -> tuple[int, cl.Buffer]:
        """The padded rows of output rows ``[a, b)`` and pad.cl's map of them on the device:
        rows of the whole frame (``whole``: it is on the device) or of the uploaded source
        rows. Made once per slab and kept (the volumes of a batch share them): no upload of
        its own before each slab's pad."""
        key = (a, b, whole)
        if (kept := self._row_maps.get(key)) is None:
            m0 = self.row_map(a, b)
            local = m0 if whole else np.where(m0 >= 0, np.searchsorted(sources(m0), m0), -1)
            kept = len(m0), cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                      hostbuf=local.astype(np.int32))  # fmt: skip
            self._row_maps[key] = kept
        return kept

    def _upload_frame(self, frame: np.ndarray, events: list) -> tuple[cl.Buffer, tuple]:
        """The whole ``frame`` on the device (uploaded at its first slab, in one copy of its
        own layout), and the element strides pad.cl reads it with."""
        if self._frame is not frame:
            if self._frame_buf is None or self._frame_buf.size < frame.nbytes:
                self._frame_buf = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, frame.nbytes)
            flat = frame.reshape(-1, order="C" if frame.flags.c_contiguous else "F")
            events.append(cl.enqueue_copy(self.queue, self._frame_buf, flat, is_blocking=False))
            self._frame = frame
        nx, ny, nz = self.shape
        strides = (ny * nz, nz, 1) if frame.flags.c_contiguous else (1, nx, nx * ny)
        return self._frame_buf, strides

    def _upload_runs(self, frame: np.ndarray, needed: np.ndarray, events: list) -> tuple:
        """Copy each run of consecutive ``needed`` rows of ``frame`` to the device, keeping
        its layout; the element strides pad.cl reads it with."""
        nx, ny, nz = self.shape
        n, item = len(needed), self.src_dtype.itemsize
        breaks = np.flatnonzero(np.diff(needed) != 1) + 1
        starts = np.concatenate([[0], breaks])
        stops = np.concatenate([breaks, [n]])
        for k0, k1 in zip(starts.tolist(), stops.tolist(), strict=True):
            r0, r1 = int(needed[k0]), int(needed[k0]) + k1 - k0
            if frame.flags.c_contiguous:
                events.append(cl.enqueue_copy(self.queue, self._src, frame[r0:r1],
                                              dst_offset=k0 * ny * nz * item,
                                              is_blocking=False))  # fmt: skip
            else:  # x-fastest: a rectangle of (rows, ny, nz) out of (nx, ny, nz)
                events.append(cl.enqueue_copy(
                    self.queue, self._src, frame, buffer_origin=(k0 * item, 0, 0),
                    host_origin=(r0 * item, 0, 0), region=((r1 - r0) * item, ny, nz),
                    buffer_pitches=(n * item, n * ny * item),
                    host_pitches=(nx * item, nx * ny * item), is_blocking=False,
                ))  # fmt: skip
        return (ny * nz, nz, 1) if frame.flags.c_contiguous else (1, n, n * ny)
