"""HDF5: N outputs per slab into one HDF5 file per input, as docs/contract.md describes.

The writer thread's HDF5 writes release the GIL (h5py), so they overlap the device work;
gzip and lzf chunks are compressed on every core (`volconv.output.codecs`) and written with
``write_direct_chunk``. The file is created exclusively in the private folder
(`volconv.output.staging`), gets ``complete = True`` last and is then renamed into place.
Dimension scales (``filter``, ``x``, ``y``, ``z``[, ``t``]) hold world coordinates (mm, and
seconds for ``t`` where the input has a repetition time), so the file opens in xarray
(``engine="h5netcdf"``) and netCDF tools with named dimensions and coordinates; ``/responses``
carries ilastik's ``axistags``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from volconv.errors import OutputError, OutputExistsError, OutputWriteError
from volconv.output.base import SlabWriter, _Slab
from volconv.output.codecs import (
    POOL_CHUNK_BYTES,
    _direct_codec,
    _pool,
    compression_options,
    needs_hdf5plugin,
    slabs_in_flight,
)
from volconv.output.provenance import ROOT_ATTRS
from volconv.output.staging import _redirect, is_regular
from volconv.output.stored import Lazy, Stored

__all__ = [
    "ROOT_ATTRS",
    "HDF5Writer",
    "OutputError",
    "OutputExistsError",
    "OutputWriteError",
    "ResponseWriter",
]

# Largest chunk: big enough that a slab is a few large writes, small enough that a reader
# taking a small region decompresses little.
MAX_CHUNK_BYTES = 64 * 2**20
# What a file compressed with one of hdf5plugin's codecs says its readers need.
PLUGIN_NOTE = (
    "this file's /responses is compressed with {name}, an HDF5 plugin: `import hdf5plugin` "
    "before reading it with h5py or xarray (pip install hdf5plugin)"
)
# vigra's axis types, as ilastik reads them from ``axistags``
_VIGRA_TYPES = {"c": 1, "x": 2, "y": 2, "z": 2, "t": 8}


def is_complete(path: Path) -> bool:
    """Whether ``path`` is an HDF5 file whose root attribute ``complete`` is true."""
    if not is_regular(path):
        return False
    try:
        with h5py.File(path, "r") as f:
            flag = f.attrs.get("complete")
    except (OSError, ValueError, KeyError):  # missing, a folder, not HDF5, truncated (a
        # killed writer's file can fail with KeyError "bad object header version number")
        return False
    return isinstance(flag, bool | np.bool_) and bool(flag)


def chunk_shape(
    shape: tuple[int, ...], slab_depth: int, itemsize: int, max_bytes: int = MAX_CHUNK_BYTES
) -> tuple[int, ...]:
    """Chunks of ``/responses`` (N, x, y, z[, t]) that whole slabs fill.

    A chunk is one filter and frame, whole (y, z) planes, and a depth along x that divides
    the slab depth, so every slab fills its chunks completely and each chunk is written (and
    compressed) exactly once. Only the depth shrinks to stay within ``max_bytes``: the
    planes are what slabs always cover whole. A single plane larger than ``max_bytes`` is
    still one chunk.
    """
    nx, ny, nz = shape[1:4]
    depth = min(slab_depth, nx)
    plane = ny * nz * itemsize
    fits = max(1, max_bytes // plane)
    chunk_depth = max(d for d in range(1, depth + 1) if depth % d == 0 and d <= fits)
    return (1, chunk_depth, ny, nz, *(1,) * (len(shape) - 4))


def axistags(names: list[str], voxel_size: tuple[float, ...], four_d: bool) -> str:
    """ilastik's ``axistags`` (vigra's JSON) for ``/responses`` (c, x, y, z[, t]): the
    channels named by the outputs, the spatial axes with their voxel size."""
    keys = ("c", "x", "y", "z", "t")[: 5 if four_d else 4]
    resolution = {"x": voxel_size[0], "y": voxel_size[1], "z": voxel_size[2]}
    return json.dumps({"axes": [
        {"key": k, "typeFlags": _VIGRA_TYPES[k], "resolution": float(resolution.get(k, 0)),
         "description": json.dumps(names) if k == "c" else ""}
        for k in keys
    ]})  # fmt: skip


class HDF5Writer(SlabWriter):
    """Writes the N outputs of one input to an HDF5 file, slab by slab (`SlabWriter`).

    The file is created exclusively (HDF5 mode ``x``) in the private folder. ``/responses``
    (N, x, y, z[, t]) holds the values, ``/kernels`` (float32) the kernels of the response
    outputs with their ``extents``; ``boundary``, ``cval`` (and for uint8 ``scale``,
    ``offset`` and CF's ``scale_factor``, ``add_offset``, so xarray decodes it) are
    attributes of ``/responses``; ``compression`` is one of `compression_options`.
    """

    format = "hdf5"

    def _codec_for(self, compression: str) -> dict:
        filters = compression_options(compression)
        # gzip and lzf chunks are compressed on every core and go to the file with
        # write_direct_chunk: HDF5 would compress them on one core.
        self._direct = _direct_codec(filters)
        self._filtered = bool(filters)
        self.in_flight = slabs_in_flight(compression)
        return filters

    def _open(self, resumed: bool) -> None:
        # Creation order tracked as netCDF-4 files have it, for netCDF tools. No file
        # lock: the folder is this process's alone, and locks fail on many NFS mounts.
        self._file = h5py.File(self.temp, "x", track_order=True, locking=False)
        self._sync = self._file
        # HDF5's descriptor (sec2 driver): `_close_discarded` points it elsewhere.
        self._fd = self._file.id.get_vfd_handle()
        opened, named = os.fstat(self._fd), os.lstat(self.temp)
        if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino) or not stat.S_ISREG(
            named.st_mode
        ):
            raise OutputError(f"{self.path}: the temporary file {self.temp} was replaced")

    def _layout(self) -> None:
        """Create the dimension scales, ``/responses`` and ``/kernels``."""
        pooled = self._filtered and self._direct is not None
        chunks = chunk_shape((len(self.names), *self.shape), self.slab_depth,
                             self.dtype.itemsize,
                             POOL_CHUNK_BYTES if pooled else MAX_CHUNK_BYTES)  # fmt: skip
        f = self._file
        f.create_dataset("filter", data=self.names, dtype=h5py.string_dtype())
        axes = ("x", "y", "z", "t")[: len(self.shape)]
        for axis, size in zip(axes, self.shape, strict=True):
            f.create_dataset(axis, data=np.arange(size, dtype=np.float64))
        for axis, size in zip(("kx", "ky", "kz"), self.kernels.shape[1:], strict=True):
            f.create_dataset(axis, data=np.arange(size, dtype=np.float64))
        for dim in ("filter", *axes, "kx", "ky", "kz"):
            f[dim].make_scale(dim)
        responses = f.create_dataset(
            "responses", (len(self.names), *self.shape), self.dtype, chunks=chunks,
            **self._codec,
        )  # fmt: skip
        stored = f.create_dataset("kernels", data=self.kernels)
        stored.attrs["extents"] = self.extents
        for ds, dims in ((responses, ("filter", *axes)),
                         (stored, ("filter", "kx", "ky", "kz"))):  # fmt: skip
            for i, dim in enumerate(dims):
                ds.dims[i].attach_scale(f[dim])
                ds.dims[i].label = dim
        responses.attrs["boundary"] = self.boundary
        responses.attrs["cval"] = self.cval
        if self.dtype == np.uint8:
            responses.attrs["scale"] = self.scale
            responses.attrs["offset"] = self.offset
            responses.attrs["scale_factor"] = np.float32(self.scale)
            responses.attrs["add_offset"] = np.float32(self.offset)
        if needs_hdf5plugin(self.compression):  # h5py's error alone does not say what to do
            f.attrs["requires"] = "hdf5plugin"
            responses.attrs["note"] = PLUGIN_NOTE.format(name=self.compression)
        self._responses = responses

    def _resumed(self) -> None:
        """Copy the complete slabs of the file `progress` resumed into this new one, chunk
        by chunk as stored (its layout is this one's: the run's fingerprint holds the slab
        depth, and slabs fill whole chunks: `chunk_shape`), count them as written
        and remove the old file: never a ``complete`` mark (a run killed between marking and
        renaming leaves one), nor HDF5's state of a file killed while writing."""
        new = self._responses
        rows = self._resumed_rows()
        with h5py.File(self._killed, "r", locking=False) as f:
            old = f["responses"]
            for chunk in old.iter_chunks():
                frames = chunk[4] if new.ndim == 5 else slice(0, 1)
                if rows[frames, chunk[1]].all():
                    offset = tuple(c.start for c in chunk)
                    mask, data = old.id.read_direct_chunk(offset)
                    new.id.write_direct_chunk(offset, data, mask)
        self._flush()
        os.unlink(self._killed)
        self._written |= rows

    # -- writing -----------------------------------------------------------------------
    def _prepare(
        self, a: int, b: int, frame: int | None, stored: np.ndarray
    ) -> list[tuple[tuple[int, ...], object]]:
        """Rows ``[a, b)`` of every output (``stored``: the stored type, each output's rows
        contiguous) as whole chunks, in file order, each with its bytes and filter mask:
        uncompressed, ``stored``'s own rows (no copy: HDF5 writes from the caller's buffer),
        else a future of them, encoded by the dataset's own filters on the pool. The last
        chunk of an axis that the data does not fill is padded, as HDF5 stores it. None
        where HDF5's own filters run (hdf5plugin's codecs)."""
        if self._direct is None:
            return []
        depth = self._responses.chunks[1]
        tail = () if frame is None else (frame,)
        chunks = []
        for f in range(stored.shape[0]):
            for x in range(a, b, depth):
                block = stored[f, x - a : x - a + depth]
                if block.shape[0] < depth:  # the volume's last rows: a partial edge chunk
                    block = np.concatenate([block, np.zeros((depth - block.shape[0],
                                            *block.shape[1:]), block.dtype)])  # fmt: skip
                made = _pool().submit(self._direct, block) if self._filtered else (block, 0)
                chunks.append(((f, x, 0, 0, *tail), made))
        return chunks

    def _write(self, slab: _Slab) -> None:
        """Write a slab's chunks in order, each as soon as it is compressed (or the slab
        through HDF5's own filters)."""
        if self._direct is None:
            tail = () if slab.frame is None else (..., slab.frame)
            self._responses[(slice(None), slice(slab.a, slab.b), *tail)] = slab.stored
            return
        write = self._responses.id.write_direct_chunk
        for i, (offsets, made) in enumerate(slab.chunks):
            data, mask = made.result() if isinstance(made, Future) else made
            write(offsets, data, filter_mask=mask)
            slab.chunks[i] = (offsets, None)  # its compressed bytes are on disk: free them

    # -- finishing ---------------------------------------------------------------------
    def _commit(self, attrs: dict) -> None:
        """World coordinates, ``axistags``, the root attributes, ``complete = True`` last."""
        f = self._file
        coords = self.space.coordinates(self.shape)
        for axis, values in zip(("x", "y", "z", "t"), coords, strict=False):
            f[axis][...] = values
            if axis != "t":
                f[axis].attrs["units"] = "mm"
            elif self.space.repetition_time:
                f[axis].attrs["units"] = "s"
        self._responses.attrs["axistags"] = axistags(
            self.names, tuple(self.space.voxel_size), len(self.shape) == 4
        )
        for key, value in attrs.items():
            try:
                f.attrs[key] = value
            except TypeError as e:
                raise TypeError(f"root attribute {key!r}: {e}") from e
        f.attrs["complete"] = True  # last: only a whole file says it is complete
        self._flush()
        f.close()

    def _flush(self) -> None:
        """Write HDF5's caches out; a failure (disk full) leaves the file discardable, where
        a failed ``close`` would leave HDF5 in a state that crashes the process later."""
        try:
            self._file.flush()
        except (OSError, RuntimeError) as e:  # h5py raises either for a failed write
            raise self._write_error(e) from e

    def _close_discarded(self) -> None:
        if not hasattr(self, "_file"):
            return
        if self._keep:
            with contextlib.suppress(Exception):
                self._file.close()
            return
        if self._file.id.valid:
            # Nothing of this file is kept: point HDF5's descriptor at an anonymous file
            # first, so closing neither writes the caches to the disk nor fails when it is
            # full (a failed close leaves HDF5 in a state that crashes the process).
            _redirect(self._fd)
            with contextlib.suppress(Exception):  # discarding: the first error is what counts
                self._file.close()


# The name the pipeline and earlier versions use.
ResponseWriter = HDF5Writer


def _text(values: object) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(values).ravel()]


