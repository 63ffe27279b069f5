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
convolver (`volconv.engines.separable.SeparableConvolver`) runs every filter a feature reads on the
separable path, so the responses are in one device buffer, and kernels/features.cl computes
the features there (`volconv.engines.features`) before the download. The structure tensor
smooths the products of gradients a second time, with the mode applied to the product field:
`StructureTensorStage` computes the gradients over the rows the second smoothing reads, forms
the products in that smoothing's padded slab and filters them with the bank's mode and cval,
on the device. The presets (`volconv.bank.presets`) read no filter of the bank: each is
computed in two stages per scale, a Gaussian smoothing and one stencil kernel for all of that
scale's channels (`volconv.engines.scales.PresetStage`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from volconv.bank.factor import Term, term
from volconv.bank.filters import Filter, build_bank
from volconv.bank.kernels import gaussian_kernel1d
from volconv.bank.outputs import Output, responses, stored_kernels
from volconv.bank.spec import BankError
from volconv.plan.direct import MAX_SEPARABLE_EXTENT

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
    work : tuple of extents
        A preset's feature: the extents of the filters its library applies
        (`volconv.bank.presets.preset_extents`), which it reads through no filter of the bank.
    """

    name: str
    type: str
    params: dict[str, object]
    inputs: tuple[Filter, ...]
    rho_filter: Filter | None = None
    names: tuple[str, ...] = ()  # the outputs' names, where not <name>_0 .. (a preset's)
    work: tuple[tuple[int, ...], ...] = ()

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

    def work_extents(self) -> list[tuple[int, ...]]:
        """The extents of the linear filters its definition applies, for the throughput
        record's useful work: the responses it reads and a structure tensor's outer smoothing
        of each of its six products; a preset's as its library applies them (``work``)."""
        extents = [*self.work, *(tuple(f.kernel.shape) for f in self.inputs)]
        if self.rho_filter is not None:
            extents += [tuple(self.rho_filter.kernel.shape)] * len(PAIRS)
        return extents

    @property
    def outer_taps(self) -> int:
        """Taps per voxel of a structure tensor's outer smoothing: three passes of ``rho``'s
        Gaussian over each of its six products."""
        return len(PAIRS) * 3 * self.rho_filter.kernel.shape[0]

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
        from volconv.bank.presets import preset_features  # presets are built of features

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
    presets : list of (PresetPlan, tuple of int)
        A preset (`volconv.bank.presets.PresetPlan`) with the output planes it fills
        (`volconv.engines.scales.PresetStage`).
    work_extents : tuple of extents
        The useful work's filters (`volconv.report.work_gflop`): the filters run for the bank
        and the device features, then each structure tensor's and preset's
        (`Feature.work_extents`); not the one filter a convolver runs where nothing else is.
    """

    filters: list[Filter]
    n_stored: int
    outputs: list[Output]
    device: list[DeviceFeature] = field(default_factory=list)
    tensors: list[tuple[Feature, tuple[int, ...]]] = field(default_factory=list)
    separable: tuple[int, ...] = ()
    features: tuple[Feature, ...] = ()
    presets: list[tuple[object, tuple[int, ...]]] = field(default_factory=list)
    work_extents: tuple[tuple[int, ...], ...] = ()

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def plan_sizes(self) -> dict[str, int]:
        """`volconv.plan.separable.make_separable_plan`'s sizes of the outputs, and the rows
        a structure tensor's slab computes again (``stage_halo``: its outer reach on both
        sides)."""
        return {
            "n_stored": self.n_stored,
            "feature_planes": sum(len(f.at) for f in self.device),
            "n_tensor": sum(len(at) for _, at in [*self.tensors, *self.presets]),
            "stage_halo": max(
                (f.rho_filter.kernel.shape[0] - 1 for f, _ in self.tensors), default=0
            ),
        }

    def stage_taps(self) -> int:
        """Taps per voxel that the stages beside the plan's passes run, three passes per
        filter: each structure tensor's gradients and its outer smoothing of six products, and
        a preset's smoothing (`PresetPlan.smoothing_taps`; its stencils uncounted)."""
        taps = sum(3 * sum(f.kernel.shape[0] for f in feat.inputs) + feat.outer_taps
                   for feat, _ in self.tensors)  # fmt: skip
        return taps + sum(plan.smoothing_taps() for plan, _ in self.presets)

    def stored_kernels(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``/kernels`` array and the per-output extents: each response's kernel, and a
        (1, 1, 1) zero kernel for each feature output (the ``features`` attribute describes
        those), stacked to one extent (`volconv.bank.outputs.stored_kernels`)."""
        return stored_kernels(self.outputs)


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
    preset: list[tuple[Feature, tuple[int, ...]]] = []
    for feat in features:
        at = tuple(range(len(outputs), len(outputs) + len(feat.output_names)))
        outputs += feat.outputs()
        if "preset" in feat.params:
            preset.append((feat, at))
            continue
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
    presets = []
    if preset:
        from volconv.bank.presets import preset_plan

        first = preset[0][1][0]
        planes = tuple(o for _, at in preset for o in at)
        if planes != tuple(range(first, first + len(planes))):
            raise ValueError("expand: a preset's outputs must be consecutive")
        plan = preset_plan([(f, tuple(o - first for o in at)) for f, at in preset])
        presets.append((plan, planes))
    work = [tuple(f.kernel.shape) for f in all_filters]
    work += [e for feat, _ in [*tensors, *preset] for e in feat.work_extents()]
    if not all_filters and tensors:  # the convolver runs at least one filter: a cheap one
        all_filters.append(tensors[0][0].inputs[0])
    elif not all_filters and presets:  # one tap: the identity
        all_filters.append(gaussian_filter_of("identity", (0.1,) * 3, (0, 0, 0), 1.0))
        separable.add(0)
    return Expanded(all_filters, len(filters), outputs, device, tensors,
                    tuple(sorted(separable)), tuple(features), presets, tuple(work))  # fmt: skip
