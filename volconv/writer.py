"""The write stage: N responses per slab into one HDF5 file per input, as SPEC.md describes.

`ResponseWriter` writes under a temporary name (`temp_path`) from one background thread, so
HDF5 writes and compression overlap the device work (h5py releases the GIL around I/O); the
file gets ``complete = True`` last and is then renamed, so nothing that looks finished exists
until it is. Dimension scales (``filter``, ``x``, ``y``, ``z``[, ``t``]) make the file open in
xarray (``engine="h5netcdf"``) and netCDF tools with named dimensions.
"""

from __future__ import annotations

import glob
import os
import queue
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from types import TracebackType

import h5py
import numpy as np

from volconv import __version__

DTYPES = ("float32", "float16", "uint8")
# hdf5plugin's fast codecs by name; readers need `import hdf5plugin` too.
_PLUGINS = {
    "blosc": lambda p: p.Blosc(cname="lz4", shuffle=p.Blosc.SHUFFLE),
    "blosc2": lambda p: p.Blosc2(),
    "lz4": lambda p: p.LZ4(),
    "zstd": lambda p: p.Zstd(),
}
COMPRESSIONS = ("none", "gzip", "lzf", *_PLUGINS)
ROOT_ATTRS = (
    "affine", "voxel_size", "source", "source_sha256", "pipeline", "volconv_version", "device",
    "gflop", "kernel_seconds", "wall_seconds", "gflops", "peak_gflops", "fraction_of_peak",
)  # fmt: skip
# Largest chunk: big enough that a slab is a few large writes, small enough that a reader
# taking a small region decompresses little.
MAX_CHUNK_BYTES = 64 * 2**20
_FLOAT16_MAX = float(np.finfo(np.float16).max)


class OutputError(ValueError):
    """An output the user asked for cannot be written; the message names the path or value."""


class OutputExistsError(OutputError, FileExistsError):
    """The output path holds a file and overwriting was not asked for."""


def is_complete(path: Path) -> bool:
    """Whether ``path`` is an HDF5 file whose root attribute ``complete`` is true."""
    try:
        with h5py.File(path, "r") as f:
            flag = f.attrs.get("complete")
    except (OSError, ValueError, KeyError):  # missing, a folder, not HDF5, truncated (a
        # killed writer's file can fail with KeyError "bad object header version number")
        return False
    return isinstance(flag, bool | np.bool_) and bool(flag)


