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

The counts run over sub-slabs of the slab that hold at most `APPLY_BYTES` of host memory
(`OverridePlan.host_bytes`, which `volconv.run.memory.host_bytes` counts), one kind of voxel and
one counting convolver at a time, and only where the sub-slab's rows hold that kind.

Any convolver with the slab interface (output rows ``[a, b)``, their source rows in order)
uses it the same way, giving it a factory of counting convolvers for its slab geometry;
finite slabs never reach it::

    if has_nonfinite(rows):
        out = convolve(a, b, finite_part(rows))
        override.apply(a, b, rows, out)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# The host memory `NonFiniteOverride.apply` holds at a time, where one output row of its
# counts fits: it counts a slab in sub-slabs of as many rows as this holds
# (`OverridePlan.depth`), so that a deeper slab, or a larger bank, costs no more
# (`OverridePlan.host_bytes` counts it, for `volconv.run.memory.host_bytes`).
APPLY_BYTES = 16 * 2**20


class SlabConvolver(Protocol):
    """What the counts need of a convolver: the slab interface, its geometry (``plan.shape``,
    ``plan.slab_depth``) and its device seconds."""

    plan: Any
    timings: dict[str, float]

    def source_rows(self, a: int, b: int) -> np.ndarray: ...

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


def _distinct(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct non-empty masks, and each mask's index among them (-1: empty)."""
    flat = masks.reshape(len(masks), -1)
    supports, index = np.unique(flat, axis=0, return_inverse=True)
    keep = supports.any(axis=1)
    renumber = np.where(keep, np.cumsum(keep) - 1, -1)
    return supports[keep].reshape(-1, *masks.shape[1:]), renumber[index.ravel()]


@dataclass(frozen=True)
class OverridePlan:
    """The counts a bank's override runs, and what they hold, without building anything.

    Distinct supports only: a bank of Gaussians shares one. The signed supports count the
    infinities, their unions the NaNs (``union`` None: the same supports); each bank of
    counting kernels is at most as wide as the bank (`banks`).
    """

    pos: np.ndarray  # per filter: its support of positive taps among `signed` (-1: none)
    neg: np.ndarray  # the same for its negative taps
    kept: np.ndarray  # per filter: its support among `union` (or `signed`)
    signed: np.ndarray  # (S, kx, ky, kz) bool
    union: np.ndarray | None  # (U, kx, ky, kz) bool; None: the same as `signed`

    @classmethod
    def of(cls, kernels: np.ndarray) -> OverridePlan:
        """The plan of the bank ``kernels`` (N, kx, ky, kz), as the convolver applies it."""
        pos, neg = kept_taps(kernels)
        n = len(pos)
        signed, index = _distinct(np.concatenate([pos, neg]))
        union, kept = _distinct(pos | neg)
        same = np.array_equal(union, signed)
        return cls(index[:n], index[n:], kept, signed, None if same else union)

    @property
    def n_filters(self) -> int:
        return len(self.pos)

    def _cut(self, supports: np.ndarray) -> list[np.ndarray]:
        """``supports`` as 0/1 banks of at most `n_filters` (and the direct kernel's
        MAX_FILTERS), one per counting convolver."""
        from volconv.plan.direct import MAX_FILTERS

        n = min(self.n_filters, MAX_FILTERS)
        return [supports[i : i + n] for i in range(0, len(supports), n)]

    @property
    def signed_banks(self) -> list[np.ndarray]:
        return self._cut(self.signed)

    @property
    def union_banks(self) -> list[np.ndarray]:
        """None where the unions are the signed supports."""
        return [] if self.union is None else self._cut(self.union)

    @property
    def banks(self) -> list[np.ndarray]:
        """Every counting convolver's 0/1 bank."""
        return self.signed_banks + self.union_banks

    def host_bytes(self, shape: tuple[int, int, int], depth: int, itemsize: int) -> int:
        """The most host memory `NonFiniteOverride.apply` holds at a time for sub-slabs of
        ``depth`` output rows of a volume of ``shape`` whose voxels take ``itemsize`` bytes:
        the sub-slab's source rows and one kind's marks over them; the reach of each kind
        (+inf, -inf over the signed supports, NaN over the unions), one counting convolver's
        float32 counts, and the masks of one filter, over its output rows."""
        n0, ny, nz = shape
        signed = len(self.signed)
        union = signed if self.union is None else len(self.union)
        widest = max((len(b) for b in self.banks), default=0)
        rows = min(n0, depth + self.signed.shape[1] - 1) if signed else 0
        per_row = 2 * signed + union + 4 * widest + 6  # bytes per output voxel
        return ny * nz * (rows * (itemsize + 1) + depth * per_row)

    def depth(
        self, shape: tuple[int, int, int], slab_depth: int, itemsize: int, budget: int
    ) -> int:
        """The rows of the sub-slabs `NonFiniteOverride.apply` counts at a time: as many as
        ``budget`` bytes hold (`host_bytes`), at least one, at most ``slab_depth``."""
        one = self.host_bytes(shape, 1, itemsize)
        more = self.host_bytes(shape, 2, itemsize) - one  # each output row more
        return max(1, min(slab_depth, 1 + (budget - one) // max(more, 1)))


class _Reach:
    """Which outputs of a slab each of S 0/1 supports reaches from the voxels a mask marks."""

    def __init__(self, banks: list[np.ndarray], make: CountingFactory) -> None:
        self.convolvers = [make(bank.astype(np.float64)) for bank in banks]
        self.n_supports = sum(len(bank) for bank in banks)

    def __call__(self, a: int, b: int, marks: np.ndarray, spent: dict[str, float]) -> np.ndarray:
        """Boolean ``(S, b - a, ny, nz)``: whether any marked voxel lies under each support.
        Adds the device seconds per stage into ``spent``."""
        rows = marks.view(np.uint8)
        reached = np.empty((self.n_supports, b - a, *marks.shape[1:]), bool)
        first = 0
        for c in self.convolvers:
            before = dict(c.timings)
            counts = c.convolve_slab(a, b, rows)
            np.greater(counts, 0, out=reached[first : first + len(counts)])
            first += len(counts)
            del counts  # one convolver's counts at a time
            for stage, seconds in c.timings.items():
                spent[stage] = spent.get(stage, 0.0) + seconds - before[stage]
        return reached


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
    budget : int
        The host bytes `apply` holds at a time, where one output row fits (`OverridePlan`).
    """

    def __init__(
        self, kernels: np.ndarray, make: CountingFactory, budget: int = APPLY_BYTES
    ) -> None:
        self.plan = plan = OverridePlan.of(kernels)
        self.budget = budget
        self.n_filters = plan.n_filters
        self._signed = _Reach(plan.signed_banks, make) if len(plan.signed) else None
        if plan.union is None:
            self._union = self._signed
        else:
            self._union = _Reach(plan.union_banks, make) if len(plan.union) else None

    def apply(self, a: int, b: int, rows: np.ndarray, out: np.ndarray) -> dict[str, float]:
        """Override ``out`` (N, b - a, ny, nz), the finite part of output rows ``[a, b)``.

        ``rows`` are the source rows of ``[a, b)`` as the convolver read them, non-finite
        voxels included. The counts run over sub-slabs of `OverridePlan.depth` rows, each
        only where its rows hold a non-finite voxel of that kind. Returns the device seconds
        the counts took, per stage.
        """
        spent: dict[str, float] = {}
        if self._signed is None:  # no filter keeps a tap: nothing is reached
            return spent
        geometry = self._signed.convolvers[0]
        needed = geometry.source_rows(a, b)
        if len(needed) != len(rows):
            raise ValueError(f"rows: expected the {len(needed)} source rows of [{a}, {b})")
        plan = geometry.plan
        step = self.plan.depth(plan.shape, plan.slab_depth, rows.dtype.itemsize, self.budget)
        for c in range(a, b, step):
            d = min(c + step, b)
            sub = rows[np.searchsorted(needed, geometry.source_rows(c, d))]
            self._override(c, d, sub, out[:, c - a : d - a], spent)
        return spent

    def _override(
        self, a: int, b: int, rows: np.ndarray, out: np.ndarray, spent: dict[str, float]
    ) -> None:
        """`apply` on one sub-slab: ``out`` is its view of the caller's responses."""
        reach: dict[str, np.ndarray] = {}
        for kind, marked, counter in (
            ("+inf", np.isposinf, self._signed),
            ("-inf", np.isneginf, self._signed),
            ("nan", np.isnan, self._union),
        ):
            marks = marked(rows)
            if counter is not None and marks.any():
                reach[kind] = counter(a, b, marks, spent)
            del marks  # one kind's marks at a time
        if not reach:
            return
        none = np.zeros(out.shape[1:], bool)

        def reached(kind: str, index: int) -> np.ndarray:
            return reach[kind][index] if kind in reach and index >= 0 else none

        for f in range(self.n_filters):
            p, m = self.plan.pos[f], self.plan.neg[f]
            plus = reached("+inf", p) | reached("-inf", m)
            minus = reached("-inf", p) | reached("+inf", m)
            nan = reached("nan", self.plan.kept[f]) | (plus & minus)
            out[f][plus] = np.inf
            out[f][minus] = -np.inf
            out[f][nan] = np.nan
