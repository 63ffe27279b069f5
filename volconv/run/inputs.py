"""The read stage: input volumes opened lazily and read a slab of rows at a time.

`open_volume` understands everything nibabel loads (NIfTI-1/2, MINC, Analyze, MGH), ``.npy``
files (memory-mapped) and HDF5 datasets named ``file.h5:/dataset``. A `Volume` knows its shape,
type and geometry without reading the voxels; `Volume.read_rows` reads only the rows along
axis 0 that a slab needs. Opening also checks, cheaply, that the file holds all the data its
header promises (`_check_size`), so `validate` and `run` refuse a truncated input before any
work.
`expand_inputs` turns the pipeline's paths and globs into inputs.

An HDF5 dataset can read other files: a virtual dataset (VDS) maps other files' datasets,
external storage keeps its bytes in raw files, an external link reaches into another HDF5
file. None of these is opened unless the user allows it (``[input] external = true``,
``external=True`` here); where allowed, every file a VDS maps must be there (HDF5 itself
would read a missing one as fill values), and the input's SHA-256 covers the data read, not
only the container (`Volume.sha256`).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from volconv.checks import file_kind

if TYPE_CHECKING:
    import nibabel as nib

# "file.h5:/group/data" -> ("file.h5", "/group/data"); the suffix keeps Windows drives and
# colons in folder names out of it.
_HDF5_SPEC = re.compile(r"^(?P<file>.+\.(?:h5|hdf5)):(?P<dataset>.*)$", re.IGNORECASE)
_COMPRESSED = {".gz", ".bz2", ".zst"}
_GLOB = re.compile(r"[*?\[]")


def _read_errors() -> tuple[type[BaseException], ...]:
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
        with _reading(self.path), self._open() as data:
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
        with _reading(self.path), self._open() as data:
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


def split_spec(spec: str | Path) -> tuple[str, str | None]:
    """``"f.h5:/ds"`` -> ``("f.h5", "/ds")``; any other input -> ``(spec, None)``."""
    m = _HDF5_SPEC.match(str(spec))
    if m is None:
        return str(spec), None
    dataset = m["dataset"].strip()
    return m["file"], ("/" + dataset.lstrip("/")) if dataset else None


def _stem(file: Path) -> str:
    """File name without extensions: ``a.nii.gz`` -> ``a``, ``sub-1.v2.npy`` -> ``sub-1.v2``."""
    name = file.name
    if Path(name).suffix.lower() in _COMPRESSED:
        name = Path(name).stem
    return Path(name).stem or name


def open_volume(spec: str | Path, *, external: bool = False) -> Volume:
    """Open an input volume without reading its voxels.

    Parameters
    ----------
    spec : str or Path
        A file nibabel loads (NIfTI-1/2 ``.nii``/``.nii.gz``, MINC, Analyze, MGH), a ``.npy``
        file, or an HDF5 dataset as ``file.h5:/dataset`` (or ``.hdf5``). 4D inputs hold T
        volumes along their last axis; trailing axes of length 1 beyond the fourth are
        dropped.
    external : bool
        Allow an HDF5 dataset that reads other files: a virtual dataset, external storage,
        or one reached through an external link (``[input] external``). Refused otherwise.

    Raises
    ------
    InputError
        The file is missing, a folder, unreadable or truncated (see `check_data`), or the
        volume is not a non-empty 3D/4D array of integers or floats (bool and complex are
        refused); for HDF5, also a missing dataset (the message lists the datasets the file
        holds); for a 4D MINC file, dimensions other than three spatial ones and time; an
        HDF5 dataset that reads other files, unless ``external`` (and then, a virtual
        dataset whose source file or dataset is missing).
    """
    path = str(spec)
    name, dataset = split_spec(path)
    file = Path(name)
    if file.is_dir():
        raise InputError(f"{name}: is a folder, not a volume file")
    if not file.exists():
        raise InputError(f"{name}: no such file")
    if not file.is_file():  # a FIFO, a device: no volume file, and opening one may block
        raise InputError(f"{name}: is {file_kind(file)}, not a volume file")
    with _reading(path):
        if dataset is not None or file.suffix.lower() in (".h5", ".hdf5"):
            return _open_hdf5(path, file, dataset, external)
        if file.suffix.lower() == ".npy":
            return _open_npy(path, file)
        if file.suffix.lower() == ".nii" and (volume := _open_plain_nifti(path, file)):
            return volume
        return _open_nibabel(path, file)


def _check_size(path: str, file: Path, needed: int) -> None:
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
    elif file.suffix.lower() in _COMPRESSED:
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


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn what the readers raise for a bad file into an `InputError` naming it."""
    try:
        yield
    except InputError:
        raise
    except _read_errors() as e:
        reason = " ".join(str(e).split())  # one line, whatever the reader's message holds
        raise InputError(f"{path}: cannot read it ({type(e).__name__}: {reason})") from e