@contextmanager
def partial(
    temp: Path, st: os.stat_result, shape: tuple[int, ...], dtype: np.dtype
) -> Iterator[h5py.Dataset | None]:
    """``/responses`` of the partial file ``temp`` if it is the file ``st`` describes."""
    with h5py.File(temp, "r", locking=False) as f:
        opened = os.fstat(f.id.get_vfd_handle())
        yield f["responses"] if (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino) else None


def made(path: Path) -> dict:
    """How the complete output at ``path`` was made (`volconv.output.made`)."""
    with h5py.File(path, "r") as f:
        responses, kernels = f["responses"], f["kernels"]
        return {
            "filter names": _text(f["filter"][()]),
            "bank": np.asarray(kernels[()], np.float32),
            "boundary": str(responses.attrs.get("boundary", "")),
            "cval": float(responses.attrs.get("cval", np.nan)),
            "output dtype": str(responses.dtype),
            "scale": float(responses.attrs.get("scale", 1.0)),
            "offset": float(responses.attrs.get("offset", 0.0)),
            "input": str(f.attrs.get("source_sha256", "")),
            "features": str(f.attrs.get("features", "[]")),
        }


def read(path: Path) -> Stored:
    """The complete HDF5 output at ``path``, open until `Stored.close` (`volconv.output.read`).

    Raises
    ------
    OutputError
        Not a complete volconv output, or compressed with an hdf5plugin codec while
        hdf5plugin is not installed (the message says what to install).
    """
    if not is_complete(path):
        raise OutputError(f"{path}: not a complete volconv output")
    f = h5py.File(path, "r")
    try:
        if f.attrs.get("requires") == "hdf5plugin":
            try:
                import hdf5plugin  # noqa: F401 (registers the codecs with HDF5)
            except ImportError:
                note = str(f["responses"].attrs.get("note", "needs hdf5plugin"))
                raise OutputError(f"{path}: {note}") from None
        responses = f["responses"]
        names = _text(f["filter"][()])

        def reader(i: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
            return lambda key: responses[(i, *key)]

        outputs = [Lazy(responses.shape[1:], responses.dtype, reader(i)) for i in range(len(names))]
        attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}
        return Stored("hdf5", path, names, outputs,
                      tuple(np.broadcast_to(np.asarray(f.attrs.get("voxel_size", 1.0), float),
                                           3).tolist()),
                      attrs, responses.dtype, float(responses.attrs.get("scale", 1.0)),
                      float(responses.attrs.get("offset", 0.0)), f.close)  # fmt: skip
    except BaseException:
        f.close()
        raise


WRITER = HDF5Writer
