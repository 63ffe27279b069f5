"""An opened input: `Volume` knows its shape, type and geometry without reading the voxels and
reads only the rows along axis 0 that a slab needs (`Volume.read_rows`). Beside it, what every
reader (`volconv.run.readers`, `volconv.run.read_hdf5`) shares: the errors, the checks of shape
and type, and the cheap check that a file holds all the data its header promises
(`check_size`), so that `validate` and `run` refuse a truncated input before any work.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

COMPRESSED = {".gz", ".bz2", ".zst"}


def read_errors() -> tuple[type[BaseException], ...]:
    """What nibabel, numpy and h5py raise for a file they cannot read (missing, truncated,
    corrupt). nibabel is imported for the files it reads only (0.05-0.1 s): where it is
    not, it raised nothing."""
    nib = sys.modules.get("nibabel")
    ours = (nib.filebasedimages.ImageFileError, nib.spatialimages.HeaderDataError) if nib else ()
    return (OSError, EOFError, ValueError, TypeError, KeyError, zlib.error, *ours)


class InputError(ValueError):
    """An input the user named cannot be used; the message names the file and the reason."""


class CorruptInputError(InputError):
    """The file turned out corrupt while it was read (after planning): not the user's
    mistake, so that input fails alone and the run goes on."""


@dataclass(eq=False)  # identity, not the value of an array field, makes two volumes equal
class Volume:
    """A 3D (x, y, z) or 4D (x, y, z, t) input volume, opened without reading its voxels.

    Attributes
    ----------
    path : str
        The input as given, e.g. ``"scans/a.nii.gz"`` or ``"f.h5:/data"``.
    shape : tuple of int
        ``(x, y, z)`` or ``(x, y, z, t)``.
    dtype : numpy.dtype
        The element type `read_rows` returns, in native byte order: the on-disk type, or the
        float type nibabel's scaling gives where a NIfTI's ``scl_slope``/``scl_inter`` apply.
    affine : (4, 4) array
        Voxel to world; identity for ``.npy``, and for HDF5 unless the dataset has an
        ``affine`` attribute.
    voxel_size : tuple of float
        Voxel extent along x, y, z (header zooms, else the affine's column norms).
    n_frames : int
        ``t`` for a 4D input, 1 for a 3D one.
    stem, parent : str
        File name without its extensions, and the name of its folder (output templates).
    file : Path
        The file on disk (without the ``:/dataset`` of an HDF5 input).
    voxel_unknown : str
        Empty where the file gives a voxel size; else why it does not (a ``.npy``, an HDF5
        dataset without an ``affine`` attribute, a header whose voxel size is 0), and
        `voxel_size` is then 1 mm by convention, which ``units = "mm"`` must not take.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    affine: np.ndarray
    voxel_size: tuple[float, float, float]
    n_frames: int
    stem: str
    parent: str
    file: Path = field(repr=False)
    # Yields an array-like (nibabel proxy, h5py dataset, memmap) that slices like the volume.
    _open: Callable[[], AbstractContextManager] = field(repr=False, compare=False)
    voxel_unknown: str = ""
    # Indices appended after (x, y, z[, t]) for trailing length-1 axes of the file.
    _extra_axes: int = field(default=0, repr=False, compare=False)
    # The file's axis of each axis of the volume, where they differ (MINC: time first).
    _axes: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _mapped: bool = field(default=False, repr=False, compare=False)
    # The data is read from other files too (an allowed VDS, external storage or link): the
    # SHA-256 covers the data read as well as the container.
    _digest_data: bool = field(default=False, repr=False, compare=False)
    # The NIfTI header where io read it without nibabel (`volconv.output.space` reads it).
    nifti_header: Any = field(default=None, repr=False, compare=False)

    def read_rows(self, rows: np.ndarray, frame: int = 0) -> np.ndarray:
        """The volume at ``rows`` along axis 0, reading only those rows.

        Parameters
        ----------
        rows : 1D array of int
            Row indices along axis 0, in any order; each run of consecutive rows is read
            as one slice.
        frame : int
            Which volume of a 4D input; 0 for a 3D one.

        Returns
        -------
        (len(rows), y, z) array of `dtype`, native byte order.
        """
        rows = np.asarray(rows, dtype=np.intp).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"{self.path}: rows must lie in 0..{self.shape[0] - 1}")
        if not 0 <= frame < self.n_frames:
            raise IndexError(f"{self.path}: frame must lie in 0..{self.n_frames - 1}")
        tail = ((frame,) if len(self.shape) == 4 else ()) + (0,) * self._extra_axes
        out = np.empty((rows.size, *self.shape[1:3]), self.dtype)
        with reading(self.path), self._open() as data:
            if self._axes is not None:
                data = _Permuted(data, self._axes)
            for start, stop in _runs(rows):
                first = int(rows[start])
                index = (slice(first, first + stop - start), slice(None), slice(None), *tail)
                out[start:stop] = data[index]  # the assignment makes the byte order native
        return out

    def read_frame(self, frame: int = 0) -> np.ndarray:
        """The whole 3D volume ``frame``, in the file's own layout (an x-fastest NIfTI comes
        back x-fastest, not transposed): one read in file order, or, where the file maps
        (`mapped`), a memory map that reads nothing until used. The engine takes either
        layout as it is."""
        if not 0 <= frame < self.n_frames:
            raise IndexError(f"{self.path}: frame must lie in 0..{self.n_frames - 1}")
        tail = ((frame,) if len(self.shape) == 4 else ()) + (0,) * self._extra_axes
        with reading(self.path), self._open() as data:
            if self._axes is not None:
                data = _Permuted(data, self._axes)
            whole = data[(slice(None),) * 3 + tail] if tail else data[...]
            return np.asanyarray(whole)

    @property
    def mapped(self) -> bool:
        """Whether `read_frame` maps the file rather than reading it: a 3D .npy, or an
        uncompressed, unscaled 3D NIfTI/Analyze in native byte order."""
        return self._mapped

    def sha256(self) -> str:
        """SHA-256 of the file's bytes (the HDF5 file for ``file.h5:/dataset``), streamed.

        A gzip file (``.gz``, ``.mgz``) is also decompressed on the way, which checks the
        CRC-32 and size in the trailer of every member: readers such as nibabel stop at the
        data and never read the trailer, so a corrupt stream would otherwise be filtered as
        if it were sound. The pipeline awaits this before marking an output complete.
        An HDF5 dataset that reads other files (allowed with ``external``) adds its data as
        read, so that a change in those files is a change of input.

        Raises
        ------
        InputError
            The gzip stream is corrupt or cut short.
        """
        digest = hashlib.sha256()
        gzipped = self.file.name.lower().endswith((".gz", ".mgz"))
        check = _GzipCheck(self.path) if gzipped else None
        with open(self.file, "rb") as f:
            while block := f.read(2**20):
                digest.update(block)
                if check is not None:
                    check.feed(block)
        if check is not None:
            check.close()
        if self._digest_data:
            self._digest_rows(digest)
        return digest.hexdigest()

    def _digest_rows(self, digest: Any) -> None:
        """Feed ``digest`` the volume's data, frame by frame in blocks of rows (at most
        about 64 MiB each), as `read_rows` returns it."""
        row_bytes = max(1, int(np.prod(self.shape[1:3])) * self.dtype.itemsize)
        step = max(1, 2**26 // row_bytes)
        for t in range(self.n_frames):
            for a in range(0, self.shape[0], step):
                rows = np.arange(a, min(a + step, self.shape[0]))
                digest.update(np.ascontiguousarray(self.read_rows(rows, t)).tobytes())


class _GzipCheck:
    """Decompresses a gzip stream fed block by block, only to check it: zlib verifies the
    CRC-32 and size (ISIZE) of each member; members may follow one another, and zero bytes
    may pad the end (as Python's gzip module allows)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stream: zlib._Decompress | None = zlib.decompressobj(wbits=31)

    def feed(self, data: bytes) -> None:
        try:
            while data:
                if self.stream is None:  # between members: padding, or the next member
                    data = data.lstrip(b"\0")
                    if not data:
                        return
                    self.stream = zlib.decompressobj(wbits=31)
                while data and not self.stream.eof:
                    self.stream.decompress(data, 2**24)  # bounded: zeros compress 1000x
                    data = self.stream.unconsumed_tail
                if self.stream.eof:  # this member's trailer checked
                    data, self.stream = self.stream.unused_data, None
        except zlib.error as e:
            raise CorruptInputError(f"{self.path}: the gzip stream is corrupt ({e})") from None

    def close(self) -> None:
        if self.stream is not None and not self.stream.eof:
            raise CorruptInputError(f"{self.path}: the gzip stream is cut short (no trailer)")


class _Permuted:
    """Slices ``data`` as if its axes were in the order ``axes`` (as `numpy.transpose`
    takes them), reading only what the index selects. Indices are ints and slices."""

    def __init__(self, data: Any, axes: tuple[int, ...]) -> None:
        self.data, self.axes = data, axes

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = (*index, *(slice(None),) * (len(self.axes) - len(index)))
        in_file: list = [None] * len(self.axes)
        for axis, i in zip(self.axes, index, strict=True):
            in_file[axis] = i
        out = np.asarray(self.data[tuple(in_file)])
        kept = [a for a in self.axes if not isinstance(in_file[a], int | np.integer)]
        return out.transpose([sorted(kept).index(a) for a in kept])


def _runs(rows: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` positions in ``rows`` of each run of consecutive increasing rows."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    edges = [0, *breaks.tolist(), rows.size]
    for start, stop in pairwise(edges):
        if stop > start:
            yield start, stop


def _stem(file: Path) -> str:
    """File name without extensions: ``a.nii.gz`` -> ``a``, ``sub-1.v2.npy`` -> ``sub-1.v2``."""
    name = file.name
    if Path(name).suffix.lower() in COMPRESSED:
        name = Path(name).stem
    return Path(name).stem or name


def check_size(path: str, file: Path, needed: int) -> None:
    """Refuse ``file`` if it holds fewer than ``needed`` bytes (uncompressed, for gzip).

    Uncompressed files (NIfTI ``.nii``, Analyze and NIfTI-pair ``.img``, MGH ``.mgh``,
    ``.npy``): the file's size. gzip files (``.nii.gz``, ``.mgz``): the size the gzip
    trailer records (the last 4 bytes: the uncompressed size mod 2**32, which a cut stream
    matches by chance once in 4e9), and only where it differs (a trailer after the data,
    several gzip members) one streamed decompression (0.07-0.11 s for a 256^3 uint8
    volume). HDF5 refuses a truncated file itself (its superblock records the end); MINC,
    .bz2, .zst: what their readers say.
    """
    if file.name.lower().endswith((".gz", ".mgz")):
        have = _gzip_size(file, needed)
    elif file.suffix.lower() in COMPRESSED:
        return  # bz2, zst: no cheap check; reading tells
    else:
        have = file.stat().st_size
    if have < needed:
        raise InputError(
            f"{path}: the file is truncated: {have} of the {needed} bytes its header "
            "promises are there"
        )


def _gzip_size(file: Path, needed: int) -> int:
    """``needed`` if the gzip trailer says so, else the uncompressed bytes there are (read
    until ``needed`` is reached)."""
    with open(file, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() >= 18:  # the smallest gzip member
            f.seek(-4, os.SEEK_END)
            if int.from_bytes(f.read(4), "little") == needed % 2**32:
                return needed
        f.seek(0)
        have, stream = 0, zlib.decompressobj(wbits=31)
        while have < needed and (data := f.read(2**20)):
            while data and have < needed:
                have += len(stream.decompress(data, 2**24))  # bounded: zeros compress 1000x
                if stream.eof:  # the next member, if any, follows
                    data, stream = stream.unused_data, zlib.decompressobj(wbits=31)
                else:
                    data = stream.unconsumed_tail
        return have


def check_shape_type(path: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse what the engine cannot filter: wrong ndim, empty, non-numeric types."""
    if len(shape) not in (3, 4):
        raise InputError(f"{path}: a 3D or 4D volume is needed; it has shape {shape}")
    if min(shape) < 1:
        raise InputError(f"{path}: the volume is empty (shape {shape})")
    if np.dtype(dtype).kind not in "iuf":
        raise InputError(
            f"{path}: element type {np.dtype(dtype)} is not supported (integers and floats only)"
        )


def squeeze_tail(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Drop trailing length-1 axes beyond the fourth: (x, y, z, t, 1) is a 4D volume."""
    shape, extra = tuple(int(s) for s in shape), 0
    while len(shape) > 4 and shape[-1] == 1:
        shape, extra = shape[:-1], extra + 1
    return shape, extra


def make_volume(
    path: str,
    file: Path,
    shape: tuple[int, ...],
    dtype: np.dtype,
    affine: object,
    voxel_size: tuple[float, ...] | None,
    opener: Callable[[], AbstractContextManager],
    extra_axes: int,
    axes: tuple[int, ...] | None = None,
    mapped: bool = False,
    voxel_unknown: str = "",
    digest_data: bool = False,
) -> Volume:
    """Build the `Volume`; ``voxel_size`` None takes the affine's column norms."""
    affine = np.asarray(affine, dtype=np.float64)
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        raise InputError(f"{path}: the affine must be a finite 4x4 array; got {affine.shape}")
    if voxel_size is None:  # as nibabel.affines.voxel_sizes
        voxel_size = np.sqrt(np.sum(affine[:3, :3] ** 2, axis=0))
    return Volume(
        path=path,
        shape=shape,
        dtype=np.dtype(dtype).newbyteorder("="),
        affine=affine,
        voxel_size=tuple(float(v) for v in voxel_size[:3]),
        n_frames=shape[3] if len(shape) == 4 else 1,
        stem=_stem(file),
        parent=file.absolute().parent.name,
        file=file,
        _open=opener,
        _extra_axes=extra_axes,
        _axes=axes,
        _mapped=mapped and len(shape) == 3 and not extra_axes and axes is None,
        voxel_unknown=voxel_unknown,
        _digest_data=digest_data,
    )


@contextmanager
def reading(path: str) -> Iterator[None]:
    """Turn what the readers raise for a bad file into an `InputError` naming it."""
    try:
        yield
    except InputError:
        raise
    except read_errors() as e:
        reason = " ".join(str(e).split())  # one line, whatever the reader's message holds
        raise InputError(f"{path}: cannot read it ({type(e).__name__}: {reason})") from e
