"""The stored types, defined once: float32 responses as float16 or scaled uint8 (docs/contract.md).

- float16 saturates finite values at +-65504 (numpy's round to nearest even below); +-inf
  and NaN stay as they are.
- uint8 stores ``clip(rint((value - offset) / scale), 0, 255)`` computed in float32, NaN as 0;
  the voxels clipped and the NaNs are counted (the run warns once).

`output_scale` chooses uint8's scale and offset for ``[output] scale = "auto"``.
`encode` is the reference, on the host. `DeviceEncoder` makes the same bytes on the device
(kernels/convert.cl) before the download, so that downloads, page-locked buffers and the host
carry the stored type only; its counts are exact (integer atomics). Tests check the two
bitwise against each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.device.programs import build

if TYPE_CHECKING:
    from volconv.config import Config
    from volconv.run.volume import Volume

FLOAT16_MAX = float(np.finfo(np.float16).max)
GROUP, PER_ITEM = 256, 16  # to_uint8's work-group size and values per work-item (convert.cl)
CALL = 2**30  # values a kernel call converts at most: its counts fit a uint


def response_bounds(kernels: np.ndarray, lo: float, hi: float) -> tuple[float, float]:
    """The least and greatest value any response of ``kernels`` (N, ...) can take over
    data within ``[lo, hi]``: each kernel's positive taps times one end of the range plus its
    negative taps times the other (for a kernel of one sign, sum(|kernel|) times the range)."""
    k = np.asarray(kernels, np.float64).reshape(len(kernels), -1)
    pos, neg = np.clip(k, 0, None).sum(axis=1), np.clip(k, None, 0).sum(axis=1)
    return float(np.min(pos * lo + neg * hi)), float(np.max(pos * hi + neg * lo))


def data_range(volume: Volume) -> tuple[float, float]:
    """The range of ``volume``'s voxels: its type's for integers (nothing read), the finite
    values' for floats (read once, in blocks of rows); (0, 0) where none is finite."""
    if volume.dtype.kind in "iu":
        info = np.iinfo(volume.dtype)
        return float(info.min), float(info.max)
    lo, hi = np.inf, -np.inf
    row_bytes = max(1, int(np.prod(volume.shape[1:3])) * volume.dtype.itemsize)
    step = max(1, 2**26 // row_bytes)
    for t in range(volume.n_frames):
        for a in range(0, volume.shape[0], step):
            rows = volume.read_rows(np.arange(a, min(a + step, volume.shape[0])), t)
            finite = rows[np.isfinite(rows)]
            if finite.size:
                lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    return (lo, hi) if lo <= hi else (0.0, 0.0)


def output_scale(cfg: Config, volume: Volume, kernels: np.ndarray) -> tuple[float, float]:
    """uint8's ``(scale, offset)`` for ``volume``'s output: ``output.scale`` and
    ``output.offset`` as given, or, for ``scale = "auto"``, the bounds of every response
    over the input's range (`data_range`; with ``boundary = "constant"``, cval too) mapped
    onto 0..255, so that no finite response saturates; one pair for the whole file.
    (1, 0) for float outputs."""
    if cfg.dtype != "uint8":
        return 1.0, 0.0
    if not cfg.scale_auto:
        return cfg.scale, cfg.offset
    lo, hi = data_range(volume)
    if cfg.boundary == "constant":
        lo, hi = min(lo, cfg.cval), max(hi, cfg.cval)
    least, most = response_bounds(kernels, lo, hi)
    offset = float(np.float32(least))
    # float32's rounding of the offset and of the responses stays far inside half a step
    scale = float(np.float32((most - offset) / 255))
    if not np.isfinite(scale) or scale < np.finfo(np.float32).tiny:
        return 1.0, offset  # every response is one value (or beyond float32): any scale
    return scale, offset


def encode(
    values: np.ndarray, out: np.ndarray, scale: float = 1.0, offset: float = 0.0
) -> tuple[int, int]:
    """Write float32 ``values`` into ``out`` (float16 or uint8, same shape) as stored.

    Returns
    -------
    nans, clipped : int
        uint8 only (0, 0 otherwise): NaN voxels stored as 0, and voxels saturated at 0 or 255.
    """
    values = np.asarray(values, np.float32)
    if out.dtype == np.float16:  # saturate finite values (inf stays inf)
        np.clip(values, -FLOAT16_MAX, FLOAT16_MAX, out=out, casting="unsafe")
        np.copyto(out, values, where=np.isinf(values), casting="unsafe")
        return 0, 0
    q = np.rint((values - np.float32(offset)) / np.float32(scale))
    nans = np.isnan(q)
    clipped = int(np.count_nonzero(q < 0) + np.count_nonzero(q > 255))
    np.clip(q, 0, 255, out=q)
    q[nans] = 0
    out[...] = q
    return int(np.count_nonzero(nans)), clipped


class DeviceEncoder:
    """Converts float32 device buffers into a stored type, on the device (kernels/convert.cl).

    Parameters
    ----------
    ctx, queue
        The convolver's context and (in-order) queue.
    dtype : {'float16', 'uint8'}
    n : int
        The most elements one call converts (sizes `stored`).
    scale, offset : float
        uint8's quantisation.
    call : int
        The most values one kernel call converts (`CALL`; fewer for tests).

    Attributes
    ----------
    stored : cl.Buffer
        ``n`` elements of the stored type: where each call writes.
    nans, clipped : int
        uint8: the counts of every call `add_counts` has seen.
    """

    def __init__(
        self,
        ctx: cl.Context,
        queue: cl.CommandQueue,
        dtype: str,
        n: int,
        scale: float = 1.0,
        offset: float = 0.0,
        call: int = CALL,
    ) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float16, np.uint8):
            raise ValueError(f"DeviceEncoder: dtype must be float16 or uint8; got {dtype}")
        if n < 1:
            raise ValueError(f"DeviceEncoder: at least 1 element; got {n}")
        self.queue, self.n = queue, n
        self.scale, self.offset = np.float32(scale), np.float32(offset)
        # correctly rounded division: (v - offset) / scale as numpy computes it in float32
        program = build(ctx, "convert.cl", (), ("-cl-fp32-correctly-rounded-divide-sqrt",))
        self._kernel = cl.Kernel(program, "to_" + self.dtype.name)
        mf = cl.mem_flags
        self.stored = cl.Buffer(ctx, mf.READ_WRITE, n * self.dtype.itemsize)
        self.call = min(call, CALL)
        pieces = -(-n // self.call)
        self._zero = np.zeros(2 * pieces, np.uint32)  # counts of each call, in order
        self._host_counts = np.zeros(2 * pieces, np.uint32)
        self._counts = cl.Buffer(ctx, mf.READ_WRITE, self._zero.nbytes)
        self.nans = self.clipped = 0

    def __call__(self, source: cl.Buffer, n: int) -> tuple[list[cl.Event], list[cl.Event]]:
        """Enqueue the conversion of the first ``n`` float32 values of ``source`` into
        `stored` (in calls of at most `CALL` values). Returns the conversion's events and the
        events to wait for before `add_counts` (the download of the counts)."""
        if not 0 < n <= self.n:
            raise ValueError(f"DeviceEncoder: 1..{self.n} elements a call; got {n}")
        events = []
        if self.dtype == np.uint8:
            cl.enqueue_copy(self.queue, self._counts, self._zero, is_blocking=False)
        for first in range(0, n, self.call):
            end = np.uint64(min(first + self.call, n))
            if self.dtype == np.float16:
                self._kernel.set_args(source, self.stored, np.uint64(first), end)
                size, group = int(end) - first, None
            else:
                self._kernel.set_args(source, self.stored, self._counts, np.uint64(first),
                                      end, self.scale, self.offset,
                                      np.uint32(first // self.call))  # fmt: skip
                size, group = -(-(int(end) - first) // (GROUP * PER_ITEM)) * GROUP, (GROUP,)
            events.append(cl.enqueue_nd_range_kernel(self.queue, self._kernel, (size,), group))
        if self.dtype == np.float16:
            return events, []
        return events, [cl.enqueue_copy(self.queue, self._host_counts, self._counts,
                                        is_blocking=False)]  # fmt: skip

    def add_counts(self) -> None:
        """Add the counts of the last call (its events done) into `nans` and `clipped`."""
        if self.dtype == np.uint8:
            self.nans += int(self._host_counts[0::2].sum(dtype=np.int64))
            self.clipped += int(self._host_counts[1::2].sum(dtype=np.int64))


def device_encodes(device: cl.Device, dtype: str) -> bool:
    """Whether responses of ``dtype`` are converted on ``device``: float16 always (integer
    arithmetic); uint8 where the device divides float32 correctly rounded on request, as
    numpy does (float32 needs no conversion)."""
    if dtype == "float16":
        return True
    return dtype == "uint8" and bool(
        device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT
    )
