"""Feature presets: ilastik's pixel-classification features and scikit-image's
``multiscale_basic_features``, each expanded into named `Feature`s (``[bank] preset``).

Both are computed as their libraries compute them, in two stages per scale: one Gaussian
smoothing of the input (`PresetScale.smooth`), then every channel of that scale from the
smoothed field by short stencils (`volconv.engines.scales.PresetStage`, kernels/stencils.cl).
`preset_plan` gives the stage what it runs: the scales and each one's output planes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from volconv.bank.features import PAIRS, Feature, _fail, radius
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
# structure tensor's outer scale 0.5 of its inner one. Each stage takes the bank's mode (vigra
# filters the presmoothed block, itself extended past the volume's border).
ILASTIK_PRESMOOTH_WINDOW = 3.5
ILASTIK_WINDOW = 2.0
ILASTIK_DOG = 0.66
ILASTIK_OUTER = 0.5


@dataclass(frozen=True)
class PresetScale:
    """One scale of a preset: the Gaussian of stage 1 (``smooth`` at ``truncate``) and the
    planes (among the preset's outputs) its channels go to.

    ``inner`` is ilastik's feature scale min(s, 1) (0 for skimage). ``at``: skimage: the
    intensity's plane (edges and the three eigenvalues follow it); ilastik: the planes of the
    smoothing, LoG, gradient magnitude, DoG and the first of each eigenvalue triple
    (structure tensor, Hessian)."""

    smooth: float
    truncate: float
    inner: float
    at: tuple[int, ...]

    @property
    def smooth_radius(self) -> int:
        return radius(self.smooth, self.truncate)

    def taps(self) -> np.ndarray:
        """ilastik's stage-2 correlation weights (5, 5) float32: the Gaussian at ``inner``, its
        first and second derivatives, DoG's second Gaussian and the structure tensor's outer
        one, each centred at index 2 (window 2: radius int(2 * sigma + 0.5) <= 2)."""
        out = np.zeros((5, 5), np.float32)
        rows = [(self.inner, 0), (self.inner, 1), (self.inner, 2),
                (ILASTIK_DOG * self.inner, 0), (ILASTIK_OUTER * self.inner, 0)]  # fmt: skip
        for k, (sigma, order) in enumerate(rows):
            r = radius(sigma, ILASTIK_WINDOW)
            out[k, 2 - r : 3 + r] = gaussian_kernel1d(sigma, order, r)[::-1]
        return out

    def radii(self) -> tuple[int, int, int]:
        """Stage 2's radii: the inner Gaussian's, DoG's second one's, the outer one's."""
        return tuple(radius(f * self.inner, ILASTIK_WINDOW) for f in (1.0, ILASTIK_DOG,
                                                                        ILASTIK_OUTER))  # fmt: skip


@dataclass(frozen=True)
class PresetPlan:
    """A preset as `volconv.engines.scales.PresetStage` computes it: ``kind`` ('ilastik' or
    'skimage'), its scales, and its number of outputs (the planes ``at`` index)."""

    kind: str
    scales: tuple[PresetScale, ...]
    n_outputs: int

    def smoothing_taps(self) -> int:
        """Taps per voxel of its first stage: each scale's Gaussian along the three axes."""
        return sum(3 * (2 * s.smooth_radius + 1) for s in self.scales)


def preset_plan(features: Sequence[tuple[Feature, tuple[int, ...]]]) -> PresetPlan:
    """The plan of a preset's features, each with its output planes among the preset's."""
    kind = str(features[0][0].params["preset"])
    by_scale: dict[float, dict[str, int]] = {}
    for feat, at in features:
        s = float(feat.params["scale" if kind == "ilastik" else "sigma"])
        by_scale.setdefault(s, {})[str(feat.params["feature"])] = at[0]
    scales = []
    for s, planes in by_scale.items():
        if kind == "skimage":
            scales.append(PresetScale(s, SKIMAGE_TRUNCATE, 0.0, (planes["intensity"],)))
        else:
            pre = math.sqrt(s * s - 1.0) if s > 1.0 else s
            at = tuple(planes[fid] for fid, _ in ILASTIK_FEATURES)
            scales.append(PresetScale(pre, ILASTIK_PRESMOOTH_WINDOW, min(s, 1.0), at))
    n = sum(len(f.output_names) for f, _ in features)
    return PresetPlan(kind, tuple(scales), n)


def preset_extents(p: dict[str, object]) -> tuple[tuple[int, ...], ...]:
    """The extents of the linear filters the preset's feature of parameters ``p`` applies to
    the input, as its library defines it (`Feature.work`): each stage-2 filter composed with
    the scale's smoothing. ilastik: the inner Gaussian, its derivatives and DoG's second one
    over the presmoothing, and the structure tensor's outer Gaussian over each of its six
    products; skimage: the Gaussian, the Sobel operators on it, and np.gradient taken twice."""
    return tuple(_extents(p))


def _extents(p: dict[str, object]) -> list[tuple[int, ...]]:
    if p["preset"] == "skimage":
        r = radius(float(p["sigma"]), SKIMAGE_TRUNCATE)
        g = 2 * r + 1
        if p["feature"] == "intensity":
            return [(g, g, g)]
        if p["feature"] == "edges":  # a 3 x 3 x 3 Sobel operator per axis
            return [(g + 2,) * 3] * 3
        # the Hessian's entries: central differences twice along one axis, or once along two
        return [tuple(g + 4 if a == b == k else g + 2 * ((a == k) + (b == k)) for k in range(3))
                for a, b in PAIRS]  # fmt: skip
    pre = radius(float(p["presmooth"]), ILASTIK_PRESMOOTH_WINDOW)
    inner = float(p["sigma"])

    def cube(sigma: float) -> tuple[int, int, int]:
        return (2 * (pre + radius(sigma, ILASTIK_WINDOW)) + 1,) * 3

    count = {"GaussianSmoothing": 1, "LaplacianOfGaussian": 3, "GaussianGradientMagnitude": 3,
             "StructureTensorEigenvalues": 3, "HessianOfGaussianEigenvalues": 6}  # fmt: skip
    fid = p["feature"]
    if fid == "DifferenceOfGaussians":
        return [cube(inner), cube(ILASTIK_DOG * inner)]
    extents = [cube(inner)] * count[fid]
    if fid == "StructureTensorEigenvalues":
        outer = 2 * radius(ILASTIK_OUTER * inner, ILASTIK_WINDOW) + 1
        extents += [(outer,) * 3] * len(PAIRS)
    return extents


def _check_extent(key: str, sigma: float, truncate: float) -> None:
    extent = 2 * radius(sigma, truncate) + 1
    if extent > MAX_SEPARABLE_EXTENT:
        raise BankError(f"{key}: sigma {sigma:g} at truncate {truncate:g} needs an extent of "
                        f"{extent}; at most {MAX_SEPARABLE_EXTENT}")  # fmt: skip


def ilastik_features(scales: Sequence[float]) -> list[Feature]:
    """ilastik's six pixel-classification features at each of ``scales``, in ilastik's
    channel order and with its names ("Gaussian Smoothing (<sigma>=0.7)", "Hessian of
    Gaussian Eigenvalues (<sigma>=1.0) [0]", with the Greek letter)."""
    features = []
    for fid, title in ILASTIK_FEATURES:
        for s in scales:
            name = f"{title} ({SIGMA}={s})"
            inner = min(s, 1.0)
            pre_sigma = math.sqrt(s * s - 1.0) if s > 1.0 else s
            _check_extent("bank.scales", pre_sigma, ILASTIK_PRESMOOTH_WINDOW)
            params: dict[str, object] = {"preset": "ilastik", "feature": fid, "scale": s,
                                         "presmooth": pre_sigma, "sigma": inner}  # fmt: skip
            kind = {"GaussianSmoothing": "linear", "LaplacianOfGaussian": "linear",
                    "GaussianGradientMagnitude": "gradient_magnitude",
                    "DifferenceOfGaussians": "difference",
                    "StructureTensorEigenvalues": "structure_tensor_eigenvalues",
                    "HessianOfGaussianEigenvalues": "hessian_eigenvalues"}[fid]  # fmt: skip
            if fid == "DifferenceOfGaussians":
                params["sigma2"] = ILASTIK_DOG * inner
            if fid == "StructureTensorEigenvalues":
                params["rho"] = ILASTIK_OUTER * inner
            names = tuple(f"{name} [{i}]" for i in range(3)) if "Eigen" in fid else (name,)
            features.append(Feature(name, kind, params, (), names=names,
                                    work=preset_extents(params)))  # fmt: skip
    return features


# -- scikit-image's multiscale_basic_features ------------------------------------------------
# As skimage/feature/_basic_features.py (scikit-image 0.26) computes them with its defaults
# (intensity, edges, texture; sigma_min 0.5, sigma_max 16, num_sigma None): the image as
# img_as_float32 gives it (uint8 / 255, uint16 / 65535, signed integers / their maximum and
# clipped at -1, floats as they are); sigmas 0.5 * 2^k up to 16; at each, in this order,
# G = skimage.filters.gaussian(img, sigma) (scipy's gaussian_filter, truncate 4, mode
# 'nearest'), the Sobel magnitude of G (skimage.filters.sobel, mode 'reflect':
# sqrt(sum over axes of convolve(G, [1, 0, -1] x [1, 2, 1] / 4)^2 / 3)), and the eigenvalues
# (descending, feature.hessian_matrix_eigvals) of the Hessian of G by np.gradient twice
# (central differences inside, one-sided at the border). The bank's mode does not apply.
SKIMAGE_SIGMAS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
SKIMAGE_TRUNCATE = 4.0


def skimage_scale(dtype: np.dtype) -> float:
    """img_as_float32's factor for an input of ``dtype`` (signed integers are also clipped at
    -1: their minimum maps to -1)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "ui":
        return 1.0 / np.iinfo(dtype).max
    return 1.0


def skimage_features() -> list[Feature]:
    """``skimage.feature.multiscale_basic_features(volume)``'s 30 channels with its defaults,
    in its order, named ``intensity_s<sigma>``, ``edges_s<sigma>``, ``texture_s<sigma>_<i>``."""
    features = []
    for s in SKIMAGE_SIGMAS:
        tag = f"s{s:g}"
        for feature, kind in (("intensity", "linear"), ("edges", "gradient_magnitude"),
                              ("texture", "hessian_eigenvalues")):  # fmt: skip
            params: dict[str, object] = {
                "preset": "skimage", "sigma": s, "truncate": SKIMAGE_TRUNCATE, "feature": feature,
            }  # fmt: skip
            names = tuple(f"texture_{tag}_{i}" for i in range(3)) if feature == "texture" else ()
            features.append(Feature(f"{feature}_{tag}", kind, params, (), names=names,
                                    work=preset_extents(params)))  # fmt: skip
    return features
