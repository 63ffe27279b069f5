"""The write stage: N responses per slab into one HDF5 file per input, as SPEC.md describes.

`ResponseWriter` writes from one background thread, so HDF5 writes and compression overlap
the device work (h5py releases the GIL around I/O). The file is made in a private folder
beside the output (mode 0700, a name nobody can predict, see `private_prefix`), created
exclusively, gets ``complete = True`` last and is then renamed into place: nothing that looks
finished exists until it is, and no link planted in a shared folder can redirect the writes.
Dimension scales (``filter``, ``x``, ``y``, ``z``[, ``t``]) make the file open in xarray
(``engine="h5netcdf"``) and netCDF tools with named dimensions.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING

import h5py
import numpy as np

from volconv import __version__
from volconv.checks import check_positive_int, file_kind
from volconv.convert import encode
from volconv.errors import OutputError, OutputExistsError, OutputWriteError

if TYPE_CHECKING:
    from volconv.resume import Progress

__all__ = ["OutputError", "OutputExistsError", "OutputWriteError", "ResponseWriter"]

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

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
    "engine",
)  # fmt: skip
# Largest chunk: big enough that a slab is a few large writes, small enough that a reader
# taking a small region decompresses little.
MAX_CHUNK_BYTES = 64 * 2**20
# Largest chunk that volconv compresses on its pool (gzip, lzf): a slab then makes many
# chunks, several per core, so that the cores finish together (8 filters x 32 rows of 256^2
# float16: 32 chunks; at 4 MiB, 8, and 16 cores ran at 5x one). A chunk of 1 MiB still
# costs ~100 times the call that hands it over, and fits h5py's default chunk cache.
POOL_CHUNK_BYTES = 2**20
# Slabs whose chunks compress on the pool at once: the next slab's chunks compress while the
# writer thread writes the one before, so no core waits for the writes (nor for the slowest
# chunk of a slab). Each holds its slab and its compressed chunks (`backlog_bytes`).
SLABS_IN_FLIGHT = 2
# Failures to write that are not the user's mistake: no space, quota, I/O, size limit.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def _direct_codec(filters: dict) -> Callable[[np.ndarray], tuple[object, int]] | None:
    """The bytes HDF5 would store for a chunk under ``filters`` (see `compression_options`)
    and their filter mask, where volconv makes them itself, on every core, and writes them
    with ``write_direct_chunk``: the chunk as it is, uncompressed (straight from the caller's
    buffer, no copy: 0.20 s against h5py's chunked write's 0.30 s for 512 MiB on tmpfs);
    shuffle + deflate (gzip-N, zlib); shuffle + LZF (h5py's own LZF, `_lzf`). None where
    HDF5's own filters run (hdf5plugin's codecs, which compress on every core themselves)."""
    if not filters:
        return lambda block: (block, 0)
    if filters.get("compression") == "gzip" and filters.get("shuffle"):
        level = int(filters.get("compression_opts", 1))
        return lambda block: (zlib.compress(_shuffled(block), level), 0)
    if filters.get("compression") == "lzf" and filters.get("shuffle") and (lzf := _lzf()):

        def compress(block: np.ndarray) -> tuple[object, int]:
            raw = _shuffled(block)
            out = np.empty(raw.nbytes, np.uint8)  # as h5py's filter: no room, no compression
            n = lzf(raw.ctypes.data, raw.nbytes, out.ctypes.data, out.nbytes)
            if n:
                return out[:n], 0
            # HDF5 stores a chunk its optional LZF filter (pipeline entry 1) cannot shrink
            # as shuffled only, with that filter's bit set in the chunk's mask
            out[:] = raw  # out of the scratch buffer, which this thread reuses
            return out, 1 << 1

        return compress
    return None


def _shuffled(block: np.ndarray) -> np.ndarray:
    """HDF5's shuffle filter: byte k of every element together, for k = 0, 1, ... (bytes,
    contiguous), in this thread's scratch buffer (valid until its next call): no fresh
    pages to fault in per chunk."""
    raw = np.ascontiguousarray(block).view(np.uint8).reshape(-1, block.itemsize)
    scratch = getattr(_scratch, "shuffled", None)
    if scratch is None or scratch.nbytes < raw.nbytes:
        scratch = _scratch.shuffled = np.empty(raw.nbytes, np.uint8)
    out = scratch[: raw.nbytes]
    np.copyto(out.reshape(block.itemsize, -1), raw.T)
    return out


_scratch = threading.local()


@cache
def _lzf() -> Callable[[int, int, int, int], int] | None:
    """``lzf_compress(in, in_len, out, out_len)`` of h5py's own LZF filter (the bytes its
    HDF5 filter stores), called through ctypes, which lets go of the GIL: chunks compress on
    every core. None where h5py's build does not export it (HDF5's filter runs then)."""
    import ctypes

    import h5py.h5z

    try:
        fn = ctypes.CDLL(h5py.h5z.__file__).lzf_compress
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint)
    fn.restype = ctypes.c_uint
    return fn


@cache
def _cores() -> int:
    return len(os.sched_getaffinity(0))


@cache
def _pool() -> ThreadPoolExecutor:
    """Threads that convert responses to float16 or uint8 beside the writer's own."""
    return ThreadPoolExecutor(_cores(), thread_name_prefix="volconv-encode")


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (links followed): the only kind volconv ever opens
    as an output, since opening a FIFO blocks and a device is no file to read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing, a name too long, a loop of links
        return False


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


