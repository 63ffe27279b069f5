"""Checks every stage shares, each defined once: boundary modes, positive integers, the
closest-key hint, and the contract's tolerance.

Messages name the parameter (``mode``, ``slab_depth``, ``bank.boundary``) as the caller gives
it, so the API, the pipeline file and the CLI say the same thing in their own words.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np

# scipy.ndimage's boundary modes, by scipy's names.
MODES = ("reflect", "mirror", "nearest", "constant", "wrap")

# docs/contract.md, "Semantics":
# |stored - reference| <= SPEC_RTOL * sum(|kernel|) * m + SPEC_ATOL, with
# m = max(|v|) over the finite voxels (and |cval| in constant mode, if larger).
SPEC_RTOL = 1e-5
SPEC_ATOL = 1e-6
# volconv computes in float32: a finite value beyond this would become inf
FLOAT32_MAX = float(np.finfo(np.float32).max)


def closest(word: object, valid: Iterable[str]) -> str | None:
    """The valid name closest to ``word`` (a typo's likely meaning), or None."""
    close = difflib.get_close_matches(str(word), list(valid), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: object, valid: Iterable[str], prefix: str = "") -> str:
    """``did you mean PREFIXname?`` for a near miss, else the list of valid names."""
    valid = list(valid)
    near = closest(word, valid)
    return f"did you mean {prefix}{near}?" if near else f"valid: {', '.join(valid)}"


def check_mode(mode: object, name: str = "mode") -> str:
    """``mode`` if it is one of scipy's boundary modes; else a ValueError naming ``name``."""
    if mode not in MODES:
        near = closest(mode, MODES)
        hint = f"; did you mean {near!r}?" if near else ""
        raise ValueError(f"{name} must be one of {', '.join(MODES)}; got {mode!r}{hint}")
    return str(mode)


def check_cval(cval: object, name: str = "cval") -> float:
    """``cval`` as a finite float; TypeError for a non-number, ValueError for NaN or inf."""
    if isinstance(cval, bool):
        raise TypeError(f"{name} must be a number; got {cval!r}")
    try:
        value = float(cval)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number; got {cval!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    if not fits_float32(value):
        raise ValueError(f"{name} must be within float32's range (|{name}| <= 3.4e38); got {value}")
    return value


def fits_float32(values: object) -> bool:
    """Whether every finite value of ``values`` is within float32's range, which volconv
    computes in (a cast would make a larger one inf; NaN and inf are the callers' concern)."""
    a = np.abs(np.asarray(values, np.float64))
    return not np.any(a[np.isfinite(a)] > FLOAT32_MAX)


def as_float32(values: np.ndarray, name: str) -> np.ndarray:
    """``values`` as float32; a ValueError naming ``name`` where a finite value is beyond
    float32's range, which the cast would turn into inf (NaN and inf stay as they are)."""
    with np.errstate(over="raise"):  # the cast's own check: no second pass over the data
        try:
            return values.astype(np.float32)
        except FloatingPointError:
            a = np.abs(np.asarray(values, np.float64))
            big = float(a[np.isfinite(a)].max())
    raise ValueError(f"{name} holds values beyond float32's range (|v| <= 3.4e38); got {big:g}")


_KINDS = (
    (stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


def file_kind(path: str | os.PathLike) -> str:
    """What is at ``path``, links followed, in words for a message: ``a file`` (a regular
    one), ``a folder``, ``a FIFO (named pipe)``, a device, a socket, or ``nothing``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "nothing"
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def is_int(value: object) -> bool:
    """A true integer: not a bool, not a float that happens to be whole."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int >= 1; else a ValueError naming ``name``."""
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)  # type: ignore[arg-type]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "eb": 10**18, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "eib": 2**60}  # fmt: skip


def parse_bytes(value: object, name: str) -> int:
    """A size in bytes from an int or a text such as ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``;
    a ValueError naming ``name`` otherwise."""
    if is_int(value) and value > 0:  # type: ignore[operator]
        return int(value)  # type: ignore[arg-type]
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtpeib")
    unit = text[len(number) :]
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        size = math.nan
    if not (math.isfinite(size) and size >= 1) or isinstance(value, bool):
        raise ValueError(
            f'{name} must be a size such as "2GiB" or "512MiB" (B, kB..EB, KiB..EiB); got {value!r}'
        )
    return int(size)


def spec_tolerance(kernel: np.ndarray, vmax: float) -> float:
    """The contract's bound on |stored - reference| for one kernel over data of magnitude
    ``vmax``."""
    return SPEC_RTOL * float(np.sum(np.abs(kernel))) * float(vmax) + SPEC_ATOL


# Docstring fragments shared by every function that takes these parameters, as scipy.ndimage's
# ``docfiller`` shares them: written once, the same words everywhere.
DOCS = {
    "mode": """mode : {'reflect', 'mirror', 'nearest', 'constant', 'wrap'}, optional
        How the input extends beyond its edges, by scipy.ndimage's names and rules
        (default ``'reflect'``).""",
    "cval": """cval : float, optional
        The value outside the input in ``'constant'`` mode (default 0.0).""",
    "device": """device : pyopencl.Device or str, optional
        A device, or a spec: ``auto``, ``gpu``, ``cpu``, a name fragment or
        ``"platform:device"``; default ``PYOPENCL_CTX``, else the device of highest peak.""",
}

_Doc = TypeVar("_Doc", bound=Callable)


def docfiller(f: _Doc) -> _Doc:
    """Fill ``%(mode)s``, ``%(cval)s`` and ``%(device)s`` in ``f``'s docstring from `DOCS`."""
    if f.__doc__:
        f.__doc__ = f.__doc__ % DOCS
    return f
