"""A complete output opened for reading, whatever its format: `Stored`, and `Lazy`, one
output's values read as sliced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def _slices(key: object, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """``key`` (ints, slices with step 1, one Ellipsis) as one slice per axis, and the axes
    an int took away."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1 :]
    key = key + (slice(None),) * (len(shape) - len(key))
    if len(key) != len(shape):
        raise IndexError(f"too many indices for an output of shape {shape}")
    slices, dropped = [], []
    for axis, (k, n) in enumerate(zip(key, shape, strict=True)):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step != 1:
                raise IndexError("only slices with step 1")
            slices.append(slice(start, max(start, stop)))
        else:
            i = int(k) + n if int(k) < 0 else int(k)
            if not 0 <= i < n:
                raise IndexError(f"index {k} is out of bounds for axis {axis} of size {n}")
            slices.append(slice(i, i + 1))
            dropped.append(axis)
    return tuple(slices), tuple(dropped)


@dataclass(eq=False)
class Lazy:
    """One output's values, (x, y, z[, t]), read from the file only as sliced (``out[10]``,
    ``out[:, :, 5]``; `numpy.asarray` reads it all), as stored: see `Stored.decode`."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # reads one slice per axis, (x, y, z[, t]) order, as an array in that order
    _read: Callable[[tuple[slice, ...]], np.ndarray] = field(repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: object) -> np.ndarray:
        slices, dropped = _slices(key, self.shape)
        values = np.asarray(self._read(slices))
        return values.reshape([n for i, n in enumerate(values.shape) if i not in dropped])

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        values = self[...]
        return values if dtype is None else values.astype(dtype)


@dataclass(eq=False)
class Stored:
    """A complete volconv output opened for reading (`volconv.output.read`).

    Attributes
    ----------
    format : str
        ``hdf5``, ``nifti`` or ``zarr``.
    names : list of str
        The outputs' names, in order.
    outputs : list of Lazy
        One per name: its values, (x, y, z[, t]), read as sliced.
    voxel_size : tuple of float
        In mm.
    attrs : dict
        The provenance (``source``, ``pipeline``, ``device``, ...), as the writer stored it.
    dtype : numpy.dtype
        The stored type; uint8 values stand for ``stored * scale + offset``.
    scale, offset : float
    """

    format: str
    path: Path
    names: list[str]
    outputs: list[Lazy]
    voxel_size: tuple[float, float, float]
    attrs: dict
    dtype: np.dtype
    scale: float = 1.0
    offset: float = 0.0
    _close: Callable[[], None] | None = field(default=None, repr=False)

    def decode(self, values: np.ndarray) -> np.ndarray:
        """Stored values as the values they stand for (float32; uint8 with scale, offset)."""
        values = np.asarray(values, np.float32)
        if self.dtype == np.uint8:
            return values * np.float32(self.scale) + np.float32(self.offset)
        return values

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> Stored:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class PartialView:
    """A partial output as `volconv.resume` reads it back: ``view[f, a:b, ..., frame]`` is
    output ``f``'s rows ``[a, b)`` (of ``frame``, 4D), (b - a, y, z), the bytes written."""

    shape: tuple[int, ...]  # (N, x, y, z[, t])
    dtype: np.dtype
    _read: Callable[[int, int, int, int | None], np.ndarray] = field(repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: tuple) -> np.ndarray:
        f, rows, *rest = key
        frame = rest[-1] if len(rest) == 2 else None
        return np.asarray(self._read(int(f), rows.start, rows.stop, frame))
