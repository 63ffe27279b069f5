"""The filter library: ``[[bank.filter]]`` tables become the exact 3D kernels the engine applies.

Each `Filter` holds the array that ``scipy.ndimage.convolve`` is given, indexed like the volume
(axes 0, 1, 2). Generated filters equal scipy's own filters where scipy has one: ``gaussian`` of
``sigma`` and extent ``size`` is ``gaussian_filter(v, sigma, order, truncate=(size // 2) / sigma)``
(per axis), ``log`` is ``gaussian_laplace``, ``box`` is ``uniform_filter``, ``sobel`` is
``sobel``. `build_bank` validates every table in one place (`volconv.bank.spec.FilterTable`); its
`BankError` names the key (``bank.filter[2].sigma``) and the value. A filter type is its keys
(`FILTER_TYPES`) and its builder (`_BUILDERS`); the arithmetic is in `volconv.bank.kernels`.
`stack_kernels` zero-pads a bank to one extent without moving any kernel's centre.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import numpy as np

from volconv.bank.factor import Term, term
from volconv.bank.kernels import (
    gabor_kernels,
    gabor_terms,
    gaussian_kernel,
    gaussian_terms,
)
from volconv.bank.spec import (
    COMMON_PARAMS,
    MAX_EXTENT,
    REQUIRED,
    BankError,
    Derived,
    FilterTable,
    FilterType,
    Param,
    Required,
    TableContext,
    bad_value,
    is_number,
    odd_size,
    per_axis,
    show_value,
)
from volconv.checks import fits_float32


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


# -- the types ----------------------------------------------------------------------------

# (suffix of the filter's name, kernel[, its separable terms])
_Kernels = list[tuple[str, np.ndarray] | tuple[str, np.ndarray, tuple[Term, ...]]]


def _gaussian(s: FilterTable) -> _Kernels:
    sigma, order, size = s.sigma(), s.integers("order", 0, 2), s.size()
    s.check_truncation(sigma, size, "sigma")
    return [("", gaussian_kernel(sigma, order, size), gaussian_terms(sigma, order, size))]


def _log(s: FilterTable) -> _Kernels:
    sigma, size = s.sigma(), s.size()
    s.check_truncation(sigma, size, "sigma")
    second = ((2, 0, 0), (0, 2, 0), (0, 0, 2))  # gaussian_laplace sums these
    terms = sum((gaussian_terms(sigma, order, size) for order in second), ())
    return [("", sum(gaussian_kernel(sigma, order, size) for order in second), terms)]


def _dog(s: FilterTable) -> _Kernels:
    sigma = s.sigma()
    # the default is 1.6 * sigma as written, in the same units
    given = s.table.get("sigma2", [1.6 * v for v in per_axis(s.key("sigma"), s.get("sigma"))])
    sigma2 = s.sigma("sigma2", given)
    if np.allclose(sigma, sigma2):
        raise bad_value(s.key("sigma2"), "different from sigma (the difference would be 0)", given)
    size = s.size()
    s.check_truncation(sigma, size, "sigma")
    s.check_truncation(sigma2, size, "sigma2")
    flat = (0, 0, 0)
    kernel = gaussian_kernel(sigma, flat, size) - gaussian_kernel(sigma2, flat, size)
    terms = gaussian_terms(sigma, flat, size) + gaussian_terms(sigma2, flat, size, -1.0)
    return [("", kernel, terms)]


def _box(s: FilterTable) -> _Kernels:
    size = s.size()
    terms = (term(1.0, *(np.full(k, 1.0 / k) for k in size)),)
    return [("", np.full(size, 1.0 / math.prod(size)), terms)]


def _sobel(s: FilterTable) -> _Kernels:
    axis = s.get("axis")
    if not (is_number(axis, integer=True) and 0 <= axis <= 2):
        raise bad_value(s.key("axis"), "0, 1 or 2", axis)
    # scipy.ndimage.sobel correlates with [-1, 0, 1]; convolving needs it reversed
    taps = [
        np.array([1.0, 0.0, -1.0]) if a == axis else np.array([1.0, 2.0, 1.0]) for a in range(3)
    ]
    return [("", reduce(np.multiply.outer, taps), (term(1.0, *taps),))]


def _gabor(s: FilterTable) -> _Kernels:
    sigma, scale = s.sigma(), s.scale()
    f = s.number("frequency")
    unit = "voxel" if s.get("units") == "voxels" else "mm"
    if not 0 < f <= 0.5 / scale.max():  # Nyquist along the coarsest axis
        raise bad_value(s.key("frequency"), f"in (0, {0.5 / scale.max():g}] cycles per {unit}", f)
    angles = s.get("orientation")
    if not (isinstance(angles, list | tuple) and len(angles) == 2 and all(map(is_number, angles))):
        raise bad_value(s.key("orientation"), "[azimuth, elevation] in degrees", angles)
    az, el = np.deg2rad(np.asarray(angles, np.float64))
    direction = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    wave = f * direction * scale  # cycles per voxel along each axis
    phase, size = np.deg2rad(s.number("phase")), s.size()
    s.check_truncation(sigma, size, "sigma")
    real, imag = gabor_kernels(sigma, wave, phase, size)
    real_terms, imag_terms = gabor_terms(sigma, wave, phase, size)
    return [("_real", real, real_terms), ("_imag", imag, imag_terms)]


def _custom(s: FilterTable) -> _Kernels:
    value = s.get("path")
    key = s.key("path")
    if not isinstance(value, str) or not value:
        raise bad_value(key, "a file name", value)
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


def _degenerate(spec: FilterTable) -> BankError:
    """The error for a generated kernel that is not finite in float32: its sigma (the smaller
    of a dog's two) is so small (or so large) that the formula breaks down."""
    key = "sigma" if "sigma" in spec.table else "type"  # box, sobel: finite by construction
    small2 = "sigma2" in spec.table and np.min(spec.table["sigma2"]) < np.min(spec.table["sigma"])
    if spec.type == "dog" and small2:
        key = "sigma2"
    return bad_value(spec.key(key), "large enough for a kernel that is finite in float32",
                 spec.get(key))  # fmt: skip


_BUILDERS: dict[str, Callable[[FilterTable], _Kernels]] = {
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
        raise bad_value("bank.filter", "an array of tables ([[bank.filter]])", specs)
    if not specs:
        raise BankError("bank.filter: the bank is empty; add a [[bank.filter]] table")
    ctx = TableContext(odd_size("bank.size", size), voxel_size, Path(base_dir), units,
                       voxel_unknown, FILTER_TYPES)  # fmt: skip
    filters: list[Filter] = []
    owner: dict[str, int] = {}
    for i, table in enumerate(specs):
        spec = FilterTable(i, table, ctx)
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
    return repr(default) if isinstance(default, Required | Derived) else show_value(default)
