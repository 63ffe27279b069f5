"""Derived features: outputs that are functions of several responses, computed on the device.

A ``[[bank.feature]]`` table (or a ``[bank] preset``) asks for a feature; `build_features`
validates it (its `BankError` names the key: ``bank.feature[1].rho``) and gives a `Feature`:
the Gaussian-derivative (or Gabor) filters it reads, and the names of its outputs. Each feature
is defined on scipy's float64 responses of the volume, with the bank's mode and cval and each
Gaussian truncated as ``scipy.ndimage.gaussian_filter(..., truncate=truncate)`` (radius
``int(truncate * sigma + 0.5)``):

- ``gradient_magnitude(sigma)``: ``scipy.ndimage.gaussian_gradient_magnitude(v, sigma)``;
- ``hessian_eigenvalues(sigma)``: the eigenvalues, descending, of ``H[a, b] =
  gaussian_filter(v, sigma, order=e_a + e_b)``; three outputs ``<name>_0 .. <name>_2``;
- ``structure_tensor_eigenvalues(sigma, rho)``: the eigenvalues, descending, of ``S[a, b] =
  gaussian_filter(g_a * g_b, rho)`` with ``g_a = gaussian_filter(v, sigma, order=e_a)``;
- ``gabor_energy``: ``sqrt(real^2 + imag^2)`` of the Gabor pair its keys define.

`expand` adds the filters the features read to the bank (deduplicated against the bank's own
filters and between features); they stay on the device unless the bank names them too. The
convolver (`volconv.separable.SeparableConvolver`) runs every filter a feature reads on the
separable path, so the responses are in one device buffer, and kernels/features.cl computes
the features there (`FeatureKernels`) before the download. The structure tensor smooths the
products of gradients a second time, with the mode applied to the product field:
`StructureTensorStage` computes the gradients over the rows the second smoothing reads, forms
the products in that smoothing's padded slab and filters them with the bank's mode and cval,
on the device. The presets (`ilastik_features`, `skimage_features`) are features whose
filters are chains of Gaussians and differences, each one separable filter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl

from volconv.bank import BankError, Filter, build_bank, gaussian_kernel1d
from volconv.boundary import sources
from volconv.factor import Term, term
from volconv.outputs import Output, responses
from volconv.plan import MAX_SEPARABLE_EXTENT
from volconv.programs import build, device_seconds

DEFAULT_TRUNCATE = 4.0  # scipy.ndimage.gaussian_filter's

# (doc, default); None: required
_COMMON = {
    "name": ("unique name; eigenvalue features give <name>_0 .. <name>_2", "<type>_<index>"),
    "type": ("the feature type", None),
}
_SIGMA = ("Gaussian standard deviation in voxels: a number or one per axis", None)
_TRUNCATE = ("scipy's truncate: each Gaussian's radius is int(truncate * sigma + 0.5)", 4.0)
FEATURE_TYPES: dict[str, tuple[str, dict[str, tuple[str, object]]]] = {
    "gradient_magnitude": (
        "scipy.ndimage.gaussian_gradient_magnitude(v, sigma)",
        {"sigma": _SIGMA, "truncate": _TRUNCATE},
    ),
    "hessian_eigenvalues": (
        "eigenvalues (descending) of H[a, b] = gaussian_filter(v, sigma, order=e_a + e_b)",
        {"sigma": _SIGMA, "truncate": _TRUNCATE},
    ),
    "structure_tensor_eigenvalues": (
        "eigenvalues (descending) of S[a, b] = gaussian_filter(g_a * g_b, rho), "
        "g_a = gaussian_filter(v, sigma, order=e_a)",
        {
            "sigma": ("inner scale: the gradients' standard deviation", None),
            "rho": ("outer scale: the smoothing of the gradients' products", None),
            "truncate": _TRUNCATE,
        },
    ),
    "gabor_energy": (
        "sqrt(real^2 + imag^2) of a Gabor pair (a gabor filter's keys)",
        {
            "sigma": ("envelope standard deviation in voxels", None),
            "frequency": ("cycles per voxel, at most 0.5", None),
            "orientation": ("[azimuth, elevation] in degrees", [0, 0]),
            "phase": ("phase of the wave at the centre, in degrees", 0),
            "size": ("kernel extent (odd)", "[bank].size"),
        },
    ),
}
EIGEN_TYPES = ("hessian_eigenvalues", "structure_tensor_eigenvalues")
AXES = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
# H's entries in the order kernels/features.cl's eigen3 reads them: 00, 11, 22, 01, 02, 12
PAIRS = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))


@dataclass(frozen=True, eq=False)
class Feature:
    """One feature of a bank.

    Attributes
    ----------
    name, type : str
    params : dict
        What decides it beyond its type (sigma, rho, truncate; a gabor's keys), as stored in
        the output's ``features`` attribute and `Output.params`.
    inputs : tuple of Filter
        The responses it reads, in the order its kernel takes them: the three gradients
        (gradient magnitude, the structure tensor's inner ones), H's six entries (00, 11, 22,
        01, 02, 12), or a Gabor pair (real, imag).
    rho_filter : Filter or None
        The structure tensor's outer Gaussian.
    """

    name: str
    type: str
    params: dict[str, object]
    inputs: tuple[Filter, ...]
    rho_filter: Filter | None = None
    names: tuple[str, ...] = ()  # the outputs' names, where not <name>_0 .. (a preset's)

    @property
    def output_names(self) -> list[str]:
        if self.names:
            return list(self.names)
        if self.type in EIGEN_TYPES:
            return [f"{self.name}_{i}" for i in range(3)]
        return [self.name]

    def outputs(self) -> list[Output]:
        n = len(self.output_names)
        return [
            Output(name, self.type, None, {**self.params, "volume": i} if n > 1 else self.params)
            for i, name in enumerate(self.output_names)
        ]

    def describe(self) -> str:
        """One line, as ``volconv validate`` lists it."""
        keys = ", ".join(f"{k}={_show(v)}" for k, v in self.params.items())
        outs = ", ".join(self.output_names)
        return f"{self.name}: {self.type}({keys}) -> {outs}"


def _show(v: object) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list | tuple):
        if len(v) == 3 and len(set(map(float, v))) == 1:  # one per axis, all equal
            return _show(float(v[0]))
        return "[" + ", ".join(_show(float(x)) for x in v) + "]"
    return json.dumps(v)


def _fail(key: str, need: str, value: object) -> BankError:
    return BankError(f"{key}: must be {need}; got {json.dumps(value, default=str)}")


def _positive(key: str, value: object) -> tuple[float, float, float]:
    items = list(value) if isinstance(value, list | tuple) else [value] * 3
    ok = len(items) == 3 and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        for v in items
    )
    if not ok:
        raise _fail(key, "a number > 0 or a list of 3 (one per axis)", value)
    return tuple(float(v) for v in items)


def radius(sigma: float, truncate: float) -> int:
    """scipy.ndimage.gaussian_filter's radius."""
    return int(truncate * float(sigma) + 0.5)


# One stage of a Gaussian filter chain: (sigma per axis, order per axis, truncate)
Stage = tuple[Sequence[float], Sequence[int], float]


def chain_factor(stages: Sequence[Stage], axis: int) -> np.ndarray:
    """The 1D kernel along ``axis`` of Gaussians applied one after the other (a
    ``gaussian_filter1d`` each, radius ``int(truncate * sigma + 0.5)``): their convolution."""
    out = np.ones(1)
    for sigma, order, truncate in stages:
        out = np.convolve(out, gaussian_kernel1d(sigma[axis], order[axis],
                                                 radius(sigma[axis], truncate)))  # fmt: skip
    return out


def gaussian_filter_of(
    name: str,
    sigma: Sequence[float],
    order: Sequence[int],
    truncate: float,
    key: str = "",
    before: Sequence[Stage] = (),
    terms: Sequence[tuple[float, Sequence[int]]] | None = None,
) -> Filter:
    """The filter that equals ``gaussian_filter(v, sigma, order, truncate=truncate)`` applied
    after the Gaussians ``before`` (a presmoothing); or, with ``terms``, the sum of
    ``coef * gaussian_filter(..., order)`` over them (a Laplacian)."""
    terms = [(1.0, order)] if terms is None else list(terms)
    built: list[Term] = []
    for coef, o in terms:
        axes = [chain_factor([*before, (sigma, o, truncate)], d) for d in range(3)]
        built.append(term(coef, *axes))
    size = built[0].extent
    if max(size) > MAX_SEPARABLE_EXTENT:
        raise BankError(
            f"{key or name}: sigma {_show(list(sigma))} at truncate {truncate:g} needs an extent "
            f"of {max(size)}; at most {MAX_SEPARABLE_EXTENT}"
        )
    kernel = np.array(sum(t.array() for t in built), np.float64, order="C")
    kernel.flags.writeable = False
    return Filter(name, "gaussian", kernel, tuple(built))


def _order(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def build_features(
    tables: object,
    *,
    size: int | Sequence[int] = 7,
    units: str = "voxels",
    preset: str | None = None,
    scales: object = None,
) -> list[Feature]:
    """Validate the ``[[bank.feature]]`` tables (and ``[bank] preset``, ``scales``) into
    features, in order: the preset's first, then the tables'.

    Raises
    ------
    BankError
        Naming the key (``bank.feature[1].rho``, ``bank.scales``) and the value.
    """
    features: list[Feature] = []
    if preset is not None:
        if units != "voxels":
            raise BankError(f'bank.units: features take sigma in voxels; got units = "{units}"')
        features += preset_features(preset, scales)
    elif scales is not None:
        raise BankError('bank.scales: applies to a preset only (preset = "ilastik")')
    if tables is None:
        return features
    if not isinstance(tables, list | tuple) or not all(isinstance(t, dict) for t in tables):
        raise _fail("bank.feature", "an array of tables ([[bank.feature]])", tables)
    for i, table in enumerate(tables):
        features.append(_feature(i, dict(table), size, units))
    seen: dict[str, str] = {}
    for f in features:
        for n in f.output_names:
            if n in seen:
                raise BankError(f"bank.feature: duplicate output name {n!r} ({seen[n]}, {f.name})")
            seen[n] = f.name
    return features


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


def _feature(i: int, table: dict, size: object, units: str) -> Feature:
    def key(k: str) -> str:
        return f"bank.feature[{i}].{k}"

    kind = table.get("type")
    if kind is None:
        raise BankError(f"{key('type')}: missing; one of {', '.join(FEATURE_TYPES)}")
    if kind not in FEATURE_TYPES:
        from volconv.checks import closest

        near = closest(kind, list(FEATURE_TYPES))
        hint = f"did you mean {near!r}?" if near else f"one of {', '.join(FEATURE_TYPES)}"
        raise BankError(f"{key('type')}: unknown feature type {json.dumps(kind)}; {hint}")
    params = FEATURE_TYPES[kind][1]
    valid = [*_COMMON, *params]
    for k in table:
        if k not in valid:
            from volconv.checks import closest

            near = closest(k, valid)
            hint = f"did you mean {near!r}?" if near else f"one of {', '.join(valid)}"
            raise BankError(f"{key(k)}: unknown key for a {kind} feature; {hint}")
    for k, (doc, default) in params.items():
        if default is None and k not in table:
            raise BankError(f"{key(k)}: missing; a {kind} feature needs {doc}")
    name = table.get("name", f"{kind}_{i}")
    if not isinstance(name, str) or not name:
        raise _fail(key("name"), "a non-empty string", name)
    if units != "voxels":
        raise BankError(f'bank.units: features take sigma in voxels; got units = "{units}"')
    if kind == "gabor_energy":
        spec = {k: v for k, v in table.items() if k != "type"}
        try:
            real, imag = build_bank([{**spec, "type": "gabor", "name": name}], size)
        except BankError as e:
            raise BankError(str(e).replace("bank.filter[0]", f"bank.feature[{i}]")) from None
        kept = {k: v for k, v in table.items() if k not in ("name", "type")}
        return Feature(name, kind, kept, (real, imag))
    truncate = table.get("truncate", DEFAULT_TRUNCATE)
    if isinstance(truncate, bool) or not isinstance(truncate, int | float) or not truncate > 0:
        raise _fail(key("truncate"), "a number > 0", truncate)
    truncate = float(truncate)
    sigma = _positive(key("sigma"), table["sigma"])
    params: dict[str, object] = {"sigma": list(sigma)}
    rho_filter = None
    if kind == "structure_tensor_eigenvalues":
        rho = _positive(key("rho"), table["rho"])
        params["rho"] = list(rho)
        rho_filter = gaussian_filter_of(f"{name}.rho", rho, (0, 0, 0), truncate, key("rho"))
    params["truncate"] = truncate
    if kind == "hessian_eigenvalues":
        orders = [_order(AXES[a], AXES[b]) for a, b in PAIRS]
        suffixes = [f"d{a}{b}" for a, b in PAIRS]
    else:
        orders, suffixes = list(AXES), ["d0", "d1", "d2"]
    inputs = tuple(
        gaussian_filter_of(f"{name}.{s}", sigma, o, truncate, key("sigma"))
        for o, s in zip(orders, suffixes, strict=True)
    )
    return Feature(name, kind, params, inputs, rho_filter)


# -- a bank with its features -------------------------------------------------------------


@dataclass(frozen=True)
class DeviceFeature:
    """A feature as kernels/features.cl computes it: ``kernel`` ('magnitude' or 'eigen3')
    over the responses of filters ``inputs`` (indices into the expanded bank), its outputs
    at output planes ``at`` (the file's order)."""

    kernel: str
    inputs: tuple[int, ...]
    at: tuple[int, ...]


@dataclass(frozen=True)
class Expanded:
    """A bank with its features: every filter to run (the bank's, then those only features
    read), the outputs to store, and how each feature reads the filters.

    Attributes
    ----------
    filters : list of Filter
        The bank's filters first (each stored), then the ones only features read.
    n_stored : int
        How many of ``filters`` are stored (the bank's).
    outputs : list of Output
        The bank's responses, then each feature's outputs: the file's N volumes, in order.
    device : list of DeviceFeature
        The features computed from the slab's responses on the device.
    tensors : list of (Feature, tuple of int)
        Structure tensors with the output planes they fill (`StructureTensorStage`).
    separable : tuple of int
        Indices of the filters the device features read: they must run on the separable path.
    """

    filters: list[Filter]
    n_stored: int
    outputs: list[Output]
    device: list[DeviceFeature] = field(default_factory=list)
    tensors: list[tuple[Feature, tuple[int, ...]]] = field(default_factory=list)
    separable: tuple[int, ...] = ()
    features: tuple[Feature, ...] = ()

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def plan_sizes(self) -> dict[str, int]:
        """`volconv.separable.make_separable_plan`'s sizes of the outputs."""
        return {
            "n_stored": self.n_stored,
            "feature_planes": sum(len(f.at) for f in self.device),
            "n_tensor": sum(len(at) for _, at in self.tensors),
        }

    def stored_kernels(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``/kernels`` array and the per-output extents: each response's kernel, and a
        (1, 1, 1) zero kernel for each feature output (the ``features`` attribute describes
        those), stacked to one extent."""
        from volconv.bank import stack_kernels

        arrays = [o.kernel if o.is_response else np.zeros((1, 1, 1)) for o in self.outputs]
        extents = np.array([a.shape for a in arrays], np.int64)
        return stack_kernels(arrays), extents


def features_json(features: Sequence[Feature]) -> str:
    items = [{"name": f.name, "type": f.type, "outputs": f.output_names, **f.params}
             for f in features]  # fmt: skip
    return json.dumps(items)


def _kernel_key(f: Filter) -> tuple[tuple[int, ...], bytes]:
    return f.kernel.shape, np.ascontiguousarray(f.kernel).tobytes()


def expand(filters: Sequence[Filter], features: Sequence[Feature]) -> Expanded:
    """The bank ``filters`` with what ``features`` read added (a filter equal to one already
    there is not added twice) and the outputs in the file's order."""
    all_filters = list(filters)
    index = {_kernel_key(f): i for i, f in enumerate(all_filters)}
    outputs = responses(list(filters))
    device, tensors, separable = [], [], set()
    for feat in features:
        at = tuple(range(len(outputs), len(outputs) + len(feat.output_names)))
        outputs += feat.outputs()
        if feat.type == "structure_tensor_eigenvalues":
            tensors.append((feat, at))
            continue
        idx = []
        for f in feat.inputs:
            k = _kernel_key(f)
            if k not in index:
                index[k] = len(all_filters)
                all_filters.append(f)
            idx.append(index[k])
        separable.update(idx)
        kinds = {"hessian_eigenvalues": "eigen3", "linear": "pick", "difference": "difference"}
        kernel = kinds.get(feat.type, "magnitude")
        device.append(DeviceFeature(kernel, tuple(idx), at))
    if not all_filters and tensors:  # the convolver runs at least one filter: a cheap one
        all_filters.append(tensors[0][0].inputs[0])
    return Expanded(all_filters, len(filters), outputs, device, tensors,
                    tuple(sorted(separable)), tuple(features))  # fmt: skip


# -- on the device --------------------------------------------------------------------------


class FeatureKernels:
    """kernels/features.cl on one context: `launch` runs features over a slab's responses."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, jacobi: bool = False) -> None:
        """``jacobi``: eigenvalues by float32 Jacobi rotations also where the device has
        doubles (its default there: the closed form in float64)."""
        self.ctx, self.queue = ctx, queue
        prog = build(ctx, "features.cl", (("JACOBI", 1),) if jacobi else ())
        names = ("magnitude", "eigen3", "pick", "difference", "product_pad")
        self._k = {name: cl.Kernel(prog, name) for name in names}

    def launch(
        self, kernel: str, src: cl.Buffer, slots: Sequence[int], dst: cl.Buffer, o: int, n: int
    ) -> cl.Event:
        """Enqueue ``kernel`` over ``n`` voxels: reading planes ``slots`` of ``src`` (plane s
        at s * n) and writing planes from ``o`` of ``dst``."""
        k = self._k[kernel]
        i32 = np.int32
        if kernel == "magnitude":
            c = slots[2] if len(slots) == 3 else -1
            k.set_args(src, i32(slots[0]), i32(slots[1]), i32(c), dst, i32(o), np.int64(n))
        elif kernel == "pick":
            k.set_args(src, i32(slots[0]), dst, i32(o), np.int64(n))
        elif kernel == "difference":
            k.set_args(src, i32(slots[0]), i32(slots[1]), dst, i32(o), np.int64(n))
        else:
            k.set_args(src, *map(i32, slots), dst, i32(o), np.int64(n))
        return cl.enqueue_nd_range_kernel(self.queue, k, (n,), None)

    def eigen(self, entries: np.ndarray) -> tuple[np.ndarray, float]:
        """Eigenvalues (3, ...) of the float32 entries (6, ...) (00, 11, 22, 01, 02, 12), on the
        device; and the kernel's device seconds."""
        entries = np.ascontiguousarray(entries, np.float32)
        n = entries[0].size
        mf = cl.mem_flags
        src = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=entries)
        dst = cl.Buffer(self.ctx, mf.WRITE_ONLY, 3 * n * 4)
        event = self.launch("eigen3", src, range(6), dst, 0, n)
        out = np.empty((3, *entries.shape[1:]), np.float32)
        cl.enqueue_copy(self.queue, out, dst, wait_for=[event])
        return out, device_seconds([event])


def host_feature(kernel: str, planes: Sequence[np.ndarray]) -> list[np.ndarray]:
    """What kernels/features.cl's ``kernel`` computes, on the host in float64 (slabs whose
    source holds NaN or Inf, whose responses the host sets)."""
    p = [np.asarray(x, np.float64) for x in planes]
    if kernel == "pick":
        return p
    if kernel == "difference":
        with np.errstate(invalid="ignore"):
            return [p[0] - p[1]]
    if kernel == "magnitude":
        with np.errstate(over="ignore", invalid="ignore"):
            return [np.sqrt(sum(x * x for x in p))]
    return eigenvalues(p)


def eigenvalues(entries: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Descending eigenvalues of symmetric 3x3 matrices given by their entries (00, 11, 22,
    01, 02, 12), in float64 (`numpy.linalg.eigvalsh`); NaN where an entry is not finite."""
    e = [np.asarray(x, np.float64) for x in entries]
    shape = e[0].shape
    m = np.empty((*shape, 3, 3))
    for v, (a, b) in zip(e, PAIRS, strict=True):
        m[..., a, b] = m[..., b, a] = v
    m = m.reshape(-1, 3, 3)
    finite = np.isfinite(m).all(axis=(1, 2))
    out = np.full((len(m), 3), np.nan)
    if finite.any():
        out[finite] = np.linalg.eigvalsh(m[finite])[:, ::-1]
    return [out[:, i].reshape(shape) for i in range(3)]


# -- the structure tensor's second smoothing ------------------------------------------------


class StructureTensorStage:
    """A structure tensor's eigenvalues for a slab of output rows.

    The outer smoothing reads the product field g_a * g_b over the slab widened by rho's
    radius, extended by the bank's mode at the volume's borders (scipy's ``gaussian_filter``
    of the products), so the gradients are computed over the product rows that smoothing
    reads (`volconv.boundary.extend_indices`), in chunks of at most the slab's depth, and kept
    on the device; each product is gathered into the outer smoothing's padded slab through
    pad.cl's index maps (kernels/features.cl's product_pad: mode and cval applied to the
    product field), smoothed by the outer convolver's passes, and the six entries give the
    eigenvalues (eigen3); only those are downloaded. A slab whose source holds NaN or Inf
    goes through the host (`_compute_host`): the gradients set as scipy sets them, the
    products smoothed as a float32 volume's rows.
    """

    def __init__(
        self,
        feature: Feature,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str,
        cval: float,
        device: cl.Device,
        slab_depth: int,
        kernels: FeatureKernels,
    ) -> None:
        from volconv.separable import SeparableConvolver, plan_bank

        self.feature, self.shape, self.mode = feature, tuple(shape), mode
        self.kernels = kernels
        grads = list(feature.inputs)
        self.grad = SeparableConvolver(
            grads, shape, dtype, mode, cval, device=device, slab_depth=slab_depth,
            choices=plan_bank(grads, force="separable"), fused=False,
        )  # fmt: skip
        rho = [feature.rho_filter]
        self.outer = SeparableConvolver(
            rho, shape, np.float32, mode, cval, device=device, slab_depth=slab_depth,
            choices=plan_bank(rho, force="separable"), fused=False,
        )  # fmt: skip
        self.depth = slab_depth
        self.seconds = 0.0
        if self.outer.plan.pad_dtype != np.float32:
            raise ValueError("structure tensor: the outer smoothing pads float32")
        self._g: cl.Buffer | None = None  # the gradients over the product rows
        self._entries: cl.Buffer | None = None  # S's six planes, then the eigenvalues

    def product_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted rows of the product field the outer smoothing of ``[a, b)`` reads."""
        return self.outer.source_rows(a, b)

    def _chunks(self, a: int, b: int) -> list[tuple[int, int]]:
        rows = self.product_rows(a, b)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        out = []
        for run in np.split(rows, breaks):
            r0, r1 = int(run[0]), int(run[-1]) + 1
            out += [(c, min(c + self.depth, r1)) for c in range(r0, r1, self.depth)]
        return out

    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows of the volume that output rows ``[a, b)`` read."""
        parts = [self.grad.source_rows(c0, c1) for c0, c1 in self._chunks(a, b)]
        return sources(np.concatenate(parts))

    def compute(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        """The three eigenvalue volumes (3, b - a, ny, nz) float32 of output rows ``[a, b)``,
        from the volume's ``rows`` at ``needed`` (sorted, covering `source_rows`) or its
        whole ``frame``."""
        from volconv.nonfinite import has_nonfinite

        if rows is not None and has_nonfinite(rows):
            return self._compute_host(a, b, rows, needed, frame)
        from volconv.programs import device_seconds

        grad, outer, queue = self.grad, self.outer, self.grad.queue
        ctx = grad.ctx
        mf = cl.mem_flags
        ny, nz = self.shape[1:]
        prows = self.product_rows(a, b)
        nr, depth = len(prows), b - a
        if self._g is None or self._g.size < 3 * nr * ny * nz * 4:
            self._g = cl.Buffer(ctx, mf.READ_WRITE, 3 * nr * ny * nz * 4)
        if self._entries is None or self._entries.size < 9 * depth * ny * nz * 4:
            self._entries = cl.Buffer(ctx, mf.READ_WRITE, 9 * self.depth * ny * nz * 4)
        events: list[cl.Event] = []
        at = 0
        for c0, c1 in self._chunks(a, b):  # the gradients, each chunk copied beside the others
            if rows is None:
                up, pad = grad.padder(c0, c1, grad._padded, frame=frame)
            else:
                own = rows[np.searchsorted(needed, grad.source_rows(c0, c1))]
                up, pad = grad.padder(c0, c1, grad._padded, rows=own)
            events += [*up, pad, *grad._launch_passes(c1 - c0)]
            plane = (c1 - c0) * ny * nz * 4
            for s in range(3):
                slot = grad._slots.index(s)
                events.append(cl.enqueue_copy(queue, self._g, grad._out, byte_count=plane,
                                              src_offset=slot * plane,
                                              dst_offset=(s * nr + at) * ny * nz * 4))  # fmt: skip
            at += c1 - c0
        m0 = outer.padder.row_map(a, b)
        local = np.where(m0 >= 0, np.searchsorted(prows, m0), -1).astype(np.int32)
        m0_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=local)
        p1, p2 = outer.plan.padded_yz
        i32 = np.int32
        k = self.kernels._k["product_pad"]
        n = depth * ny * nz
        for i, (p, q) in enumerate(PAIRS):
            k.set_args(self._g, i32(p), i32(q), i32(nr), outer._padded, m0_buf,
                       outer.padder._m1, outer.padder._m2, i32(len(local)), i32(p1), i32(p2),
                       i32(ny), i32(nz), np.float32(outer.plan.cval))  # fmt: skip
            events.append(cl.enqueue_nd_range_kernel(queue, k, (p2, p1, len(local)), None))
            events += outer._launch_passes(depth)
            events.append(cl.enqueue_copy(queue, self._entries, outer._out, byte_count=n * 4,
                                          dst_offset=i * n * 4))  # fmt: skip
        events.append(self.kernels.launch("eigen3", self._entries, range(6), self._entries, 6, n))
        values = np.empty((3, depth, ny, nz), np.float32)
        cl.enqueue_copy(queue, values, self._entries, src_offset=6 * n * 4, wait_for=events[-1:])
        cl.wait_for_events(events)
        self.seconds += device_seconds(events)
        return values

    def _compute_host(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray | None,
        frame: np.ndarray | None,
    ) -> np.ndarray:  # fmt: skip
        """`compute` through the host: for slabs whose source holds NaN or Inf."""
        ny, nz = self.shape[1:]
        prows = self.product_rows(a, b)
        g = np.empty((3, len(prows), ny, nz), np.float32)
        at = 0
        for c0, c1 in self._chunks(a, b):
            if frame is not None:
                given = {"frame": frame}
            else:
                given = {"rows": rows[np.searchsorted(needed, self.grad.source_rows(c0, c1))]}
            g[:, at : at + c1 - c0] = self.grad.convolve_slab(c0, c1, **given)
            at += c1 - c0
        entries = np.empty((6, b - a, ny, nz), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for i, (p, q) in enumerate(PAIRS):
                prod = (g[p].astype(np.float64) * g[q]).astype(np.float32)
                entries[i] = self.outer.convolve_slab(a, b, rows=prod)[0]
        values, seconds = self.kernels.eigen(entries)
        self.seconds += seconds
        return values