def holds(path: Path) -> str:
    """What the file at ``path`` holds, in a few words for a message (``text``, ``a NumPy
    array``, ``an HDF5 file without complete = True``); only a regular file is opened."""
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
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array (.npy)"
    if head.startswith(b"\x1f\x8b"):
        return "gzip data"
    try:
        head.decode("utf-8")  # a multi-byte character cut at 512 bytes reads as binary
    except UnicodeDecodeError:
        return "binary data, not HDF5"
    return "text"


def _check_kind(path: Path) -> None:
    """Refuse a path that holds something other than a regular file, a link or nothing:
    replacing a FIFO, a device or a socket is never what an output is for."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) or stat.S_ISDIR(mode)):
        raise OutputError(
            f"{path}: is {file_kind(path)}, not a regular file; volconv replaces only files"
        )


# mkdtemp's random part of a private folder's name
_RANDOM_CHARS = 8


def _check_name_length(path: Path, folder: Path) -> None:
    """Refuse a name longer than the file system takes, counting the private folder's name
    (`private_prefix`) that the file is written in first; ``folder`` exists."""
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
        path_max = os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts[1:-1]:
        if len(os.fsencode(part)) > name_max:
            raise OutputError(
                f"{path}: the folder name {part[:40]}... is too long "
                f"({len(os.fsencode(part))} bytes; the file system takes {name_max})"
            )
    private = len(os.fsencode(private_prefix(path))) + _RANDOM_CHARS
    if private > name_max:
        extra = private - len(os.fsencode(path.name))
        raise OutputError(
            f"{path}: the file name is too long ({len(os.fsencode(path.name))} bytes; the file "
            f"system takes {name_max}, and volconv's temporary folder beside it adds {extra})"
        )
    if len(os.fsencode(str(path.parent))) + 2 + private + len(os.fsencode(path.name)) >= path_max:
        raise OutputError(f"{path}: the path is too long (the file system takes {path_max} bytes)")


def check_output_path(path: Path) -> None:
    """Check, without creating anything, that an output file can be made at ``path``.

    The nearest folder of ``path`` that exists must be a folder this process can write in,
    on a file system mounted read-write; the folders below it are created by the writer.

    Raises
    ------
    OutputError
        ``path`` is a folder, a FIFO, a device or a socket, an ancestor is a file, a name is
        longer than the file system takes, or the folder cannot be written.
    """
    path = Path(os.path.abspath(path))
    folder = path.parent
    while not os.path.lexists(folder):
        folder = folder.parent
    _check_name_length(path, folder)
    if os.path.isdir(path):
        raise OutputError(f"{path}: is a folder; the output must be a file path")
    _check_kind(path)
    if not folder.is_dir():
        raise OutputError(f"{path}: cannot create it, {folder} is not a folder")
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        raise OutputError(f"{path}: cannot create it, {folder} is on a read-only file system")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot create it, no permission to write in {folder}")


def private_prefix(path: Path) -> str:
    """The start of the names of the private folders that this host and process write
    ``path`` in: ``.NAME.partial-HOST-PID-`` (random characters follow)."""
    return f".{Path(path).name}.partial-{socket.gethostname()}-{os.getpid()}-"


def dead_runs(path: Path) -> list[Path]:
    """The entries beside ``path`` that runs of this host that no longer run (killed runs)
    left while writing it: ``.NAME.partial-HOST-PID-RANDOM`` folders (and ``PID.h5`` files
    of older versions) whose PID is not this process's and no process's of this host. Not
    checked for their owner or kind: the caller does, with `os.lstat`."""
    start = f".{path.name}.partial-{socket.gethostname()}-"
    pattern = re.compile(r"(\d+)(?:-[A-Za-z0-9_]+|\.h5)")  # PID-RANDOM, or PID.h5 (old)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    dead = []
    for name in names:
        m = pattern.fullmatch(name[len(start) :]) if name.startswith(start) else None
        if m is not None and int(m[1]) != os.getpid() and not _running(int(m[1])):
            dead.append(path.parent / name)
    return dead


def remove_stale_temps(path: Path) -> None:
    """Delete what runs of this user on this host that no longer run (killed runs) left
    while writing ``path``: their private folders (and lone files of older versions).

    Only entries owned by this user, real folders and files (links are never followed nor
    removed), whose name carries the process id of a dead process of this host (`dead_runs`).
    """
    for entry in dead_runs(path):
        try:
            st = os.lstat(entry)
            if st.st_uid != os.geteuid():
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry)  # fd-based on Linux: never follows links inside
            elif stat.S_ISREG(st.st_mode):
                entry.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue


@cache
def _renameat2() -> Callable[..., int] | None:
    libc = ctypes.CDLL(None, use_errno=True)  # Linux's C library (glibc 2.28+ has renameat2)
    return getattr(libc, "renameat2", None)


def _swap(a: Path, b: Path) -> bool:
    """Exchange the entries ``a`` and ``b`` in one atomic step (Linux's renameat2 with
    RENAME_EXCHANGE); False where the system or the file system cannot, or ``b`` is gone."""
    renameat2 = _renameat2() if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


# Private folders being removed in the background (`remove_later`): by an ``rm`` process, or
# a thread where there is none.
_REMOVALS: list[threading.Thread | subprocess.Popen] = []


def remove_later(folder: Path) -> None:
    """Remove ``folder`` (a finished output's private folder, holding the file it replaced)
    in the background, while the run goes on; `wait_for_removals` waits for it. Freeing a
    large file takes the file system a while, and a process cannot leave before a thread of
    its own is out of that call: ``rm -rf`` in a process of its own does it where there is
    one (a ``volconv run`` then leaves without waiting), else a thread, which is not a
    daemon: the interpreter waits for it at exit. Should the removal die first, the folder
    is a dead run's, removed by the next run that writes the same output
    (`remove_stale_temps`); it never looks like a partial output to resume (`temp` is gone).
    """
    # those done are let go (a long-lived worker replaces many outputs)
    _REMOVALS[:] = [r for r in _REMOVALS if (r.is_alive() if isinstance(r, threading.Thread)
                                             else r.poll() is None)]  # fmt: skip
    if (rm := _rm()) is not None:
        try:
            _REMOVALS.append(subprocess.Popen(
                [rm, "-rf", "--", os.fspath(folder)], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ))  # fmt: skip
            return
        except OSError:  # no process to be had (a limit): a thread
            pass
    thread = threading.Thread(target=shutil.rmtree, args=(folder, True), name="volconv-remove")
    thread.start()
    _REMOVALS.append(thread)


@cache
def _rm() -> str | None:
    return shutil.which("rm") if os.name == "posix" else None


def wait_for_removals(processes: bool = True) -> None:
    """Wait until the folders `remove_later` was given are gone. ``processes`` False leaves
    those an ``rm`` process removes to it, for a process about to leave through
    ``os._exit``."""
    while _REMOVALS:
        removal = _REMOVALS.pop()
        if isinstance(removal, threading.Thread):
            removal.join()
        elif processes:
            removal.wait()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _redirect(fd: int) -> None:
    """Make ``fd`` refer to an anonymous file in memory, closing what it referred to.

    Under a file size limit (``ulimit -f``), which applies to that file too, /dev/null
    instead, whose writes always succeed.
    """
    limited = resource is not None and (
        resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    )
    if hasattr(os, "memfd_create") and not limited:
        other = os.memfd_create("volconv-discard")
    else:
        other = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(other, fd)
    finally:
        os.close(other)


def _errno(error: BaseException) -> int | None:
    """The OS error behind ``error``: its ``errno``, or the one HDF5's message names (h5py
    raises some failed writes as RuntimeError, "... errno = 28, error message = ...")."""
    code = getattr(error, "errno", None)
    if isinstance(code, int) and code > 0:
        return code
    m = re.search(r"\berrno = (\d+)", str(error))
    return int(m[1]) if m and int(m[1]) > 0 else None


def _cause(error: BaseException) -> str:
    """One line for what went wrong: the OS's words for an errno, else the first line."""
    if (code := _errno(error)) is not None:
        return os.strerror(code)
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
        # blosc and blosc2 compress on every core (hdf5plugin reads this when it loads)
        os.environ.setdefault("BLOSC_NTHREADS", str(_cores()))
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


