"""Boundary modes and centring, exactly as scipy.ndimage.convolve applies them.

scipy's convolve flips the kernel and shifts the origin of even extents, so along an axis of
kernel extent ``k`` the output ``out[i] = sum_j w[j] * in[i + k // 2 - j]``. With the flipped
kernel that is a correlation over the input extended by ``k - 1 - k // 2`` samples before and
``k // 2`` after. The extension follows scipy's rules for any overhang, also one longer than
the axis (a 1-voxel axis under a 7-tap kernel).
"""

from __future__ import annotations

import numpy as np

from volconv.checks import check_mode


def halo(extent: int) -> tuple[int, int]:
    """Samples needed before and after an output along an axis of kernel ``extent``."""
    return extent - 1 - extent // 2, extent // 2


def extend_indices(n: int, start: int, stop: int, mode: str) -> np.ndarray:
    """Source index for each position ``start <= p < stop`` of an axis of length ``n``.

    Positions outside ``[0, n)`` are folded back by ``mode``; ``-1`` marks a position whose
    value is ``cval`` (constant mode).
    """
    check_mode(mode)
    p = np.arange(start, stop, dtype=np.int64)
    if mode == "constant":
        return np.where((p >= 0) & (p < n), p, -1)
    if mode == "nearest":
        return np.clip(p, 0, n - 1)
    if mode == "wrap":
        return np.mod(p, n)
    if mode == "reflect":  # d c b a | a b c d | d c b a: period 2n
        q = np.mod(p, 2 * n)
        return np.where(q < n, q, 2 * n - 1 - q)
    # mirror: d c b | a b c d | c b a: period 2n - 2 (a 1-voxel axis is constant)
    if n == 1:
        return np.zeros_like(p)
    q = np.mod(p, 2 * n - 2)
    return np.where(q < n, q, 2 * n - 2 - q)


def sources(indices: np.ndarray) -> np.ndarray:
    """The sorted distinct source indices (``>= 0``) of `extend_indices`'s result: what a slab
    reads. ``np.unique`` would do, but its first call imports ``numpy.ma`` (60 ms on a node)."""
    return np.flatnonzero(np.bincount(indices[indices >= 0]))
