"""Non-finite voxels (NaN, +Inf, -Inf) exactly as scipy.ndimage.convolve propagates them.

scipy keeps only the taps whose weight has ``|w| > DBL_EPSILON`` (the footprint NI_Correlate
builds; a tap of exactly DBL_EPSILON is left out, the next double up is kept), so a non-finite
voxel reaches an output only through kept taps, by IEEE rules: ``w * inf`` is +-inf by the sign
of ``w``, ``inf + -inf`` is NaN, NaN absorbs everything. With ``P = k > eps`` and
``M = k < -eps`` and indicator volumes ``I`` of each kind of non-finite voxel, the counts

    pos = conv(P, I[+inf]) + conv(M, I[-inf])
    neg = conv(P, I[-inf]) + conv(M, I[+inf])
    nan = conv(P | M, I[nan])

decide every output a non-finite voxel reaches: NaN where ``nan > 0`` or both ``pos`` and
``neg`` are, else +inf where ``pos > 0``, -inf where ``neg > 0``. Every other output is the
finite part: the slab with its non-finite voxels set to 0, filtered by the convolver's own path.
The counts run on the OpenCL engine (`BankConvolver` on uint8 indicator rows, 0/1 kernels, the
same extents, slab geometry and boundary, cval 0 since cval is finite); integers below 2^24
are exact in float32. A response thus never depends on the other filters of its bank (their
zero padding taps are left out) nor on the path that computed its finite part.

Any convolver with the slab interface (output rows ``[a, b)``, their source rows in order)
uses it the same way, giving it a factory of counting convolvers for its slab geometry;
finite slabs never reach it::

    if has_nonfinite(rows):
        out = convolve(a, b, finite_part(rows))
        override.apply(a, b, rows, out)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np


class SlabConvolver(Protocol):
    """What the counts need of a convolver: the slab interface and its device seconds."""

    timings: dict[str, float]

    def convolve_slab(self, a: int, b: int, rows: np.ndarray) -> np.ndarray: ...


# A convolver of uint8 rows by a bank of 0/1 kernels, with the caller's slab geometry and
# boundary mode (cval 0), e.g. ``lambda k: BankConvolver(k, shape, np.uint8, mode, 0.0, ...)``.
CountingFactory = Callable[[np.ndarray], SlabConvolver]

TAP_EPS = np.finfo(np.float64).eps  # scipy leaves out taps with |w| <= DBL_EPSILON


def kept_taps(kernels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks of the taps scipy keeps, by sign: ``(k > eps, k < -eps)``."""
    k = np.asarray(kernels, np.float64)
    return k > TAP_EPS, k < -TAP_EPS


def has_nonfinite(rows: np.ndarray) -> bool:
    """Whether ``rows`` hold NaN or +-Inf; integer rows never do (and are not scanned)."""
    return rows.dtype.kind == "f" and not np.isfinite(rows).all()


def finite_part(rows: np.ndarray) -> np.ndarray:
    """``rows`` with every non-finite voxel set to 0, in the same dtype."""
    return np.where(np.isfinite(rows), rows, rows.dtype.type(0))


class _Reach:
    """Which outputs of a slab each of S 0/1 supports reaches from the voxels a mask marks."""

    def __init__(self, supports: np.ndarray, chunk: int, make: CountingFactory) -> None:
        self.convolvers = [
            make(supports[i : i + chunk].astype(np.float64)) for i in range(0, len(supports), chunk)
        ]

    def __call__(self, a: int, b: int, marks: np.ndarray, spent: dict[str, float]) -> np.ndarray:
        """Boolean ``(S, b - a, ny, nz)``: whether any marked voxel lies under each support.
        Adds the device seconds per stage into ``spent``."""
        rows = marks.view(np.uint8)
        reached = []
        for c in self.convolvers:
            before = dict(c.timings)
            reached.append(c.convolve_slab(a, b, rows) > 0)
            for stage, seconds in c.timings.items():
                spent[stage] = spent.get(stage, 0.0) + seconds - before[stage]
        return np.concatenate(reached)


def _distinct(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct non-empty masks, and each mask's index among them (-1: empty)."""
    flat = masks.reshape(len(masks), -1)
    supports, index = np.unique(flat, axis=0, return_inverse=True)
    keep = supports.any(axis=1)
    renumber = np.where(keep, np.cumsum(keep) - 1, -1)
    return supports[keep].reshape(-1, *masks.shape[1:]), renumber[index.ravel()]


class NonFiniteOverride:
    """Sets the outputs that non-finite voxels reach, as scipy does, over a finite part.

    Parameters
    ----------
    kernels : (N, kx, ky, kz) float64 array
        The bank, exactly as the convolver applies it (unflipped, scipy's convolve order).
    make : CountingFactory
        Makes a counting convolver for a bank of at most N 0/1 kernels: uint8 volumes of the
        caller's shape, its slab depth (`apply` takes the same slabs ``[a, b)``) and boundary
        mode, cval 0 (cval is finite, so it never reaches the counts).
    """

    def __init__(self, kernels: np.ndarray, make: CountingFactory) -> None:
        pos, neg = kept_taps(kernels)
        self.n_filters = len(pos)
        # Distinct supports only: a bank of Gaussians shares one. Signed supports count the
        # infinities, their unions the NaNs; each bank of them is no wider than the convolver's.
        signed, index = _distinct(np.concatenate([pos, neg]))
        self._pos, self._neg = index[: self.n_filters], index[self.n_filters :]
        union, self._kept = _distinct(pos | neg)
        chunk = self.n_filters
        self._signed = _Reach(signed, chunk, make) if len(signed) else None
        if np.array_equal(union, signed):
            self._union = self._signed
        else:
            self._union = _Reach(union, chunk, make) if len(union) else None

    def apply(self, a: int, b: int, rows: np.ndarray, out: np.ndarray) -> dict[str, float]:
        """Override ``out`` (N, b - a, ny, nz), the finite part of output rows ``[a, b)``.

        ``rows`` are the source rows of ``[a, b)`` as the convolver read them, non-finite
        voxels included. Returns the device seconds the counts took, per stage.
        """
        spent: dict[str, float] = {}
        reach: dict[str, np.ndarray] = {}
        for kind, marks, counter in (
            ("+inf", rows == np.inf, self._signed),
            ("-inf", rows == -np.inf, self._signed),
            ("nan", np.isnan(rows), self._union),
        ):
            if counter is not None and marks.any():
                reach[kind] = counter(a, b, marks, spent)
        none = np.zeros(out.shape[1:], bool)

        def reached(kind: str, index: int) -> np.ndarray:
            return reach[kind][index] if kind in reach and index >= 0 else none

        for f in range(self.n_filters):
            p, m = self._pos[f], self._neg[f]
            plus = reached("+inf", p) | reached("-inf", m)
            minus = reached("-inf", p) | reached("+inf", m)
            nan = reached("nan", self._kept[f]) | (plus & minus)
            out[f][plus] = np.inf
            out[f][minus] = -np.inf
            out[f][nan] = np.nan
        return spent
