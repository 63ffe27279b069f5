"""Feature presets: ilastik's pixel-classification features and scikit-image's
``multiscale_basic_features``, each expanded into named `Feature`s (``[bank] preset``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from volconv.bank.factor import term
from volconv.bank.features import (
    AXES,
    PAIRS,
    Feature,
    _fail,
    _order,
    gaussian_filter_of,
    radius,
)
from volconv.bank.filters import Filter
from volconv.bank.kernels import gaussian_kernel1d
from volconv.bank.spec import BankError
from volconv.plan.direct import MAX_SEPARABLE_EXTENT

PRESETS = ("ilastik", "skimage")


def preset_features(preset: object, scales: object) -> list[Feature]:
    """The features a ``[bank] preset`` stands for."""
    if preset == "ilastik":
        if scales is None:
            scales = list(ILASTIK_SCALES)
        if (
            not isinstance(scales, list | tuple)
            or not scales
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                and v > 0 for v in scales
            )
        ):  # fmt: skip
            raise _fail("bank.scales", "a list of numbers > 0 (ilastik's sigmas)", scales)
        if len(set(map(float, scales))) != len(scales):
            raise _fail("bank.scales", "distinct numbers", scales)
        return ilastik_features([float(v) for v in scales])
    if preset == "skimage":
        if scales is not None:
            raise BankError('bank.scales: the "skimage" preset takes its own sigmas')
        return skimage_features()
    raise _fail("bank.preset", f"one of {', '.join(PRESETS)}", preset)


# -- ilastik's pixel-classification features --------------------------------------------------
# As ilastik computes them: lazyflow/operators/opPixelFeaturesPresmoothed.py (OpPixelFeatures-
# Presmoothed.setupOutputs, execute) and lazyflow/operators/filterOperators.py (the operators'
# window sizes) in the ilastik/ilastik repository. The features, in this order, each at every
# scale s (channels: feature-major); the names are ilastik's channel names.
ILASTIK_FEATURES = (
    ("GaussianSmoothing", "Gaussian Smoothing"),
    ("LaplacianOfGaussian", "Laplacian of Gaussian"),
    ("GaussianGradientMagnitude", "Gaussian Gradient Magnitude"),
    ("DifferenceOfGaussians", "Difference of Gaussians"),
    ("StructureTensorEigenvalues", "Structure Tensor Eigenvalues"),
    ("HessianOfGaussianEigenvalues", "Hessian of Gaussian Eigenvalues"),
)
SIGMA = "\N{GREEK SMALL LETTER SIGMA}"
ILASTIK_SCALES = (0.3, 0.7, 1.0, 1.6, 3.5, 5.0, 10.0)  # the scales ilastik's dialog offers
# Every feature runs on the input presmoothed by a Gaussian of sqrt(s^2 - 1) for s > 1 (of s
# itself for s <= 1) with window 3.5 (OpPixelFeaturesPresmoothed.WINDOW_SIZE), then at scale
# min(s, 1) with window 2 (OpBaseFilter.window_size_feature); vigra's radius is
# int(window * sigma + 0.5), scipy's truncate. DoG's second sigma is 0.66 of the first, the
# structure tensor's outer scale 0.5 of its inner one.
ILASTIK_PRESMOOTH_WINDOW = 3.5
ILASTIK_WINDOW = 2.0
ILASTIK_DOG = 0.66
ILASTIK_OUTER = 0.5


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """A centred odd 1D factor zero-padded to odd length ``n`` (its centre kept)."""
    pad = (n - len(a)) // 2
    return np.pad(a, pad)


def ilastik_features(scales: Sequence[float]) -> list[Feature]:
    """ilastik's six pixel-classification features at each of ``scales``, in ilastik's
    channel order and with its names ("Gaussian Smoothing (<sigma>=0.7)", "Hessian of
    Gaussian Eigenvalues (<sigma>=1.0) [0]", with the Greek letter), each from scipy's
    Gaussians with the bank's mode."""
    features = []
    for fid, title in ILASTIK_FEATURES:
        for s in scales:
            name = f"{title} ({SIGMA}={s})"
            inner = min(s, 1.0)
            pre_sigma = math.sqrt(s * s - 1.0) if s > 1.0 else s
            pre = [((pre_sigma,) * 3, (0, 0, 0), ILASTIK_PRESMOOTH_WINDOW)]
            sig = (inner,) * 3
            params: dict[str, object] = {"preset": "ilastik", "feature": fid, "scale": s,
                                         "presmooth": pre_sigma, "sigma": inner}  # fmt: skip

            def g(suffix: str, order=(0, 0, 0), sigma=sig, terms=None, name=name,
                  pre=pre) -> Filter:  # fmt: skip
                return gaussian_filter_of(f"{name}.{suffix}", sigma, order, ILASTIK_WINDOW,
                                          "bank.scales", pre, terms)  # fmt: skip

            if fid == "GaussianSmoothing":
                features.append(Feature(name, "linear", params, (g("g"),)))
            elif fid == "LaplacianOfGaussian":
                lap = [(1.0, _order(AXES[a], AXES[a])) for a in range(3)]
                features.append(Feature(name, "linear", params, (g("log", terms=lap),)))
            elif fid == "GaussianGradientMagnitude":
                grads = tuple(g(f"d{a}", AXES[a]) for a in range(3))
                features.append(Feature(name, "gradient_magnitude", params, grads))
            elif fid == "DifferenceOfGaussians":
                # the difference of the two responses: as one filter the two Gaussians of
                # close sigmas would cancel too much for float32 passes at large scales
                second = g("g2", sigma=(ILASTIK_DOG * inner,) * 3)
                params["sigma2"] = ILASTIK_DOG * inner
                features.append(Feature(name, "difference", params, (g("g"), second)))
            else:
                names = tuple(f"{name} [{i}]" for i in range(3))
                if fid == "StructureTensorEigenvalues":
                    grads = tuple(g(f"d{a}", AXES[a]) for a in range(3))
                    rho = ILASTIK_OUTER * inner
                    params["rho"] = rho
                    outer = gaussian_filter_of(f"{name}.rho", (rho,) * 3, (0, 0, 0),
                                               ILASTIK_WINDOW)  # fmt: skip
                    features.append(Feature(name, "structure_tensor_eigenvalues", params,
                                            grads, outer, names))  # fmt: skip
                else:
                    entries = tuple(g(f"d{a}{b}", _order(AXES[a], AXES[b])) for a, b in PAIRS)
                    features.append(Feature(name, "hessian_eigenvalues", params, entries,
                                            names=names))  # fmt: skip
    return features


# -- scikit-image's multiscale_basic_features ------------------------------------------------
# As skimage/feature/_basic_features.py (scikit-image 0.26) computes them with its defaults
# (intensity, edges, texture; sigma_min 0.5, sigma_max 16, num_sigma None): sigmas 0.5 * 2^k
# up to 16; at each, in this order, G = skimage.filters.gaussian(img, sigma) (scipy's
# gaussian_filter, truncate 4, its mode 'nearest'), the Sobel magnitude of G
# (skimage.filters.sobel: sqrt(mean over axes of convolve(G, [1, 0, -1] x [1, 2, 1] / 4)^2)),
# and the eigenvalues (descending, feature.hessian_matrix_eigvals) of the Hessian of G by
# np.gradient twice (central differences (f[i+1] - f[i-1]) / 2).
SKIMAGE_SIGMAS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
SKIMAGE_TRUNCATE = 4.0
SOBEL_EDGE = np.array([1.0, 0.0, -1.0])  # convolution kernels, as skimage convolves
SOBEL_SMOOTH = np.array([1.0, 2.0, 1.0]) / 4
GRADIENT = np.array([0.5, 0.0, -0.5])  # np.gradient inside the volume, as a convolution


def filter_of_terms(name: str, terms: Sequence[tuple[float, Sequence[np.ndarray]]]) -> Filter:
    """A filter of separable terms ``coef * outer(a0, a1, a2)`` (odd centred factors, padded
    to one extent per axis)."""
    ext = [max(len(axes[d]) for _, axes in terms) for d in range(3)]
    if max(ext) > MAX_SEPARABLE_EXTENT:
        raise BankError(f"{name}: an extent of {max(ext)}; at most {MAX_SEPARABLE_EXTENT}")
    built = tuple(
        term(c, *(_padded(np.asarray(a, np.float64), n) for a, n in zip(axes, ext, strict=True)))
        for c, axes in terms
    )
    kernel = np.array(sum(t.array() for t in built), np.float64, order="C")
    kernel.flags.writeable = False
    return Filter(name, "gaussian", kernel, built)


def skimage_features() -> list[Feature]:
    """``skimage.feature.multiscale_basic_features(volume)``'s 30 channels with its defaults,
    in its order, named ``intensity_s<sigma>``, ``edges_s<sigma>``, ``texture_s<sigma>_<i>``:
    each channel a composite separable filter (the Gaussian convolved with the Sobel or
    difference factors) or a magnitude or eigenvalues of such filters."""
    features = []
    for s in SKIMAGE_SIGMAS:
        g = gaussian_kernel1d(s, 0, radius(s, SKIMAGE_TRUNCATE))
        tag = f"s{s:g}"
        params: dict[str, object] = {"preset": "skimage", "sigma": s,
                                     "truncate": SKIMAGE_TRUNCATE}  # fmt: skip

        def axes(kinds: Sequence[np.ndarray], g=g) -> list[np.ndarray]:
            return [np.convolve(g, k) for k in kinds]

        one = np.ones(1)
        smooth = filter_of_terms(f"intensity_{tag}.g", [(1.0, axes([one] * 3))])
        features.append(Feature(f"intensity_{tag}", "linear", {**params, "feature": "intensity"},
                                (smooth,)))  # fmt: skip
        sobel = tuple(
            filter_of_terms(
                f"edges_{tag}.d{a}",
                [(1 / math.sqrt(3), axes([SOBEL_EDGE if d == a else SOBEL_SMOOTH
                                          for d in range(3)]))],
            )
            for a in range(3)
        )  # fmt: skip
        features.append(Feature(f"edges_{tag}", "gradient_magnitude",
                                {**params, "feature": "edges"}, sobel))  # fmt: skip
        entries = []
        for a, b in PAIRS:
            kinds = [one, one, one]
            kinds[a] = GRADIENT
            kinds[b] = np.convolve(kinds[b], GRADIENT)
            entries.append(filter_of_terms(f"texture_{tag}.d{a}{b}", [(1.0, axes(kinds))]))
        names = tuple(f"texture_{tag}_{i}" for i in range(3))
        features.append(Feature(f"texture_{tag}", "hessian_eigenvalues",
                                {**params, "feature": "texture"}, tuple(entries),
                                names=names))  # fmt: skip
    return features
