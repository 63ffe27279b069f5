"""The output stage: one writer protocol (`volconv.output.base.SlabWriter`: open, write a
slab, drain, finish, keep on an interrupt, read back, is complete) and its formats:

========  ==========================  ==============================================
format    path suffix                 module
========  ==========================  ==============================================
hdf5      ``.h5`` (default)           `volconv.output.hdf5`
nifti     ``.nii``, ``.nii.gz``       `volconv.output.nifti` (+ a ``.json`` sidecar)
zarr      ``.zarr`` (a folder)        `volconv.output.omezarr` (OME-Zarr, NGFF 0.5)
========  ==========================  ==============================================

Staging (private folder, rename, dead runs) and codecs live beside them. A new format is one
module with a `SlabWriter` subclass, ``is_complete``, ``made`` and ``read``, named in
`_MODULES`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from volconv.bank.outputs import stored_kernels
from volconv.checks import file_kind
from volconv.errors import OutputError, OutputExistsError, OutputWriteError
from volconv.output.base import SlabWriter
from volconv.output.codecs import (
    COMPRESSIONS,
    DTYPES,
    _direct_codec,
    _pool,
    backlog_bytes,
    compression_options,
    slabs_in_flight,
)
from volconv.output.hdf5 import HDF5Writer, ResponseWriter, chunk_shape
from volconv.output.provenance import ROOT_ATTRS
from volconv.output.space import Space
from volconv.output.staging import (
    _cause,
    dead_runs,
    is_regular,
    private_prefix,
    remove_later,
    remove_stale_temps,
    wait_for_removals,
)
from volconv.output.staging import check_output_path as _check_file_path

if TYPE_CHECKING:
    from volconv.bank.outputs import Output

__all__ = [
    "COMPRESSIONS",
    "DTYPES",
    "FORMATS",
    "ROOT_ATTRS",
    "HDF5Writer",
    "OutputError",
    "OutputExistsError",
    "OutputWriteError",
    "ResponseWriter",
    "SlabWriter",
    "Space",
    "_direct_codec",
    "_pool",
    "backlog_bytes",
    "check_compression",
    "check_output_path",
    "chunk_shape",
    "compression_options",
    "dead_runs",
    "format_of",
    "holds",
    "is_complete",
    "is_regular",
    "made",
    "open_partial",
    "open_writer",
    "private_prefix",
    "read",
    "remove_later",
    "remove_stale_temps",
    "slabs_in_flight",
    "wait_for_removals",
]

FORMATS = ("hdf5", "nifti", "zarr")
SUFFIXES = {".h5": "hdf5", ".hdf5": "hdf5", ".nii": "nifti", ".nii.gz": "nifti", ".zarr": "zarr"}
_MODULES = {"hdf5": "volconv.output.hdf5", "nifti": "volconv.output.nifti",
            "zarr": "volconv.output.omezarr"}  # fmt: skip


def format_of(path: str | Path, format: str | None = None) -> str:
    """The format of an output at ``path``: ``format`` where given (and the path's suffix,
    if it is one volconv knows, must agree), else the suffix's.

    Raises
    ------
    OutputError
        An unknown format, a suffix volconv cannot write (without ``format``), or a suffix
        of another format.
    """
    name = Path(path).name.lower()
    suffix = next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")
    known = ", ".join(SUFFIXES)
    if format is not None:
        if format not in FORMATS:
            raise OutputError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
        if suffix and SUFFIXES[suffix] != format:
            raise OutputError(
                f"{path}: a {suffix} path is written as {SUFFIXES[suffix]}, not {format}; "
                f"change the suffix or the format"
            )
        if format != "hdf5" and not suffix:
            raise OutputError(
                f"{path}: a {format} output needs its suffix "
                f"({', '.join(s for s, f in SUFFIXES.items() if f == format)})"
            )
        return format
    if not suffix:
        shown = "".join(Path(path).suffixes[-2:]) or "no suffix"
        raise OutputError(
            f"{path}: volconv cannot write {shown}; end the path with one of {known} "
            "(or set [output] format)"
        )
    return SUFFIXES[suffix]


def check_compression(format: str, name: str) -> None:
    """Refuse a compression ``name`` that ``format`` cannot write (OutputError)."""
    if format == "hdf5":
        compression_options(name)
    else:
        module(format).codec(name)


def module(format: str) -> ModuleType:
    """The module of ``format`` (imported when first needed: zarr is slow to import)."""
    return importlib.import_module(_MODULES[format])


def _guess(path: Path) -> str:
    """The format an existing output at ``path`` is in: by suffix, else HDF5."""
    try:
        return format_of(path)
    except OutputError:
        return "hdf5"


def open_writer(
    path: Path,
    input_shape: tuple[int, ...],
    outputs: list[Output],
    *,
    format: str | None = None,
    **options: object,
) -> SlabWriter:
    """The writer of ``format`` (default: from ``path``'s suffix) for ``outputs``, the one
    place a run opens one: their names, and their kernels and extents as ``/kernels`` holds
    them (`volconv.bank.outputs.stored_kernels`: a feature output's is a (1, 1, 1) zero
    kernel); the other ``options`` as `SlabWriter` takes them (dtype, compression, scale,
    offset, boundary, cval, slab_depth, overwrite, progress, space)."""
    kernels, extents = stored_kernels(outputs)
    return module(format_of(path, format)).WRITER(
        path, input_shape, [o.name for o in outputs], kernels, extents=extents, **options
    )


def writer_for(path: Path, format: str | None = None) -> type[SlabWriter]:
    """The writer class of ``format`` or ``path``'s suffix, for a writer made from names and
    kernels (``writer_for(path, fmt)(path, shape, names, kernels, ...)``); a run opens its
    writer with its outputs (`open_writer`)."""
    return module(format_of(path, format)).WRITER


def check_output_path(path: Path) -> None:
    """Check, without creating anything, that an output can be made at ``path``: a known
    suffix (`format_of`), and for a file format, `volconv.output.staging.check_output_path`;
    an OME-Zarr output is a folder, which may exist only as a volconv output to replace."""
    fmt = _guess(Path(path))
    if fmt == "zarr" and os.path.isdir(path) and not os.path.islink(path):
        if not module("zarr").is_complete(Path(path)) and os.listdir(path):
            raise OutputError(f"{path}: is a folder that is not a volconv OME-Zarr output")
        _check_file_path(Path(path).with_name(Path(path).name + ".check"))
        return
    _check_file_path(Path(path))
    if fmt == "nifti":
        module(fmt).check_beside(Path(path))


@contextmanager
def open_partial(
    temp: Path, st: os.stat_result, shape: tuple[int, ...], dtype: np.dtype
) -> Iterator[object | None]:
    """The partial output at ``temp`` (the entry ``st`` describes, else None) as
    (N, x, y, z[, t]) values that `volconv.run.resume` reads back (`stored.PartialView`, or the
    HDF5 dataset), in the format its name says."""
    with module(_guess(Path(temp))).partial(Path(temp), st, tuple(shape), np.dtype(dtype)) as view:
        yield view


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a complete volconv output, in the format its suffix says."""
    return module(_guess(Path(path))).is_complete(Path(path))


def made(path: Path) -> dict:
    """How the complete output at ``path`` was made: ``filter names``, ``bank`` (the kernels
    of its responses, float32), ``boundary``, ``cval``, ``output dtype``, ``scale``,
    ``offset``, ``input`` (the source's SHA-256), ``features`` (JSON), ``format``. Raises
    OSError or KeyError where the output does not hold them."""
    return {**module(_guess(Path(path))).made(Path(path)), "format": _guess(Path(path))}


def read(path: str | Path):
    """A complete output, opened lazily: ``names``, ``outputs`` (one array per output,
    (x, y, z[, t]), read as sliced; uint8 values decoded with ``scale`` and ``offset``
    where asked), ``voxel_size``, ``attrs`` (the provenance) and ``format``. See
    `volconv.output.stored.Stored`."""
    return module(_guess(Path(path))).read(Path(path))


def holds(path: Path) -> str:
    """What ``path`` holds, in a few words for a message (``text``, ``a NumPy array``, ``an
    HDF5 file without complete = True``); only a regular file (or a .zarr folder) is opened."""
    import h5py

    path = Path(path)
    if _guess(path) == "zarr" and os.path.isdir(path):
        return "a volconv output" if is_complete(path) else "a folder, not a volconv OME-Zarr"
    if not is_regular(path):
        return file_kind(path)
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        return f"a file volconv cannot read ({_cause(e)})"
    if not head:
        return "an empty file"
    if h5py.is_hdf5(path):
        return "a volconv output" if is_complete(path) else "an HDF5 file without complete = True"
    if _guess(path) == "nifti" and is_complete(path):
        return "a volconv output"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array (.npy)"
    if head.startswith(b"\x1f\x8b"):
        return "gzip data"
    if head[344:348] in (b"n+1\x00", b"ni1\x00"):
        return "a NIfTI file that is not a complete volconv output (no sidecar that says so)"
    try:
        head.decode("utf-8")  # a multi-byte character cut at 512 bytes reads as binary
    except UnicodeDecodeError:
        return "binary data, not HDF5"
    return "text"