@dataclass(eq=False)
class _Slab:
    """A slab in the writer thread's hands: its rows and frame, what gives its buffer back,
    its stored values, its CRCs (futures, resume) and its chunks: offsets with their bytes
    and filter mask, or a future of them (compressed on the pool)."""

    a: int
    b: int
    frame: int | None
    release: Callable[[], None] | None
    stored: np.ndarray | None = None
    checksums: list[Future[int]] = field(default_factory=list)
    chunks: list[tuple[tuple[int, ...], object]] = field(default_factory=list)


def slabs_in_flight(compression: str) -> int:
    """Slabs the writer thread works on at once for output ``compression``: `SLABS_IN_FLIGHT`
    where volconv compresses chunks on its pool (gzip, lzf), else one."""
    pooled = compression.startswith("gzip") or (compression == "lzf" and _lzf() is not None)
    return SLABS_IN_FLIGHT if pooled else 1


def backlog_bytes(slab_bytes: int, compression: str) -> int:
    """Host memory the writer holds beyond the slabs handed to it, for slabs of
    ``slab_bytes`` stored: the compressed chunks of the slabs in flight (each at most its
    slab's size) where chunks compress on the pool."""
    n = slabs_in_flight(compression)
    return n * slab_bytes if n > 1 else 0


class ResponseWriter:
    """Writes the N responses of one input to an HDF5 file, slab by slab.

    Use it as a context manager: `write_slab` every slab (of every frame), then `finish`.
    Leaving the ``with`` block by an exception (KeyboardInterrupt too) stops the writer
    thread and deletes the temporary file, unless `keep` was called; the final path is never
    touched.

    The file is written as `temp` in a private folder beside ``path``
    (``.NAME.partial-HOST-PID-RANDOM``, mode 0700, removed when done): made by this process
    alone, so nobody can plant a link at its name, and created exclusively (HDF5 mode ``x``).
    Only that file, checked to be the one created, is renamed onto ``path`` (a link at
    ``path`` is replaced, never followed).

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
        Stored type. float16 saturates finite values at +-65504 (inf and NaN stay); uint8 stores
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
    extents : (N, 3) array of int, optional
        Each filter's own extent before zero-padding to the common one, stored as the
        ``extents`` attribute of ``/kernels``; default: the common extent for every filter.
    progress : volconv.resume.Progress, optional
        Record each slab once flushed, and continue a dead run's partial file that matches
        (`volconv.resume`); its ``done`` slabs are then already written.

    Attributes
    ----------
    temp : Path
        The file being written, until `finish` renames it.
    clipped, nans : int
        uint8 only: voxels saturated at 0 or 255, and NaN voxels stored as 0, so far (the
        caller warns once).
    write_seconds : float
        Time the writer thread spent writing.

    Raises
    ------
    OutputExistsError
        ``path`` holds a file (complete or not) and ``overwrite`` is false.
    OutputError
        A bad dtype, compression, scale, or a path that cannot be written.
    OutputWriteError
        From `write_slab` and `finish`: writing failed (disk full, I/O error); the
        temporary file is removed.
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
        extents: np.ndarray | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.path = Path(path)
        self.progress = progress
        self.shape = tuple(int(s) for s in input_shape)
        kernels = np.asarray(kernels, dtype=np.float32)
        self._check(names, kernels, dtype, scale, offset, slab_depth)
        extents = self._check_extents(extents, kernels)
        filters = compression_options(compression)
        self._compression = compression
        self._check_path(overwrite)
        self.dtype = np.dtype(dtype)
        self.scale, self.offset = float(scale), float(offset)
        self.write_seconds = 0.0
        self.clipped = self.nans = 0
        n = len(names)
        # Rows handed over per frame: finish() refuses to mark an incomplete file complete.
        self._written = np.zeros(
            (self.shape[3] if len(self.shape) == 4 else 1, self.shape[0]), bool
        )
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._stop = False
        self._done = False
        self._folder: Path | None = None
        self._keep = False
        resumed = self._create((n, *self.shape))
        try:
            # gzip and lzf chunks are compressed on every core and go to the file with
            # write_direct_chunk: HDF5 would compress them on one core.
            self._direct = _direct_codec(filters)
            self._filtered = bool(filters)
            pooled = self._filtered and self._direct is not None
            chunks = chunk_shape((n, *self.shape), slab_depth, self.dtype.itemsize,
                                 POOL_CHUNK_BYTES if pooled else MAX_CHUNK_BYTES)  # fmt: skip
            self._responses = self._layout(names, kernels, extents, chunks, filters,
                                           boundary, cval)  # fmt: skip
            if resumed:  # volconv.resume: a dead run's file, its complete slabs checked
                self._resumed()
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
        check_positive_int(slab_depth, "slab_depth")

    def _check_extents(self, extents: np.ndarray | None, kernels: np.ndarray) -> np.ndarray:
        common = np.array(kernels.shape[1:], np.int64)
        if extents is None:
            return np.tile(common, (len(kernels), 1))
        given = np.asarray(extents)
        if (
            given.shape != (len(kernels), 3)
            or given.dtype.kind not in "iu"
            or np.any(given < 1)
            or np.any(given > common)
        ):
            raise ValueError(
                f"extents must be ({len(kernels)}, 3) integers from 1 to the kernels' extent "
                f"{tuple(common.tolist())}; got {given.tolist()}"
            )
        return given.astype(np.int64)

    def _create(self, shape: tuple[int, ...]) -> bool:
        """Make the private folder and, in it, the HDF5 file, exclusively, or with a
        `progress`, continue there a dead run's partial file that it claims and checks
        (`volconv.resume`); check that the open file is the one made (`temp`). Whether the
        file is a resumed one."""
        resumed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix=private_prefix(self.path),
                                                 dir=self.path.parent))  # fmt: skip
            self.temp = self._folder / self.path.name
            if self.progress is not None:  # before the stale folders go: one may be resumed
                resumed = self.progress.open(self.path, self._folder, shape, self.dtype)
            remove_stale_temps(self.path)
            # Creation order tracked as netCDF-4 files have it, for netCDF tools. No file
            # lock: the folder is this process's alone, and locks fail on many NFS mounts.
            if resumed:  # its slabs are copied into a new file: HDF5's own state in a file
                # killed while writing may not hold (its end-of-allocation was seen stale)
                os.rename(self.temp, self._killed)
            self._file = h5py.File(self.temp, "x", track_order=True, locking=False)
        except OSError as e:
            self._remove_folder()
            error = OutputWriteError if _errno(e) in _WRITE_ERRNOS else OutputError
            raise error(f"{self.path}: cannot write there ({_cause(e)})") from e
        except BaseException:  # the input's SHA-256 failed while checking a partial, Ctrl-C
            self._remove_folder()
            raise
        # HDF5's descriptor (sec2 driver): `_discard` points it elsewhere.
        self._fd = self._file.id.get_vfd_handle()
        opened, named = os.fstat(self._fd), os.lstat(self.temp)
        self._identity = (opened.st_dev, opened.st_ino)
        if (named.st_dev, named.st_ino) != self._identity or not stat.S_ISREG(named.st_mode):
            self._discard()
            raise OutputError(f"{self.path}: the temporary file {self.temp} was replaced")
        return resumed

    @property
    def _killed(self) -> Path:
        """Where the partial file `progress` resumed waits while its slabs are copied."""
        return self.temp.with_name(self.temp.name + ".resumed")

    def _resumed(self) -> None:
        """Copy the complete slabs of the file `progress` resumed into this new one, chunk
        by chunk as stored (its layout is this one's: the run's fingerprint holds the slab
        depth, and slabs fill whole chunks: `chunk_shape`), count them as written
        and remove the old file: never a ``complete`` mark (a run killed between marking and
        renaming leaves one), nor HDF5's state of a file killed while writing."""
        new = self._responses
        rows = np.zeros(self._written.shape, bool)  # (frame, row): complete in the old file
        for (frame, a), b in self.progress.done.items():
            rows[frame, a:b] = True
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

    def _remove_folder(self, later: bool = False) -> None:
        if self.progress is not None:
            self.progress.close()
        if self._folder is not None:
            if later:
                remove_later(self._folder)
            else:
                shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _check_path(self, overwrite: bool) -> None:
        check_output_path(self.path)  # a folder, a FIFO, a name too long: before creating
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
        extents: np.ndarray,
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
        stored.attrs["extents"] = extents
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
        counts: tuple[int, int] = (0, 0),
    ) -> None:
        """Queue the responses ``(N, b - a, y, z)`` of rows ``[a, b)`` for writing.

        ``responses`` of the stored type (converted on the device, `volconv.convert`) are
        written as they are, with ``counts``, their uint8 NaN and clipped voxels; others
        (float32) are converted here. Blocks while two slabs wait, so the device runs at
        most two slabs ahead of the disk. The writer keeps ``responses`` until it is
        written, then calls ``release`` (from the writer thread; also when the slab is
        dropped after an error), so a caller can reuse a buffer, e.g. page-locked memory
        the device downloads into fast; uncompressed chunks go to the file straight from
        it. ``frame`` is the volume of a 4D input (None or 0 for 3D). An error of the
        writer thread is raised here, on the next call.
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
        self.nans += counts[0]
        self.clipped += counts[1]
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
        """The writer thread: take queued slabs until the sentinel None, each started at once
        (`_begin`: its chunks go to the pool) while fewer than `SLABS_IN_FLIGHT` are (one
        where nothing compresses on the pool), and write them in order (`_end`); after an
        error or an abort, keep draining so `write_slab` never blocks on a full queue."""
        flight: deque[_Slab] = deque()
        depth = slabs_in_flight(self._compression)
        closing = False
        while flight or not closing:
            room = len(flight) < depth and not self._queue.empty()  # a slab waits, and room
            if not closing and (not flight or room):
                if (item := self._queue.get()) is None:
                    closing = True
                else:
                    flight.append(self._begin(*item))
            else:
                self._end(flight.popleft())

    def _begin(
        self,
        a: int,
        b: int,
        frame: int | None,
        responses: np.ndarray,
        release: Callable[[], None] | None,
    ) -> _Slab:
        """Start writing a slab: its stored values, its CRCs (resume) and its chunks'
        compression on the pool."""
        slab = _Slab(a, b, frame, release)
        if self._error is not None or self._stop:
            return slab
        start = perf_counter()
        try:
            stored = responses if responses.dtype == self.dtype else self._encode(responses)
            slab.stored = stored
            if self.progress is not None:  # volconv.resume: CRCs beside the write
                slab.checksums = self.progress.checksums(stored)
            if self._direct is not None:
                slab.chunks = self._chunks(a, b, frame, stored)
        except BaseException as e:  # raised again in the caller's thread
            self._error = e
        self.write_seconds += perf_counter() - start
        return slab

    def _end(self, slab: _Slab) -> None:
        """Write a slab begun by `_begin`, record it (resume), and give its buffer back once
        nothing on the pool reads it any more."""
        start = perf_counter()
        try:
            if slab.stored is not None and self._error is None and not self._stop:
                self._write(slab)
                if self.progress is not None:  # flushed, then counted (volconv.resume)
                    self.progress.record(self._file, slab.a, slab.b, slab.frame,
                                         slab.checksums)  # fmt: skip
        except BaseException as e:  # raised again in the caller's thread
            self._error = e
        finally:
            running = [c for _, c in slab.chunks if isinstance(c, Future)] + slab.checksums
            for job in running:
                job.cancel()
            wait(running)
            slab.stored = slab.chunks = slab.checksums = None
            if slab.release is not None:
                slab.release()
            self.write_seconds += perf_counter() - start

    def _chunks(
        self, a: int, b: int, frame: int | None, stored: np.ndarray
    ) -> list[tuple[tuple[int, ...], object]]:
        """Rows ``[a, b)`` of every filter (``stored``: the stored type, each filter's rows
        contiguous) as whole chunks, in file order, each with its bytes and filter mask:
        uncompressed, ``stored``'s own rows (no copy: HDF5 writes from the caller's buffer),
        else a future of them, encoded by the dataset's own filters on the pool. The last
        chunk of an axis that the data does not fill is padded, as HDF5 stores it."""
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

    def _encode(self, values: np.ndarray) -> np.ndarray:
        """Responses in the stored type, converted on every core: numpy's float16 and uint8
        casts run at ~0.7 GB/s a core, the same order as the disk, and release the GIL."""
        if self.dtype == np.float32:
            return np.asarray(values, np.float32)
        values = np.asarray(values, np.float32)
        out = np.empty(values.shape, self.dtype)
        planes, stored = values.reshape(-1, *values.shape[-2:]), out.reshape(-1, *out.shape[-2:])
        bounds = np.linspace(0, len(planes), min(len(planes), 4 * _cores()) + 1).astype(int)
        counts = _pool().map(
            lambda a, b: self._encode_part(planes[a:b], stored[a:b]), bounds[:-1], bounds[1:]
        )
        for nans, clipped in counts:
            self.nans += nans
            self.clipped += clipped
        return out

    def _encode_part(self, values: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """Encode ``values`` into ``out``; the counts of NaN and saturated voxels (uint8)."""
        return encode(values, out, self.scale, self.offset)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._stop = True  # the file is incomplete now; nothing more is written
            if isinstance(error, OSError) or _errno(error) is not None:
                raise self._write_error(error) from error
            raise RuntimeError(f"{self.path}: writing failed: {error}") from error

    def _write_error(self, error: BaseException) -> OutputWriteError:
        return OutputWriteError(f"{self.path}: cannot write it: {_cause(error)}")

    def drain(self) -> None:
        """Wait until every slab handed over is written; a writing error raises here. What is
        left for `finish` is the attributes, the flush and the rename."""
        self._join()
        self._raise_pending()

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
            self._flush()  # the data first: a disk full shows here
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
            self._flush()
            self._file.close()
            self._rename()
        except BaseException:
            self._discard()
            raise
        self._done = True
        return self.path

    def _flush(self) -> None:
        """Write HDF5's caches out; a failure (disk full) leaves the file discardable, where
        a failed ``close`` would leave HDF5 in a state that crashes the process later."""
        try:
            self._file.flush()
        except (OSError, RuntimeError) as e:  # h5py raises either for a failed write
            raise self._write_error(e) from e

    def _rename(self) -> None:
        """Move `temp` onto `path` if it is still the file this writer created.

        A file at `path` is swapped with `temp` in one step (`_swap`) rather than replaced:
        ext4 writes a file renamed over another out to the disk first (0.13-0.23 s for
        512 MiB), and freeing the old file's blocks and pages takes 0.08-0.14 s, done in
        the background (`remove_later`). At every moment `path` holds the old file or the
        new complete one.
        """
        st = os.lstat(self.temp)
        if (st.st_dev, st.st_ino) != self._identity or not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{self.path}: the temporary file {self.temp} was replaced")
        try:
            old = os.lstat(self.path)
        except FileNotFoundError:
            old = None
        replaceable = old is not None and (stat.S_ISREG(old.st_mode) or stat.S_ISLNK(old.st_mode))
        if replaceable and _swap(self.temp, self.path):
            swapped = os.lstat(self.temp)
            if (swapped.st_dev, swapped.st_ino) == (old.st_dev, old.st_ino):
                # a name no rerun takes for a partial output to resume
                os.rename(self.temp, self._folder / f"{self.path.name}.replaced")
                self._remove_folder(later=True)
                return
            if not _swap(self.temp, self.path):  # replaced meanwhile: put it back
                self._folder = None  # never removed: it holds what was at `path`
                raise OutputError(f"{self.path} changed while it was replaced; what was "
                                  f"there is now {self.temp}")  # fmt: skip
        os.replace(self.temp, self.path)  # atomic, and a link at `path` is replaced itself
        self._remove_folder()

    def keep(self) -> None:
        """Stop writing but keep the temporary file and its progress, for a later run to
        resume (`volconv.resume`): what Ctrl-C and SIGTERM do. Safe from another thread."""
        self._keep = self.progress is not None
        self._stop = True

    def _discard(self) -> None:
        """Stop the writer thread, close and delete the temporary file and its folder (or,
        after `keep`, close the file and keep both)."""
        self._stop = True
        if hasattr(self, "_thread"):
            self._join()
        if self._keep:
            with contextlib.suppress(Exception):
                self._file.close()
            self.progress.close()
            return
        if self._file.id.valid:
            # Nothing of this file is kept: point HDF5's descriptor at an anonymous file
            # first, so closing neither writes the caches to the disk nor fails when it is
            # full (a failed close leaves HDF5 in a state that crashes the process).
            _redirect(self._fd)
            with contextlib.suppress(Exception):  # discarding: the first error is what counts
                self._file.close()
        self._remove_folder()

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
