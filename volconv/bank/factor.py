"""Separable factors of 3D kernels: ``k = sum_t c_t * outer(a0_t, a1_t, a2_t)``.

A filter given as such a sum is convolved exactly (in real arithmetic) by 1D passes, one per
axis and term: scipy's convolve centres each axis at ``k // 2`` on its own, so the 3D
convolution of an outer product is the product of three 1D convolutions. Generated filters
carry their factors (`volconv.bank.filters`); any other kernel is tested here for low rank by a CP
decomposition (alternating least squares from the unfoldings' singular vectors) and, failing
that, by the exact rank of its unfoldings. A decomposition is kept only when it reproduces the
kernel within a quarter of SPEC.md's tolerance in every volume (`reconstruction_ok`) and its
terms do not cancel so much that float32 passes would lose that tolerance (`amplification`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

# SPEC.md: |stored - reference| <= SPEC_RTOL * sum(|kernel|) * max(|v|) + atol.
SPEC_RTOL = 1e-5
# Share of that tolerance a decomposition may use: sum|k - k_rec| * max|v| bounds the response
# error in any volume, which leaves three quarters for float32 rounding.
FACTOR_SHARE = 0.25
# Bound on sum_t |c_t| prod ||a_t||_1 / sum|k|: the float32 rounding of the passes scales with
# the terms' own magnitudes, so terms that cancel each other multiply it. The generated filters
# stay below 6 (a Gabor pair at Nyquist); 16 keeps the rounding 100x below the tolerance.
MAX_AMPLIFICATION = 16.0


@dataclass(frozen=True, eq=False)
class Term:
    """``coef * outer(axes[0], axes[1], axes[2])``, each factor a 1D float64 array oriented as
    the kernel is (convolution, not correlation)."""

    coef: float
    axes: tuple[np.ndarray, np.ndarray, np.ndarray]

    @property
    def extent(self) -> tuple[int, int, int]:
        return tuple(len(a) for a in self.axes)

    def array(self) -> np.ndarray:
        return self.coef * reduce(np.multiply.outer, self.axes)


def term(coef: float, *axes: Sequence[float]) -> Term:
    """A `Term` from a coefficient and three 1D factors (copied, float64, read-only)."""
    arrays = []
    for a in axes:
        arr = np.array(a, np.float64).reshape(-1)
        arr.flags.writeable = False
        arrays.append(arr)
    if len(arrays) != 3:
        raise ValueError(f"a term needs 3 factors; got {len(arrays)}")
    return Term(float(coef), tuple(arrays))


def reconstruct(terms: Sequence[Term]) -> np.ndarray:
    """The 3D kernel a sum of terms stands for."""
    return sum(t.array() for t in terms)


def amplification(kernel: np.ndarray, terms: Sequence[Term]) -> float:
    """How much larger the terms' magnitudes are than the kernel's: sum of
    ``|c_t| prod ||a_t||_1`` over ``sum |k|`` (1 for a single term; inf for a zero kernel)."""
    total = float(np.abs(kernel).sum())
    mags = sum(abs(t.coef) * math.prod(float(np.abs(a).sum()) for a in t.axes) for t in terms)
    return mags / total if total > 0 else (math.inf if mags > 0 else 1.0)


def reconstruction_ok(kernel: np.ndarray, terms: Sequence[Term]) -> bool:
    """Whether the terms reproduce ``kernel`` within `FACTOR_SHARE` of the SPEC tolerance and
    stay within `MAX_AMPLIFICATION`."""
    kernel = np.asarray(kernel, np.float64)
    if not terms or any(t.extent != kernel.shape for t in terms):
        return False
    err = float(np.abs(kernel - reconstruct(terms)).sum())
    bound = FACTOR_SHARE * SPEC_RTOL * float(np.abs(kernel).sum())
    return err <= bound and amplification(kernel, terms) <= MAX_AMPLIFICATION


def factorise(kernel: np.ndarray, max_terms: int = 8) -> tuple[Term, ...] | None:
    """The fewest separable terms (at most ``max_terms``) that reproduce ``kernel`` within
    `FACTOR_SHARE` of the SPEC tolerance, or None: then the kernel stays on the direct path.

    Tries CP decompositions of rank 1, 2, ... by alternating least squares, then the exact
    decomposition through the ranks of the unfoldings (which finds sums like the 7-point
    Laplacian, whose CP rank 3 ALS approaches only through diverging rank-2 terms).
    """
    k = np.asarray(kernel, np.float64)
    if k.ndim != 3:
        raise ValueError(f"kernel must be 3D; got shape {k.shape}")
    if not np.any(k):
        return (term(0.0, *(np.zeros(n) for n in k.shape)),)
    for rank in range(1, max_terms + 1):
        terms = _cp_als(k, rank)
        if reconstruction_ok(k, terms):
            return terms
    terms = _unfolding_terms(k)
    if terms is not None and len(terms) <= max_terms and reconstruction_ok(k, terms):
        return terms
    return None


def _leading_vectors(k: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """``rank`` leading left singular vectors of the mode-``axis`` unfolding (random columns
    beyond its size), as an (extent, rank) matrix."""
    unfold = np.moveaxis(k, axis, 0).reshape(k.shape[axis], -1)
    u = np.linalg.svd(unfold, full_matrices=False)[0]
    if u.shape[1] < rank:
        rng = np.random.default_rng(rank)
        u = np.hstack([u, rng.standard_normal((u.shape[0], rank - u.shape[1]))])
    return u[:, :rank]


def _cp_als(k: np.ndarray, rank: int, iterations: int = 400) -> tuple[Term, ...]:
    """A rank-``rank`` CP decomposition by alternating least squares."""
    f = [_leading_vectors(k, d, rank) for d in range(3)]
    scale = float(np.abs(k).sum())
    subscripts = ("ijk,jr,kr->ir", "ijk,ir,kr->jr", "ijk,ir,jr->kr")
    previous = math.inf
    for _ in range(iterations):
        for d in range(3):
            a, b = (f[e] for e in range(3) if e != d)
            gram = (a.T @ a) * (b.T @ b)
            f[d] = np.einsum(subscripts[d], k, a, b) @ np.linalg.pinv(gram)
        err = float(np.abs(k - np.einsum("ir,jr,kr->ijk", *f)).sum())
        if err <= 1e-3 * FACTOR_SHARE * SPEC_RTOL * scale or previous - err <= 1e-12 * scale:
            break
        previous = err
    terms = []
    for r in range(rank):
        cols = [f[d][:, r] for d in range(3)]
        norms = [float(np.abs(c).sum()) for c in cols]
        if min(norms) == 0:
            continue
        terms.append(term(math.prod(norms), *(c / n for c, n in zip(cols, norms, strict=True))))
    return tuple(terms)


def _unfolding_terms(k: np.ndarray) -> tuple[Term, ...] | None:
    """Exact terms from the SVD of the axis-0 unfolding, each right factor split by its own
    SVD: ``k = sum_i u_i (x) sum_j s_ij v_ij (x) w_ij`` with singular values below float64
    noise dropped."""
    kx, ky, kz = k.shape
    u, s, vt = np.linalg.svd(k.reshape(kx, ky * kz), full_matrices=False)
    eps = 1e-13 * (s[0] if s.size else 0.0)
    terms = []
    for i in np.flatnonzero(s > eps):
        u2, s2, vt2 = np.linalg.svd((s[i] * vt[i]).reshape(ky, kz), full_matrices=False)
        for j in np.flatnonzero(s2 > 1e-13 * s2[0]):
            terms.append(term(s2[j], u[:, i], u2[:, j], vt2[j]))
    return tuple(terms) or None
