"""The filter library: ``[[bank.filter]]`` tables become the exact 3D kernels the engine applies.

Each `Filter` holds the array that ``scipy.ndimage.convolve`` is given, indexed like the volume
(axes 0, 1, 2). Generated filters equal scipy's own filters where scipy has one: ``gaussian`` of
``sigma`` and extent ``size`` is ``gaussian_filter(v, sigma, order, truncate=(size // 2) / sigma)``
(per axis), ``log`` is ``gaussian_laplace``, ``box`` is ``uniform_filter``, ``sobel`` is
``sobel``. `build_bank` validates every table in one place; its `BankError` names the key
(``bank.filter[2].sigma``) and the value. `stack_kernels` zero-pads a bank to one extent
without moving any kernel's centre.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from numbers import Integral, Real
from pathlib import Path
from typing import NamedTuple

import numpy as np

from volconv.bank.factor import Term, term
from volconv.checks import closest, fits_float32
from volconv.plan.direct import MAX_EXTENT


class BankError(ValueError):
    """A bad filter spec; the message names the key and the value, e.g.
    ``bank.filter[2].sigma: must be > 0; got -1``."""


class TruncationWarning(UserWarning):
    """A Gaussian's extent cuts it off so near its centre that it is nearly a box: the filter
    is not the one its sigma asks for."""


# A Gaussian cut at fewer standard deviations than this (its edge weight above 0.61 of its
# centre's: more a box than a bell) is warned about; the size suggested reaches 3 sigma.
TRUNCATE_WARN, TRUNCATE_SUGGEST = 1.0, 3.0


@dataclass(frozen=True, eq=False)
class Filter:
    """One filter of a bank.

    Attributes
    ----------
    name : str
        Unique within the bank; the ``filter`` coordinate of the output.
    type : str
        The filter type (a key of `FILTER_TYPES`).
    kernel : (kx, ky, kz) float64 array, read-only
        Exactly the array ``scipy.ndimage.convolve`` is given.
    factors : tuple of `volconv.bank.factor.Term`, or None
        The kernel as a sum of separable terms, where the filter type knows it (its sum equals
        ``kernel`` up to float64 rounding); None for custom kernels.
    """

    name: str
    type: str
    kernel: np.ndarray
    factors: tuple[Term, ...] | None = None


class Required:
    """Marks a parameter that has no default."""

    def __repr__(self) -> str:
        return "required"


REQUIRED = Required()


@dataclass(frozen=True)
class Derived:
    """A default computed from other values; ``text`` says how (``1.6 * sigma``)."""

    text: str

    def __repr__(self) -> str:
        return self.text


class Param(NamedTuple):
    """One key of a ``[[bank.filter]]`` table."""

    doc: str
    default: object  # a value, REQUIRED, or Derived


class FilterType(NamedTuple):
    """A filter type: one line on what it computes, and its keys beyond `COMMON_PARAMS`."""

    doc: str
    params: dict[str, Param]


UNITS = ("voxels", "mm")

COMMON_PARAMS = {
    "name": Param("unique name of the filter in the bank", Derived("<type>_<index>")),
    "type": Param("the filter type", REQUIRED),
}
_SIGMA = Param("Gaussian standard deviation in `units`: a number or one per axis", REQUIRED)
_SIZE = Param(
    f"kernel extent: an odd integer 1..{MAX_EXTENT} or one per axis", Derived("[bank].size")
)
_UNITS = Param(
    'unit of sigma (and frequency): "voxels", or "mm" scaled per axis by the voxel size',
    "voxels",
)

FILTER_TYPES: dict[str, FilterType] = {
    "gaussian": FilterType(
        "Gaussian (derivatives): scipy.ndimage.gaussian_filter, truncate = (size // 2) / sigma",
        {
            "sigma": _SIGMA,
            "order": Param("derivative order 0..2: a number or one per axis", 0),
            "size": _SIZE,
            "units": _UNITS,
        },
    ),
    "log": FilterType(
        "Laplacian of Gaussian: scipy.ndimage.gaussian_laplace, truncate = (size // 2) / sigma",
        {"sigma": _SIGMA, "size": _SIZE, "units": _UNITS},
    ),
    "dog": FilterType(
        "difference of Gaussians: gaussian(sigma) - gaussian(sigma2)",
        {
            "sigma": _SIGMA,
            "sigma2": Param("the second Gaussian's standard deviation", Derived("1.6 * sigma")),
            "size": _SIZE,
            "units": _UNITS,
        },
    ),
    "box": FilterType("mean over the extent: scipy.ndimage.uniform_filter", {"size": _SIZE}),
    "sobel": FilterType(
        "Sobel derivative, 3 x 3 x 3: scipy.ndimage.sobel",
        {"axis": Param("axis of the derivative: 0, 1 or 2", REQUIRED)},
    ),
    "gabor": FilterType(
        "Gabor pair <name>_real, <name>_imag: Gaussian envelope x cos / sin of a plane wave, "
        "each with zero mean",
        {
            "sigma": Param(
                "envelope standard deviation in `units`: a number or one per axis", REQUIRED
            ),
            "frequency": Param(
                'cycles per voxel (per mm with units = "mm"), at most 0.5 per voxel', REQUIRED
            ),
            "orientation": Param(
                "direction of the wave, [azimuth a, elevation e] in degrees: "
                "(cos e cos a, cos e sin a, sin e) along axes 0, 1, 2",
                [0, 0],
            ),
            "phase": Param("phase of the wave at the centre, in degrees", 0),
            "size": _SIZE,
            "units": _UNITS,
        },
    ),
    "custom": FilterType(
        f"a 3D kernel from a file: .npy or anything nibabel loads; extents 1..{MAX_EXTENT}",
        {"path": Param("the file, relative to the pipeline file's folder", REQUIRED)},
    ),
}


# -- kernels ----------------------------------------------------------------------------


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


# -- reading a spec -----------------------------------------------------------------------


def _show(value: object) -> str:
    """A value as the user wrote it in TOML."""
    return json.dumps(value, default=str)


def _fail(key: str, need: str, value: object) -> BankError:
    return BankError(f"{key}: must be {need}; got {_show(value)}")


def _is_number(v: object, integer: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, Integral if integer else Real):
        return False
    return math.isfinite(v)


def _per_axis(key: str, value: object, *, integer: bool = False) -> tuple:
    """A number, or three (one per axis), as a 3-tuple."""
    items = list(value) if isinstance(value, list | tuple) else [value] * 3
    if len(items) != 3 or not all(_is_number(v, integer) for v in items):
        kind = "an integer" if integer else "a number"
        raise _fail(key, f"{kind} or a list of 3 (one per axis)", value)
    return tuple(items)


def _size(key: str, value: object) -> tuple[int, int, int]:
    size = _per_axis(key, value, integer=True)
    if not all(1 <= k <= MAX_EXTENT and k % 2 for k in size):
        # generated kernels are centred on a voxel, so every extent is odd
        raise _fail(key, f"odd and 1..{MAX_EXTENT} per axis", value)
    return tuple(int(k) for k in size)


def _suggest(word: object, valid: Sequence[str]) -> str:
    near = closest(word, valid)  # the one closest-name rule (volconv.checks)
    return f"did you mean {near!r}?" if near else f"one of {', '.join(valid)}"


@dataclass
class _Context:
    """What building a filter needs beyond its own table."""

    size: tuple[int, int, int]
    voxel_size: object  # checked where units = "mm" needs it
    base_dir: Path
    units: str = "voxels"  # [bank] units: the default of filters that take units
    voxel_unknown: str = ""  # why the input gives no voxel size ("": it does)


class _Spec:
    """One ``[[bank.filter]]`` table being read: typed getters whose errors name the key."""

    def __init__(self, index: int, table: object, ctx: _Context) -> None:
        self.index, self.ctx = index, ctx
        if not isinstance(table, dict):
            raise _fail(f"bank.filter[{index}]", "a table", table)
        if "type" not in table:
            raise BankError(f"{self.key('type')}: missing; one of {', '.join(FILTER_TYPES)}")
        self.type = table["type"]
        if self.type not in FILTER_TYPES:
            hint = _suggest(self.type, list(FILTER_TYPES))
            raise BankError(f"{self.key('type')}: unknown filter type {_show(self.type)}; {hint}")
        params = FILTER_TYPES[self.type].params
        valid = [*COMMON_PARAMS, *params]
        for k in table:
            if k not in valid:
                hint = _suggest(k, valid)
                raise BankError(f"{self.key(k)}: unknown key for a {self.type} filter; {hint}")
        for k, p in params.items():
            if p.default is REQUIRED and k not in table:
                raise BankError(f"{self.key(k)}: missing; a {self.type} filter needs {p.doc}")
        self.table = table
        self.name = table.get("name", f"{self.type}_{index}")
        if not isinstance(self.name, str) or not self.name:
            raise _fail(self.key("name"), "a non-empty string", self.name)

    def key(self, name: str) -> str:
        return f"bank.filter[{self.index}].{name}"

    def get(self, name: str) -> object:
        """The value given, else the static default (Derived defaults are the caller's)."""
        if name in self.table:
            return self.table[name]
        if name == "units":
            return self.ctx.units
        return FILTER_TYPES[self.type].params[name].default

    def size(self) -> tuple[int, int, int]:
        if "size" in self.table:
            return _size(self.key("size"), self.table["size"])
        return self.ctx.size

    def scale(self) -> np.ndarray:
        """Length of a voxel along each axis in `units`."""
        units = self.get("units")
        if units not in UNITS:
            raise BankError(
                f"{self.key('units')}: unknown units {_show(units)}; {_suggest(units, UNITS)}"
            )
        if units == "voxels":
            return np.ones(3)
        # the key that asked for mm: the filter's own, or the bank's default
        key = self.key("units") if "units" in self.table else "bank.units"
        if self.ctx.voxel_unknown:
            raise BankError(
                f'{key}: "mm" needs the input\'s voxel size, and {self.ctx.voxel_unknown}; '
                'give sigma in voxels (units = "voxels") or an input that records its voxel size'
            )
        try:
            vs = np.asarray(self.ctx.voxel_size, np.float64)
        except (TypeError, ValueError):
            vs = np.full(1, np.nan)
        if vs.shape != (3,) or not np.all(vs > 0) or not np.all(np.isfinite(vs)):
            raise BankError(
                f'{key}: "mm" needs the voxel size of the input, three numbers > 0; got '
                f"{self.ctx.voxel_size!r}"
            )
        return vs

    def check_truncation(self, sigma: np.ndarray, size: tuple[int, ...], name: str) -> None:
        """Warn where ``size`` cuts the Gaussian of ``sigma`` (voxels, per axis) off below
        `TRUNCATE_WARN` standard deviations; axes of extent 1 are flat on purpose."""
        cut = [(k // 2) / s for s, k in zip(sigma, size, strict=True) if k > 1]
        if not cut or min(cut) >= TRUNCATE_WARN:
            return
        need = max(2 * math.ceil(TRUNCATE_SUGGEST * s) + 1
                   for s, k in zip(sigma, size, strict=True) if k > 1)  # fmt: skip
        given = self.table.get(name, self.get(name) if name == "sigma" else "1.6 * sigma")
        advice = f"use size >= {need}" + (
            "" if need <= MAX_EXTENT
            else f" (the most is {MAX_EXTENT}: a smaller sigma, or a box filter for a mean)"
        )  # fmt: skip
        shown = "x".join(map(str, size)) if len(set(size)) > 1 else str(size[0])
        warnings.warn(
            f"bank.filter[{self.index}] ({self.name}): size {shown} truncates the Gaussian of "
            f"{name} {_show(given)} at {min(cut):.2g} sigma (nearly a box, not the Gaussian "
            f"asked for); {advice}",
            TruncationWarning,  # one location: shown once, however many times built
            stacklevel=1,
        )

    def sigma(self, name: str = "sigma", value: object = None) -> np.ndarray:
        """A positive standard deviation per axis, in voxels."""
        value = self.get(name) if value is None else value
        sigma = np.asarray(_per_axis(self.key(name), value), np.float64)
        if not np.all(sigma > 0):
            raise _fail(self.key(name), "> 0", value)
        return sigma / self.scale()

    def integers(self, name: str, lo: int, hi: int) -> tuple[int, int, int]:
        value = self.get(name)
        ints = _per_axis(self.key(name), value, integer=True)
        if not all(lo <= i <= hi for i in ints):
            raise _fail(self.key(name), f"{lo}..{hi}", value)
        return tuple(int(i) for i in ints)

    def number(self, name: str) -> float:
        value = self.get(name)
        if not _is_number(value):
            raise _fail(self.key(name), "a number", value)
        return float(value)


# -- the types ----------------------------------------------------------------------------

# (suffix of the filter's name, kernel[, its separable terms])
_Kernels = list[tuple[str, np.ndarray] | tuple[str, np.ndarray, tuple[Term, ...]]]


def gaussian_terms(
    sigma: Sequence[float], order: Sequence[int], size: Sequence[int], coef: float = 1.0
) -> tuple[Term]:
    """`gaussian_kernel` as its one separable term."""
    axes = [gaussian_kernel1d(s, o, k // 2) for s, o, k in zip(sigma, order, size, strict=True)]
    return (term(coef, *axes),)


def _gaussian(s: _Spec) -> _Kernels:
    sigma, order, size = s.sigma(), s.integers("order", 0, 2), s.size()
    s.check_truncation(sigma, size, "sigma")
    return [("", gaussian_kernel(sigma, order, size), gaussian_terms(sigma, order, size))]


def _log(s: _Spec) -> _Kernels:
    sigma, size = s.sigma(), s.size()
    s.check_truncation(sigma, size, "sigma")
    second = ((2, 0, 0), (0, 2, 0), (0, 0, 2))  # gaussian_laplace sums these
    terms = sum((gaussian_terms(sigma, order, size) for order in second), ())
    return [("", sum(gaussian_kernel(sigma, order, size) for order in second), terms)]


def _dog(s: _Spec) -> _Kernels:
    sigma = s.sigma()
    # the default is 1.6 * sigma as written, in the same units
    given = s.table.get("sigma2", [1.6 * v for v in _per_axis(s.key("sigma"), s.get("sigma"))])
    sigma2 = s.sigma("sigma2", given)
    if np.allclose(sigma, sigma2):
        raise _fail(s.key("sigma2"), "different from sigma (the difference would be 0)", given)
    size = s.size()
    s.check_truncation(sigma, size, "sigma")
    s.check_truncation(sigma2, size, "sigma2")
    flat = (0, 0, 0)
    kernel = gaussian_kernel(sigma, flat, size) - gaussian_kernel(sigma2, flat, size)
    terms = gaussian_terms(sigma, flat, size) + gaussian_terms(sigma2, flat, size, -1.0)
    return [("", kernel, terms)]


def _box(s: _Spec) -> _Kernels:
    size = s.size()
    terms = (term(1.0, *(np.full(k, 1.0 / k) for k in size)),)
    return [("", np.full(size, 1.0 / math.prod(size)), terms)]


def _sobel(s: _Spec) -> _Kernels:
    axis = s.get("axis")
    if not (_is_number(axis, integer=True) and 0 <= axis <= 2):
        raise _fail(s.key("axis"), "0, 1 or 2", axis)
    # scipy.ndimage.sobel correlates with [-1, 0, 1]; convolving needs it reversed
    taps = [
        np.array([1.0, 0.0, -1.0]) if a == axis else np.array([1.0, 2.0, 1.0]) for a in range(3)
    ]
    return [("", reduce(np.multiply.outer, taps), (term(1.0, *taps),))]


def _gabor(s: _Spec) -> _Kernels:
    sigma, scale = s.sigma(), s.scale()
    f = s.number("frequency")
    unit = "voxel" if s.get("units") == "voxels" else "mm"
    if not 0 < f <= 0.5 / scale.max():  # Nyquist along the coarsest axis
        raise _fail(s.key("frequency"), f"in (0, {0.5 / scale.max():g}] cycles per {unit}", f)
    angles = s.get("orientation")
    if not (isinstance(angles, list | tuple) and len(angles) == 2 and all(map(_is_number, angles))):
        raise _fail(s.key("orientation"), "[azimuth, elevation] in degrees", angles)
    az, el = np.deg2rad(np.asarray(angles, np.float64))
    direction = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    wave = f * direction * scale  # cycles per voxel along each axis
    phase, size = np.deg2rad(s.number("phase")), s.size()
    s.check_truncation(sigma, size, "sigma")
    real, imag = gabor_kernels(sigma, wave, phase, size)
    real_terms, imag_terms = gabor_terms(sigma, wave, phase, size)
    return [("_real", real, real_terms), ("_imag", imag, imag_terms)]


def _custom(s: _Spec) -> _Kernels:
    value = s.get("path")
    key = s.key("path")
    if not isinstance(value, str) or not value:
        raise _fail(key, "a file name", value)
    path = s.ctx.base_dir / Path(value).expanduser()
    if not path.is_file():
        raise BankError(f"{key}: no such file {str(path)!r}")
    kernel = _load(key, path)
    if kernel.dtype.kind not in "biuf":
        raise BankError(f"{key}: {str(path)!r} must hold real numbers; got dtype {kernel.dtype}")
    if kernel.ndim != 3 or not all(1 <= k <= MAX_EXTENT for k in kernel.shape):
        raise BankError(
            f"{key}: {str(path)!r} must hold a 3D array of extents 1..{MAX_EXTENT}; "
            f"got shape {kernel.shape}"
        )
    if not np.all(np.isfinite(kernel)):
        raise BankError(f"{key}: {str(path)!r} holds NaN or infinite values")
    if not fits_float32(kernel):
        raise BankError(
            f"{key}: {str(path)!r} holds values beyond float32's range (|v| <= 3.4e38), which "
            f"volconv computes in; got {float(np.abs(kernel).max()):g}"
        )
    return [("", kernel.astype(np.float64))]


def _load(key: str, path: Path) -> np.ndarray:
    """The array in a .npy file, or the data of anything nibabel loads."""
    if path.suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise BankError(f"{key}: cannot read {str(path)!r} as .npy: {e}") from None
    import nibabel  # only custom kernels need it; it is slow to import
    from nibabel.filebasedimages import ImageFileError

    try:
        return np.asanyarray(nibabel.load(path).get_fdata())
    except (OSError, ValueError, EOFError, ImageFileError) as e:
        raise BankError(
            f"{key}: cannot read {str(path)!r} (.npy or an image nibabel loads): {e}"
        ) from None


def _degenerate(spec: _Spec) -> BankError:
    """The error for a generated kernel that is not finite in float32: its sigma (the smaller
    of a dog's two) is so small (or so large) that the formula breaks down."""
    key = "sigma" if "sigma" in spec.table else "type"  # box, sobel: finite by construction
    small2 = "sigma2" in spec.table and np.min(spec.table["sigma2"]) < np.min(spec.table["sigma"])
    if spec.type == "dog" and small2:
        key = "sigma2"
    return _fail(spec.key(key), "large enough for a kernel that is finite in float32",
                 spec.get(key))  # fmt: skip


_BUILDERS: dict[str, Callable[[_Spec], _Kernels]] = {
    "gaussian": _gaussian,
    "log": _log,
    "dog": _dog,
    "box": _box,
    "sobel": _sobel,
    "gabor": _gabor,
    "custom": _custom,
}


# -- the public API -------------------------------------------------------------------------


def build_bank(
    specs: list[dict],
    size: int | Sequence[int] = 7,
    voxel_size: Sequence[float] = (1.0, 1.0, 1.0),
    base_dir: Path = Path("."),
    units: str = "voxels",
    voxel_unknown: str = "",
) -> list[Filter]:
    """Build and validate a filter bank.

    Parameters
    ----------
    specs : list of dict
        The ``[[bank.filter]]`` tables, in order. See `FILTER_TYPES` for each type's keys.
    size : int or 3 ints
        ``[bank].size``: the odd extent of generated kernels that do not set their own.
    voxel_size : 3 floats
        The input's voxel size in mm, for filters with ``units = "mm"``.
    base_dir : Path
        Folder that relative ``custom`` paths start from (the pipeline file's).
    units : {'voxels', 'mm'}
        ``[bank].units``: the units of filters that do not set their own.
    voxel_unknown : str
        Why the input records no voxel size (`volconv.run.volume.Volume.voxel_unknown`); a filter in
        mm is then refused, naming the key that asked for mm.

    Returns
    -------
    list of Filter
        In bank order; a ``gabor`` table gives two, ``<name>_real`` then ``<name>_imag``.

    Raises
    ------
    BankError
        A bad table, naming the key (``bank.filter[i].key``) and the value.

    Warns
    -----
    TruncationWarning
        A Gaussian (gaussian, log, dog, gabor's envelope) whose size cuts it off below 1
        sigma: nearly a box.
    """
    if not isinstance(specs, list | tuple):
        raise _fail("bank.filter", "an array of tables ([[bank.filter]])", specs)
    if not specs:
        raise BankError("bank.filter: the bank is empty; add a [[bank.filter]] table")
    ctx = _Context(_size("bank.size", size), voxel_size, Path(base_dir), units, voxel_unknown)
    filters: list[Filter] = []
    owner: dict[str, int] = {}
    for i, table in enumerate(specs):
        spec = _Spec(i, table, ctx)
        with np.errstate(all="ignore"):  # a degenerate sigma is refused below, in one line
            built = _BUILDERS[spec.type](spec)
        for suffix, kernel, *factors in built:
            if not (np.all(np.isfinite(kernel)) and fits_float32(kernel)):
                raise _degenerate(spec)
            name = spec.name + suffix
            if name in owner:
                raise BankError(
                    f"{spec.key('name')}: duplicate filter name {name!r} "
                    f"(also bank.filter[{owner[name]}])"
                )
            owner[name] = i
            kernel = np.array(kernel, np.float64, order="C")
            kernel.flags.writeable = False
            filters.append(Filter(name, spec.type, kernel, factors[0] if factors else None))
    return filters


def stack_kernels(filters: Sequence[Filter | np.ndarray]) -> np.ndarray:
    """The bank's kernels (`Filter`s or 3D arrays) zero-padded to one extent, as an
    ``(N, sx, sy, sz)`` float64 array.

    scipy centres a kernel of extent ``k`` at index ``k // 2``: it has ``k // 2`` taps before
    the centre and ``k - 1 - k // 2`` after. Padding every kernel to the most taps before
    (``b``) and after (``a``) gives extent ``b + a + 1`` with centre ``b`` (since ``b - a`` is 0
    or 1), so each padded kernel convolves exactly as the original; no smaller extent can.
    """
    if not len(filters):
        raise ValueError("stack_kernels: no filters")
    kernels = [f.kernel if isinstance(f, Filter) else np.asarray(f) for f in filters]
    shapes = np.array([k.shape for k in kernels])
    before = (shapes // 2).max(axis=0)
    after = (shapes - 1 - shapes // 2).max(axis=0)
    out = np.zeros((len(kernels), *(before + after + 1)))
    for i, k in enumerate(kernels):
        start = before - np.array(k.shape) // 2
        out[(i, *(slice(s, s + e) for s, e in zip(start, k.shape, strict=True)))] = k
    return out


def describe_types() -> str:
    """Every filter type with its keys and defaults, as `volconv filters` prints it."""

    def rows(params: dict[str, Param]) -> list[str]:
        return [f"    {k:<12} {_default(p.default):<16} {p.doc}" for k, p in params.items()]

    lines = ["Every [[bank.filter]] table takes:", *rows(COMMON_PARAMS)]
    for name, ftype in FILTER_TYPES.items():
        lines += ["", f"{name}: {ftype.doc}", *rows(ftype.params)]
    return "\n".join(lines)


def _default(default: object) -> str:
    return repr(default) if isinstance(default, Required | Derived) else _show(default)