def _check(path: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse what the engine cannot filter: wrong ndim, empty, non-numeric types."""
    if len(shape) not in (3, 4):
        raise InputError(f"{path}: a 3D or 4D volume is needed; it has shape {shape}")
    if min(shape) < 1:
        raise InputError(f"{path}: the volume is empty (shape {shape})")
    if np.dtype(dtype).kind not in "iuf":
        raise InputError(
            f"{path}: element type {np.dtype(dtype)} is not supported (integers and floats only)"
        )


def _squeeze_tail(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Drop trailing length-1 axes beyond the fourth: (x, y, z, t, 1) is a 4D volume."""
    shape, extra = tuple(int(s) for s in shape), 0
    while len(shape) > 4 and shape[-1] == 1:
        shape, extra = shape[:-1], extra + 1
    return shape, extra


def _volume(
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


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _is_hdf5(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE


def _open_nibabel(path: str, file: Path) -> Volume:
    import nibabel as nib

    try:
        img = nib.load(file)
    except _read_errors() as e:
        if _is_hdf5(file):  # MINC2 is HDF5: any other HDF5 file fails deep inside nibabel
            raise InputError(
                f"{path}: is an HDF5 file but not a MINC2 volume ({type(e).__name__}: "
                f"{' '.join(str(e).split())}); to read one of its datasets, give it an .h5 "
                "name and the input as file.h5:/dataset"
            ) from e
        raise
    proxy = img.dataobj
    shape, extra = _squeeze_tail(img.shape)
    _check(path, shape, img.get_data_dtype())
    if isinstance(proxy, nib.arrayproxy.ArrayProxy) and isinstance(proxy.file_like, str):
        needed = proxy.offset + int(np.prod(proxy.shape)) * np.dtype(proxy.dtype).itemsize
        _check_size(path, Path(proxy.file_like), needed)
    # scl_slope/inter make the proxy return floats: ask it for one voxel to learn which.
    dtype = np.asarray(proxy[(0,) * len(img.shape)]).dtype
    zooms = tuple(float(z) for z in img.header.get_zooms())
    axes = _minc_axes(path, img) if isinstance(img, nib.minc1.Minc1Image) else None
    if axes is not None:  # time first in the file: (x, y, z, t) for the pipeline
        shape = tuple(shape[a] for a in axes)
        zooms = tuple(zooms[a] for a in axes)
    mapped = (  # nibabel maps such a file: np.asarray(proxy) reads nothing until used
        isinstance(proxy, nib.arrayproxy.ArrayProxy)
        and isinstance(proxy.file_like, str)
        and Path(proxy.file_like).suffix.lower() not in _COMPRESSED
        and getattr(proxy, "_mmap", False) is not False
        and dtype == np.dtype(proxy.dtype)
        and np.dtype(proxy.dtype).isnative
    )
    return _volume(path, file, shape, dtype, img.affine, zooms[:3], lambda: nullcontext(proxy),
                   extra, axes, mapped, _unknown_zooms(img, zooms[:3]))  # fmt: skip


# NIfTI-1 datatype codes nibabel reads as these types (bool and complex: nibabel's path).
_NIFTI_TYPES = {2: "u1", 4: "i2", 8: "i4", 16: "f4", 64: "f8", 256: "i1", 512: "u2",
                768: "u4", 1024: "i8", 1280: "u8"}  # fmt: skip
# The 348-byte header and the 4 bytes after it (nonzero: extensions follow), native order.
_NIFTI_FIELDS = [
    ("sizeof_hdr", "i4"), ("_1", "V36"), ("dim", "i2", 8), ("_2", "V14"), ("datatype", "i2"),
    ("bitpix", "i2"), ("_3", "V2"), ("pixdim", "f4", 8), ("vox_offset", "f4"),
    ("scl_slope", "f4"), ("scl_inter", "f4"), ("_4", "V3"), ("xyzt_units", "u1"),
    ("_5", "V128"), ("qform_code", "i2"),
    ("sform_code", "i2"), ("_6", "V24"), ("srow", "f4", (3, 4)), ("_7", "V16"),
    ("magic", "S4"), ("ext", "u1", 4),
]  # fmt: skip


def _open_plain_nifti(path: str, file: Path) -> Volume | None:
    """A plain single-file NIfTI-1 (``.nii``) read without nibabel (whose import costs more
    than the rest of a small run's start), or None where nibabel must read it: the volume
    is the one nibabel gives for such a file, which this accepts only where nibabel would
    fix nothing in the header and scale nothing (a scl_slope of 0, NaN or 1 with scl_inter
    0): native byte order (sizeof_hdr reads 348), no extensions, 3D or 4D, a known integer
    or float type, positive voxel sizes, an sform (a qform, or no transform, is nibabel's),
    the data after the header."""
    header = np.dtype(_NIFTI_FIELDS)
    with open(file, "rb") as f:
        raw = f.read(header.itemsize)
    if len(raw) < header.itemsize:
        return None
    h = np.frombuffer(raw, header)[0]
    ndim = int(h["dim"][0])
    dtype = _NIFTI_TYPES.get(int(h["datatype"]))
    offset = float(h["vox_offset"])
    slope = float(h["scl_slope"])
    unscaled = slope == 0 or not math.isfinite(slope) or (slope, float(h["scl_inter"])) == (1, 0)
    pixdim = h["pixdim"]
    if not (
        h["sizeof_hdr"] == 348 and h["magic"] == b"n+1" and not h["ext"][0]
        and ndim in (3, 4) and min(h["dim"][1 : ndim + 1]) >= 1 and dtype is not None
        and h["bitpix"] == 8 * np.dtype(dtype).itemsize and pixdim[0] in (-1, 1)
        and all(math.isfinite(v) and v > 0 for v in pixdim[1 : ndim + 1])
        and 352 <= offset == int(offset) and unscaled
        and 0 < h["sform_code"] <= 4 and 0 <= h["qform_code"] <= 4  # codes every nibabel knows
    ):  # fmt: skip
        return None
    shape = tuple(int(n) for n in h["dim"][1 : ndim + 1])
    _check_size(path, file, int(offset) + math.prod(shape) * np.dtype(dtype).itemsize)
    affine = np.eye(4)
    affine[:3] = h["srow"]

    def opener() -> AbstractContextManager:  # a fresh map per read, as for a .npy
        return nullcontext(_NiftiData(np.memmap(file, dtype, "c", int(offset), shape, order="F")))

    volume = _volume(path, file, shape, np.dtype(dtype), affine,
                     tuple(float(v) for v in pixdim[1:4]), opener, 0, mapped=True)  # fmt: skip
    units = int(h["xyzt_units"])
    if h["qform_code"] == 0 and units % 8 in _UNITS and units - units % 8 in _UNITS:
        volume.nifti_header = _PlainHeader(h, ndim)
    return volume


# NIfTI's unit codes, as nibabel names them.
_UNITS = {0: "unknown", 1: "meter", 2: "mm", 3: "micron", 8: "sec", 16: "msec", 24: "usec",
          32: "hz", 40: "ppm", 48: "rads"}  # fmt: skip


class _PlainHeader:
    """What `volconv.output.space` reads of a NIfTI header, as nibabel's gives it, for a
    plain NIfTI-1 (`_open_plain_nifti`) without a qform."""

    def __init__(self, h: np.void, ndim: int) -> None:
        self._h, self._ndim = h, ndim

    def get_sform(self, coded: bool = False) -> Any:
        out = np.eye(4)
        out[:3] = self._h["srow"]
        return (out, int(self._h["sform_code"])) if coded else out

    def get_qform(self, coded: bool = True) -> tuple[None, int]:
        if not coded:  # the matrix of a qform code 0 is nibabel's to make
            raise NotImplementedError("only get_qform(coded=True)")
        return None, 0

    def get_xyzt_units(self) -> tuple[str, str]:
        code = int(self._h["xyzt_units"])
        return _UNITS[code % 8], _UNITS[code - code % 8]

    def get_zooms(self) -> tuple[np.float32, ...]:
        return tuple(self._h["pixdim"][1 : self._ndim + 1])


class _NiftiData:
    """Slices as nibabel's proxy does: the whole volume as the memory map itself (read as
    used), any part of it as an array of its own."""

    def __init__(self, mapped: np.memmap) -> None:
        self._mapped = mapped

    def __getitem__(self, index: Any) -> np.ndarray:
        if index is Ellipsis:
            return self._mapped
        return np.array(self._mapped[index])


def _unknown_zooms(img: Any, zooms: tuple[float, ...]) -> str:
    """Why the header gives no voxel size ("" where it does). nibabel replaces a NIfTI or
    Analyze pixdim of 0 by 1 on loading (with a log line only): the raw header decides."""
    raw = zooms
    header = img.header
    if "pixdim" in getattr(header, "keys", lambda: ())():
        import nibabel as nib

        try:
            holder = img.file_map.get("header") or img.file_map["image"]  # .hdr, or .nii
            with nib.openers.ImageOpener(holder.filename) as f:
                unchecked = type(header).from_fileobj(f, check=False)
            raw = tuple(float(v) for v in unchecked["pixdim"][1:4])
        except (OSError, ValueError, KeyError, EOFError):
            pass
    if len(raw) == 3 and all(math.isfinite(v) and v != 0 for v in raw):
        return ""  # a negative pixdim is a sign nibabel drops, not a missing size
    return f"its header's voxel size is {' x '.join(f'{v:g}' for v in raw)}"


def _minc_axes(path: str, img: nib.minc1.Minc1Image) -> tuple[int, ...] | None:
    """For a 4D MINC file (MINC2 derives from MINC1 in nibabel) whose time axis is not the
    last: the file's axes as (three spatial ones in the file's order, time). nibabel's
    affine maps the spatial axes in that order already. The dimension names decide."""
    if len(img.shape) != 4:
        return None
    minc = getattr(img.dataobj, "minc_file", None)
    names = [str(n) for n in getattr(minc, "_dim_names", None) or ()]
    spatial = [str(n) for n in getattr(minc, "_spatial_dims", None) or ()]
    other = [i for i, n in enumerate(names) if n not in spatial]
    if len(names) != 4 or len(spatial) != 3 or len(other) != 1 or names[other[0]] != "time":
        raise InputError(
            f"{path}: a 4D MINC volume needs three spatial dimensions and time; its "
            f"dimensions are {', '.join(names) or 'not named'}"
        )
    t = other[0]
    return None if t == 3 else (*(i for i in range(4) if i != t), t)


def _open_npy(path: str, file: Path) -> Volume:
    with open(file, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major in (1, 2):  # 3 (UTF-8 field names) is rare: reading tells
            read = (np.lib.format.read_array_header_1_0 if major == 1
                    else np.lib.format.read_array_header_2_0)  # fmt: skip
            shape, _, dtype = read(f)
            if not dtype.hasobject:  # refused below, without reading
                _check_size(path, file, f.tell() + int(np.prod(shape)) * dtype.itemsize)
    arr = np.load(file, mmap_mode="r", allow_pickle=False)
    shape, extra = _squeeze_tail(arr.shape)
    _check(path, shape, arr.dtype)
    # A fresh memory map per read, so no mapping outlives the slab that needed it.
    opener = lambda: nullcontext(np.load(file, mmap_mode="r"))  # noqa: E731
    return _volume(path, file, shape, arr.dtype, np.eye(4), None, opener, extra,
                   mapped=arr.dtype.isnative,
                   voxel_unknown="a .npy file records no voxel size")  # fmt: skip


def _open_hdf5(path: str, file: Path, dataset: str | None, external: bool = False) -> Volume:
    with h5py.File(file, "r") as f:
        linked = _links_out(f, dataset) if dataset else []
        if linked and not external:
            raise InputError(_refusal(path, "is reached through an external link to", linked))
        obj = f.get(dataset) if dataset else None
        if not isinstance(obj, h5py.Dataset):
            held = ", ".join(_datasets(f)) or "none"
            what = f"no dataset {dataset}" if dataset else "name a dataset as file.h5:/dataset"
            raise InputError(f"{path}: {what}; the file's datasets: {held}")
        if obj.shape is None:  # a null dataspace (h5py.Empty): no voxels at all
            raise InputError(f"{path}: the dataset is empty (a null dataspace, no voxels)")
        reads = _reads_other_files(path, file, obj, external)
        shape, extra = _squeeze_tail(obj.shape)
        _check(path, shape, obj.dtype)
        dtype = obj.dtype
        given = "affine" in obj.attrs
        affine = obj.attrs["affine"] if given else np.eye(4)

    @contextmanager
    def opener() -> Iterator[h5py.Dataset]:
        with h5py.File(file, "r") as f:
            yield f[dataset]

    unknown = "" if given else "the HDF5 dataset has no affine attribute (no voxel size)"
    return _volume(path, file, shape, dtype, affine, None, opener, extra,
                   voxel_unknown=unknown, digest_data=bool(linked or reads))  # fmt: skip


def _refusal(path: str, what: str, targets: list[str]) -> str:
    shown = ", ".join(targets[:3]) + (f" and {len(targets) - 3} more" if len(targets) > 3 else "")
    return (
        f"{path}: {what} {shown}: volconv reads no other file unless allowed "
        "(set input.external = true to allow it)"
    )


def _links_out(f: h5py.File, dataset: str) -> list[str]:
    """The external links on the way to ``dataset`` in ``f`` ("file:/path" each), found
    without following one: soft links are resolved here, by name, so that none leads out
    of the file unseen."""
    found: list[str] = []
    todo, done, steps = [p for p in dataset.split("/") if p], "", 0
    while todo:
        steps += 1
        if steps > 256:  # soft links in a loop: h5py says what it finds
            break
        name = f"{done}/{todo.pop(0)}"
        try:
            link = f.get(name, getlink=True)
        except (KeyError, OSError, ValueError):
            break  # missing: the open below names it
        if isinstance(link, h5py.ExternalLink):
            found.append(f"{link.filename}:{link.path}")
            break  # what lies beyond is in the other file
        if isinstance(link, h5py.SoftLink):
            target = link.path
            base = [] if target.startswith("/") else [p for p in done.split("/") if p]
            todo = base + [p for p in target.split("/") if p] + todo
            done = ""
        else:
            done = name
    return found


def _reads_other_files(
    path: str, file: Path, obj: h5py.Dataset, external: bool, depth: int = 0
) -> bool:
    """Refuse a dataset whose data lies in other files (a VDS of other files, external
    storage, a VDS source reached through an external link) unless ``external``; refuse a
    VDS whose source file or dataset is missing (HDF5 reads one as fill values), its
    sources' own sources too. Whether the dataset reads other files."""
    if depth > 8:
        raise InputError(f"{path}: virtual datasets map one another more than 8 deep")
    dcpl = obj.id.get_create_plist()
    stored = [dcpl.get_external(i)[0].decode(errors="replace")
              for i in range(dcpl.get_external_count())]  # fmt: skip
    if stored and not external:
        raise InputError(_refusal(path, "keeps its data in the external files", stored))
    for name in stored:  # HDF5 opens them from the working folder, as named
        if not Path(name).is_file():
            raise InputError(f"{path}: the external file {name} of its data is missing")
    if not obj.is_virtual:
        return bool(stored)
    sources = obj.virtual_sources()
    # a source in the file itself (".") reads nothing else, unless through a link
    others = [f"{s.file_name}:{s.dset_name}" for s in sources if s.file_name != "."]
    if others and not external:
        raise InputError(_refusal(path, "is a virtual dataset reading", others))
    reads = bool(stored or others)
    here = Path(obj.file.filename)
    for source in sources:
        found = _source_file(source.file_name, here)
        if found is None:
            raise InputError(
                f"{path}: the virtual dataset's source file {source.file_name} is missing "
                "(HDF5 would read it as fill values)"
            )
        try:
            with h5py.File(found, "r") as src:
                linked = _links_out(src, source.dset_name)
                if linked and not external:
                    raise InputError(_refusal(
                        path, "is a virtual dataset reading, through an external link,", linked
                    ))  # fmt: skip
                held = src.get(source.dset_name)
                ok = isinstance(held, h5py.Dataset)
                if ok:  # a source may itself be virtual, or stored elsewhere
                    reads |= _reads_other_files(path, found, held, external, depth + 1)
                reads |= bool(linked)
        except OSError as e:
            raise InputError(
                f"{path}: the virtual dataset's source file {source.file_name} cannot be "
                f"read ({' '.join(str(e).split())})"
            ) from None
        if not ok:
            raise InputError(
                f"{path}: the virtual dataset's source {source.file_name}:{source.dset_name} "
                "is missing (HDF5 would read it as fill values)"
            )
    return reads


def _source_file(name: str, vds: Path) -> Path | None:
    """Where HDF5 finds a VDS source file: ``.`` is the VDS file itself; a relative name is
    looked up beside the VDS file, then from the working folder."""
    if name == ".":
        return vds
    given = Path(name)
    for candidate in (given,) if given.is_absolute() else (vds.parent / given, given):
        if candidate.is_file():
            return candidate
    return None


def _datasets(f: h5py.File) -> list[str]:
    """Every dataset in an HDF5 file, by absolute name."""
    names: list[str] = []
    f.visititems(lambda n, obj: names.append(f"/{n}") if isinstance(obj, h5py.Dataset) else None)
    return names


def expand_inputs(patterns: list[str], base_dir: Path) -> list[str]:
    """Input files named by paths and globs, sorted and without duplicates.

    Parameters
    ----------
    patterns : list of str
        Files or globs (``*``, ``?``, ``[...]``, ``**``), relative to ``base_dir`` unless
        absolute; a name that is a file is that file, whatever its characters; an HDF5
        dataset suffix (``"scans/*.h5:/data"``) is kept on every match.
    base_dir : Path
        The folder relative paths start from (the pipeline file's folder).

    Raises
    ------
    InputError
        A pattern matches no file, or names a folder.
    """
    found: set[str] = set()
    for pattern in patterns:
        name, dataset = split_spec(pattern)
        full = os.path.join(base_dir, os.path.expanduser(name))
        if os.path.isfile(full):  # a file is itself, even named "[x].npy"
            matches = [full]
        elif _GLOB.search(name):
            matches = [m for m in glob.glob(full, recursive=True) if os.path.isfile(m)]
        else:
            matches = []
        if not matches:
            if os.path.exists(full):  # a folder, a FIFO, a device
                kind = file_kind(full)
                raise InputError(f"{pattern}: is {kind}, not a volume file (in {base_dir})")
            what = "matches no file" if _GLOB.search(name) else "no such file"
            raise InputError(f"{pattern}: {what} (looked in {base_dir})")
        suffix = f":{dataset}" if dataset else ""
        found.update(os.path.normpath(m) + suffix for m in matches)
    return sorted(found)
