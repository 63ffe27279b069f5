"""Reading one ``[[bank.filter]]`` table: the schema of its keys (`Param`, `FilterType`), the
errors that name the key and the value (`BankError`), and `FilterTable`, whose typed getters
check each value once.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path
from typing import NamedTuple

import numpy as np

from volconv.checks import closest

# The widest a filter of the bank may be per axis: what the direct kernel takes (the
# separable passes take wider generated filters: volconv.plan.direct.MAX_SEPARABLE_EXTENT).
MAX_EXTENT = 31


class BankError(ValueError):
    """A bad filter spec; the message names the key and the value, e.g.
    ``bank.filter[2].sigma: must be > 0; got -1``."""


class TruncationWarning(UserWarning):
    """A Gaussian's extent cuts it off so near its centre that it is nearly a box: the filter
    is not the one its sigma asks for."""


# A Gaussian cut at fewer standard deviations than this (its edge weight above 0.61 of its
# centre's: more a box than a bell) is warned about; the size suggested reaches 3 sigma.
TRUNCATE_WARN, TRUNCATE_SUGGEST = 1.0, 3.0


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


def show_value(value: object) -> str:
    """A value as the user wrote it in TOML."""
    return json.dumps(value, default=str)


def bad_value(key: str, need: str, value: object) -> BankError:
    return BankError(f"{key}: must be {need}; got {show_value(value)}")


def is_number(v: object, integer: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, Integral if integer else Real):
        return False
    return math.isfinite(v)


def per_axis(key: str, value: object, *, integer: bool = False) -> tuple:
    """A number, or three (one per axis), as a 3-tuple."""
    items = list(value) if isinstance(value, list | tuple) else [value] * 3
    if len(items) != 3 or not all(is_number(v, integer) for v in items):
        kind = "an integer" if integer else "a number"
        raise bad_value(key, f"{kind} or a list of 3 (one per axis)", value)
    return tuple(items)


def odd_size(key: str, value: object) -> tuple[int, int, int]:
    size = per_axis(key, value, integer=True)
    if not all(1 <= k <= MAX_EXTENT and k % 2 for k in size):
        # generated kernels are centred on a voxel, so every extent is odd
        raise bad_value(key, f"odd and 1..{MAX_EXTENT} per axis", value)
    return tuple(int(k) for k in size)


def _suggest(word: object, valid: Sequence[str]) -> str:
    near = closest(word, valid)  # the one closest-name rule (volconv.checks)
    return f"did you mean {near!r}?" if near else f"one of {', '.join(valid)}"


@dataclass
class TableContext:
    """What building a filter needs beyond its own table."""

    size: tuple[int, int, int]
    voxel_size: object  # checked where units = "mm" needs it
    base_dir: Path
    units: str = "voxels"  # [bank] units: the default of filters that take units
    voxel_unknown: str = ""  # why the input gives no voxel size ("": it does)
    types: dict[str, FilterType] = field(default_factory=dict)  # the filter types, by name


class FilterTable:
    """One ``[[bank.filter]]`` table being read: typed getters whose errors name the key."""

    def __init__(self, index: int, table: object, ctx: TableContext) -> None:
        self.index, self.ctx = index, ctx
        if not isinstance(table, dict):
            raise bad_value(f"bank.filter[{index}]", "a table", table)
        if "type" not in table:
            raise BankError(f"{self.key('type')}: missing; one of {', '.join(self.ctx.types)}")
        self.type = table["type"]
        if self.type not in self.ctx.types:
            hint = _suggest(self.type, list(self.ctx.types))
            what = show_value(self.type)
            raise BankError(f"{self.key('type')}: unknown filter type {what}; {hint}")
        params = self.ctx.types[self.type].params
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
            raise bad_value(self.key("name"), "a non-empty string", self.name)

    def key(self, name: str) -> str:
        return f"bank.filter[{self.index}].{name}"

    def get(self, name: str) -> object:
        """The value given, else the static default (Derived defaults are the caller's)."""
        if name in self.table:
            return self.table[name]
        if name == "units":
            return self.ctx.units
        return self.ctx.types[self.type].params[name].default

    def size(self) -> tuple[int, int, int]:
        if "size" in self.table:
            return odd_size(self.key("size"), self.table["size"])
        return self.ctx.size

    def scale(self) -> np.ndarray:
        """Length of a voxel along each axis in `units`."""
        units = self.get("units")
        if units not in UNITS:
            raise BankError(
                f"{self.key('units')}: unknown units {show_value(units)}; {_suggest(units, UNITS)}"
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
            f"{name} {show_value(given)} at {min(cut):.2g} sigma (nearly a box, not the Gaussian "
            f"asked for); {advice}",
            TruncationWarning,  # one location: shown once, however many times built
            stacklevel=1,
        )

    def sigma(self, name: str = "sigma", value: object = None) -> np.ndarray:
        """A positive standard deviation per axis, in voxels."""
        value = self.get(name) if value is None else value
        sigma = np.asarray(per_axis(self.key(name), value), np.float64)
        if not np.all(sigma > 0):
            raise bad_value(self.key(name), "> 0", value)
        return sigma / self.scale()

    def integers(self, name: str, lo: int, hi: int) -> tuple[int, int, int]:
        value = self.get(name)
        ints = per_axis(self.key(name), value, integer=True)
        if not all(lo <= i <= hi for i in ints):
            raise bad_value(self.key(name), f"{lo}..{hi}", value)
        return tuple(int(i) for i in ints)

    def number(self, name: str) -> float:
        value = self.get(name)
        if not is_number(value):
            raise bad_value(self.key(name), "a number", value)
        return float(value)