def temp_path(path: Path) -> Path:
    """The name ``path`` is written under until complete: hidden, marked partial, and unique
    to this host and process, so concurrent runs never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial-{socket.gethostname()}-{os.getpid()}.h5")


def _remove_stale_temps(path: Path) -> None:
    """Delete temporary files of ``path`` left by processes of this host that no longer run
    (a killed run); those of live processes and other hosts are left alone."""
    prefix = f".{path.name}.partial-{socket.gethostname()}-"
    for temp in path.parent.glob(f"{glob.escape(prefix)}*.h5"):
        pid = temp.name[len(prefix) : -len(".h5")]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            temp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def compression_options(name: str) -> dict:
    """h5py ``create_dataset`` keywords for a compression name.

    Parameters
    ----------
    name : str
        ``none``; ``gzip`` (deflate level 1, which every HDF5 reader has) or ``gzip-1`` ..
        ``gzip-9``; ``lzf``; or, with hdf5plugin installed, ``blosc``, ``blosc2``, ``lz4``,
        ``zstd`` (their readers need ``import hdf5plugin`` too). gzip and lzf run after
        HDF5's shuffle filter, which makes float responses both smaller and faster to
        compress (8 x 128^3 float32: gzip 1.1 s and 48 MiB with it, 1.7 s and 56 MiB
        without).

    Raises
    ------
    OutputError
        An unknown name, or a fast codec without hdf5plugin.
    """
    if name == "none":
        return {}
    if m := re.fullmatch(r"gzip(?:-([1-9]))?", name):
        return {"compression": "gzip", "compression_opts": int(m[1] or 1), "shuffle": True}
    if name == "lzf":
        return {"compression": "lzf", "shuffle": True}
    if name in _PLUGINS:
        try:
            import hdf5plugin
        except ImportError:
            raise OutputError(
                f"compression {name!r} needs hdf5plugin (pip install 'volconv[fast]')"
            ) from None
        return dict(_PLUGINS[name](hdf5plugin))
    raise OutputError(f"compression must be one of {', '.join(COMPRESSIONS)}; got {name!r}")


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


class ResponseWriter:
    """Writes the N responses of one input to an HDF5 file, slab by slab.

    Use it as a context manager: `write_slab` every slab (of every frame), then `finish`.
    Leaving the ``with`` block by an exception (KeyboardInterrupt too) stops the writer
    thread and deletes the temporary file; the final path is never touched.

    Parameters
    ----------
    path : Path
        The output file. Its parent folders are created.
    input_shape : tuple of int
        ``(x, y, z)`` or ``(x, y, z, t)``.
    names : list of str
        The N filter names, in bank order (the ``filter`` coordinate).
    kernels : (N, sx, sy, sz) array
        The kernels applied, stored as float32 ``/kernels``.
    dtype : {'float32', 'float16', 'uint8'}
        Stored type. float16 saturates at +-65504 (inf too); uint8 stores
        ``clip(round((value - offset) / scale), 0, 255)`` computed in float32, NaN as 0.
    compression : str
        See `compression_options`.
    scale, offset : float
        uint8 quantisation (value = stored * scale + offset); recorded as ``scale`` and
        ``offset`` and as CF's ``scale_factor`` and ``add_offset``, so xarray decodes it.
    boundary, cval
        Recorded as attributes of ``/responses``.
    slab_depth : int
        Rows along x per slab (the last may be shorter); sets the chunk shape.
    overwrite : bool
        Replace an existing file at ``path`` when the new one is complete.

    Raises
    ------
    OutputExistsError
        ``path`` holds a file (complete or not) and ``overwrite`` is false.
    OutputError
        A bad dtype, compression, scale, or a path that cannot be written.
    """

    def __init__(
        self,
        path: Path,
        input_shape: tuple[int, ...],
        names: list[str],
        kernels: np.ndarray,
        *,
        dtype: str = "float32",
        compression: str = "none",
        scale: float = 1.0,
        offset: float = 0.0,
        boundary: str,
        cval: float,
        slab_depth: int,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        self.shape = tuple(int(s) for s in input_shape)
        kernels = np.asarray(kernels, dtype=np.float32)
        self._check(names, kernels, dtype, scale, offset, slab_depth)
        filters = compression_options(compression)
        self._check_path(overwrite)
        self.dtype = np.dtype(dtype)
        self.scale, self.offset = float(scale), float(offset)
        self.write_seconds = 0.0
        n = len(names)
        # Rows handed over per frame: finish() refuses to mark an incomplete file complete.
        self._written = np.zeros(
            (self.shape[3] if len(self.shape) == 4 else 1, self.shape[0]), bool
        )
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._stop = False
        self._done = False
        self._temp = temp_path(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(self.path)
            # Creation order tracked as netCDF-4 files have it, for netCDF tools. No file
            # lock: the name is this process's alone, and locks fail on many NFS mounts.
            self._file = h5py.File(self._temp, "w", track_order=True, locking=False)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write there ({e})") from e
        try:
            chunks = chunk_shape((n, *self.shape), slab_depth, self.dtype.itemsize)
            self._responses = self._layout(names, kernels, chunks, filters, boundary, cval)
        except BaseException:
            self._discard()
            raise
        self._thread = threading.Thread(target=self._run, name="volconv-writer", daemon=True)
        self._thread.start()

    def _check(
        self,
        names: list[str],
        kernels: np.ndarray,
        dtype: str,
        scale: float,
        offset: float,
        slab_depth: int,
    ) -> None:
        """Validate the arguments, naming the one that is wrong."""
        if len(self.shape) not in (3, 4) or min(self.shape) < 1:
            raise ValueError(f"input_shape must be 3D or 4D and non-empty; got {self.shape}")
        if kernels.ndim != 4 or kernels.shape[0] != len(names):
            raise ValueError(
                f"kernels must be ({len(names)}, sx, sy, sz) for {len(names)} names; "
                f"got {kernels.shape}"
            )
        if len(set(names)) != len(names) or not all(isinstance(s, str) and s for s in names):
            raise ValueError(f"names must be unique non-empty strings; got {names}")
        if dtype not in DTYPES:
            raise OutputError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        if not (np.isfinite(scale) and np.isfinite(offset) and scale != 0):
            raise OutputError(
                f"scale must be finite and nonzero, offset finite; got {scale}, {offset}"
            )
        if not (isinstance(slab_depth, int | np.integer) and slab_depth >= 1):
            raise ValueError(f"slab_depth must be a positive integer; got {slab_depth!r}")

    def _check_path(self, overwrite: bool) -> None:
        if self.path.is_dir():
            raise OutputError(f"{self.path}: is a folder; the output must be a file path")
        if self.path.exists() and not overwrite:
            what = (
                "is already complete"
                if is_complete(self.path)
                else "holds a file that is not a complete volconv output"
            )
            raise OutputExistsError(f"{self.path}: {what}; use --overwrite to replace it")

    def _layout(
        self,
        names: list[str],
        kernels: np.ndarray,
        chunks: tuple[int, ...],
        filters: dict,
        boundary: str,
        cval: float,
    ) -> h5py.Dataset:
        """Create the dimension scales, ``/responses`` and ``/kernels``."""
        f = self._file
        f.create_dataset("filter", data=names, dtype=h5py.string_dtype())
        axes = ("x", "y", "z", "t")[: len(self.shape)]
        for axis, size in zip(axes, self.shape, strict=True):
            f.create_dataset(axis, data=np.arange(size, dtype=np.float64))
        for axis, size in zip(("kx", "ky", "kz"), kernels.shape[1:], strict=True):
            f.create_dataset(axis, data=np.arange(size, dtype=np.float64))
        for dim in ("filter", *axes, "kx", "ky", "kz"):
            f[dim].make_scale(dim)
        responses = f.create_dataset(
            "responses", (len(names), *self.shape), self.dtype, chunks=chunks, **filters
        )
        stored = f.create_dataset("kernels", data=kernels)
        for ds, dims in ((responses, ("filter", *axes)), (stored, ("filter", "kx", "ky", "kz"))):
            for i, dim in enumerate(dims):
                ds.dims[i].attach_scale(f[dim])
                ds.dims[i].label = dim
        responses.attrs["boundary"] = boundary
        responses.attrs["cval"] = float(cval)
        if self.dtype == np.uint8:
            responses.attrs["scale"] = self.scale
            responses.attrs["offset"] = self.offset
            responses.attrs["scale_factor"] = np.float32(self.scale)
            responses.attrs["add_offset"] = np.float32(self.offset)
        return responses

    # -- writing -----------------------------------------------------------------------
    def write_slab(
        self,
        a: int,
        b: int,
        responses: np.ndarray,
        frame: int | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Queue the responses ``(N, b - a, y, z)`` of rows ``[a, b)`` for writing.

        Blocks while two slabs wait, so the device runs at most two slabs ahead of the disk.
        The writer keeps ``responses`` until it is written, then calls ``release`` (from the
        writer thread; also when the slab is dropped after an error), so a caller can reuse
        a buffer, e.g. page-locked memory the device downloads into fast. ``frame`` is the
        volume of a 4D input (None or 0 for 3D). An error of the writer thread is raised
        here, on the next call.
        """
        self._raise_pending()
        if self._done or self._stop:
            raise RuntimeError(f"{self.path}: the writer is closed")
        nx, ny, nz = self.shape[:3]
        if not 0 <= a < b <= nx:
            raise ValueError(f"rows [{a}, {b}) must lie within [0, {nx})")
        expected = (self._responses.shape[0], b - a, ny, nz)
        if responses.shape != expected:
            raise ValueError(f"responses must have shape {expected}; got {responses.shape}")
        if len(self.shape) == 4:
            if frame is None or not 0 <= frame < self.shape[3]:
                raise ValueError(f"frame must be 0..{self.shape[3] - 1} for a 4D input")
        elif frame in (None, 0):
            frame = None
        else:
            raise ValueError(f"frame must be None for a 3D input; got {frame}")
        self._written[frame or 0, a:b] = True
        self._queue.put((a, b, frame, responses, release))

    def _run(self) -> None:
        """The writer thread: write queued slabs until the sentinel None; after an error or
        an abort, keep draining so `write_slab` never blocks on a full queue."""
        while (item := self._queue.get()) is not None:
            a, b, frame, responses, release = item
            try:
                if self._error is None and not self._stop:
                    start = perf_counter()
                    index = (slice(None), slice(a, b), *(() if frame is None else (..., frame)))
                    self._responses[index] = self._encode(responses)
                    self.write_seconds += perf_counter() - start
            except BaseException as e:  # raised again in the caller's thread
                self._error = e
            finally:
                del responses
                if release is not None:
                    release()

    def _encode(self, values: np.ndarray) -> np.ndarray:
        """Responses in the stored type."""
        if self.dtype == np.float32:
            return np.asarray(values, np.float32)
        values = np.asarray(values, np.float32)
        if self.dtype == np.float16:
            return np.clip(values, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)
        q = np.rint((values - np.float32(self.offset)) / np.float32(self.scale))
        np.clip(q, 0, 255, out=q)
        return np.nan_to_num(q, copy=False, nan=0.0).astype(np.uint8)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._stop = True  # the file is incomplete now; nothing more is written
            raise RuntimeError(f"{self.path}: writing failed: {error}") from error

    def _join(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # -- finishing ---------------------------------------------------------------------
    def finish(self, attrs: dict) -> Path:
        """Wait for every slab, write the root attributes and ``complete = True`` last, and
        rename the file to `path`.

        Parameters
        ----------
        attrs : dict
            Root attributes: every name of `ROOT_ATTRS` (``volconv_version`` defaults to
            this volconv's), and any others.

        Returns
        -------
        Path
            The finished file.
        """
        try:
            self._join()
            self._raise_pending()
            if self._stop:
                raise RuntimeError(f"{self.path}: the writer is closed")
            missing_rows = np.argwhere(~self._written)
            if missing_rows.size:
                frame, row = missing_rows[0]
                raise RuntimeError(
                    f"{self.path}: {len(missing_rows)} rows were never written "
                    f"(the first: row {row} of frame {frame})"
                )
            attrs = {"volconv_version": __version__, **attrs}
            missing = [k for k in ROOT_ATTRS if k not in attrs]
            if missing:
                raise ValueError(f"finish: missing root attributes {', '.join(missing)}")
            for key, value in attrs.items():
                try:
                    self._file.attrs[key] = value
                except TypeError as e:
                    raise TypeError(f"root attribute {key!r}: {e}") from e
            self._file.attrs["complete"] = True  # last: only a whole file says it is complete
            self._file.close()
            os.replace(self._temp, self.path)  # atomic: an old output stays until replaced
        except BaseException:
            self._discard()
            raise
        self._done = True
        return self.path

    def _discard(self) -> None:
        """Stop the writer thread, close and delete the temporary file."""
        self._stop = True
        if hasattr(self, "_thread"):
            self._join()
        if self._file.id.valid:
            self._file.close()
        self._temp.unlink(missing_ok=True)

    def __enter__(self) -> ResponseWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        failed = self._stop  # a failure already raised; the caller knows
        self._discard()
        if exc_type is None and not failed:
            raise RuntimeError(f"{self.path}: ResponseWriter left without finish(); discarded")
