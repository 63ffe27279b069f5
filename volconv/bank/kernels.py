"""The generated kernels' arithmetic, as scipy.ndimage computes it: the 1D Gaussian and its
derivatives, 3D Gaussians, Gabor pairs, and each as a sum of separable terms
(`volconv.bank.factor.Term`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

import numpy as np

from volconv.bank.factor import Term, term


def gaussian_kernel1d(sigma: float, order: int, radius: int) -> np.ndarray:
    """scipy.ndimage's 1D Gaussian, or its ``order``-th derivative (0..2), on -radius..radius.

    ``gaussian_filter1d`` correlates with this array reversed, i.e. convolves with it as it is.
    """
    x = np.arange(-radius, radius + 1)
    s2 = sigma * sigma
    phi = np.exp(-0.5 / s2 * x**2)
    phi /= phi.sum()  # scipy normalises before differentiating
    # d^n/dx^n phi = q_n(x) phi(x): q_0 = 1, q_1 = -x / s2, q_2 = x^2 / s2^2 - 1 / s2
    q = (np.ones(x.shape), -x / s2, x * x / (s2 * s2) - 1 / s2)[order]
    return q * phi


def gaussian_kernel(
    sigma: Sequence[float], order: Sequence[int], size: Sequence[int]
) -> np.ndarray:
    """3D separable Gaussian (derivative): the outer product of `gaussian_kernel1d` per axis."""
    return reduce(
        np.multiply.outer,
        [gaussian_kernel1d(s, o, k // 2) for s, o, k in zip(sigma, order, size, strict=True)],
    )


def gabor_kernels(
    sigma: Sequence[float], wave: Sequence[float], phase: float, size: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Real and imaginary Gabor kernels, each of zero sum.

    ``sigma`` is the envelope's standard deviation and ``wave`` the wave vector (cycles per
    voxel along each axis), ``phase`` in radians. The DC term is removed Morlet's way, by
    subtracting the multiple of the envelope that cancels the sum: the filter stays localised,
    where subtracting the plain mean would leave a flat pedestal over the whole extent.
    """
    x = np.ogrid[tuple(slice(-(k // 2), k // 2 + 1) for k in size)]
    env = np.exp(-0.5 * sum((xa / sa) ** 2 for xa, sa in zip(x, sigma, strict=True)))
    env /= env.sum()
    theta = 2 * np.pi * sum(xa * wa for xa, wa in zip(x, wave, strict=True)) + phase
    parts = env * np.cos(theta), env * np.sin(theta)
    return tuple(p - p.sum() * env for p in parts)


def gabor_terms(
    sigma: Sequence[float], wave: Sequence[float], phase: float, size: Sequence[int]
) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """`gabor_kernels` as sums of separable terms: five each.

    The envelope is a product of per-axis Gaussians and the wave ``exp(i theta)`` a product of
    per-axis complex exponentials, so ``env * exp(i theta)`` is a product of three complex 1D
    factors; its real and imaginary parts expand into four real terms each, and the Morlet
    correction ``-sum * env`` adds one.
    """
    envs, waves = [], []
    for s, w, k in zip(sigma, wave, size, strict=True):
        x = np.arange(-(k // 2), k // 2 + 1)
        e = np.exp(-0.5 * (x / s) ** 2)
        envs.append(e / e.sum())
        waves.append(np.exp(2j * np.pi * w * x))
    waves[0] = waves[0] * np.exp(1j * phase)
    parts = [e * w for e, w in zip(envs, waves, strict=True)]  # complex factors per axis

    def expand(imag: bool) -> list[Term]:
        # Re/Im of p0 p1 p2 = sum over choices of re/im per axis, with i^(number of im) real
        out = []
        for picks in np.ndindex(2, 2, 2):
            n_im = sum(picks)
            if n_im % 2 != int(imag):
                continue
            sign = (-1.0) ** (n_im // 2)
            axes = (p.imag if q else p.real for p, q in zip(parts, picks, strict=True))
            out.append(term(sign, *axes))
        return out

    result = []
    for imag in (False, True):
        terms = expand(imag)
        total = sum(t.coef * math.prod(a.sum() for a in t.axes) for t in terms)
        result.append((*terms, term(-total, *envs)))
    return result[0], result[1]


def gaussian_terms(
    sigma: Sequence[float], order: Sequence[int], size: Sequence[int], coef: float = 1.0
) -> tuple[Term]:
    """`gaussian_kernel` as its one separable term."""
    axes = [gaussian_kernel1d(s, o, k // 2) for s, o, k in zip(sigma, order, size, strict=True)]
    return (term(coef, *axes),)
