"""Codecs: the stored types, the compression names and how each is made, and the pool of
threads that encodes and compresses on every core."""

from __future__ import annotations

import os
import re
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np

from volconv.errors import OutputError

DTYPES = ("float32", "float16", "uint8")


# hdf5plugin's fast codecs by name; readers need `import hdf5plugin` too.
_PLUGINS = {
    "blosc": lambda p: p.Blosc(cname="lz4", shuffle=p.Blosc.SHUFFLE),
    "blosc2": lambda p: p.Blosc2(),
    "lz4": lambda p: p.LZ4(),
    "zstd": lambda p: p.Zstd(),
}


COMPRESSIONS = ("none", "gzip", "lzf", *_PLUGINS)


# Largest chunk that volconv compresses on its pool (gzip, lzf): a slab then makes many
# chunks, several per core, so that the cores finish together (8 filters x 32 rows of 256^2
# float16: 32 chunks; at 4 MiB, 8, and 16 cores ran at 5x one). A chunk of 1 MiB still
# costs ~100 times the call that hands it over, and fits h5py's default chunk cache.
POOL_CHUNK_BYTES = 2**20


# Slabs whose chunks compress on the pool at once: the next slab's chunks compress while the
# writer thread writes the one before, so no core waits for the writes (nor for the slowest
# chunk of a slab). Each holds its slab and its compressed chunks (`backlog_bytes`).
SLABS_IN_FLIGHT = 2


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


def needs_hdf5plugin(name: str) -> bool:
    """Whether an HDF5 file compressed with ``name`` needs hdf5plugin in its readers."""
    return name in _PLUGINS


# z planes a slab is turned over by at a time (`turned`): a block of them, for every row of
# the slab, stays in the cache while it is copied across.
TURN_PLANES = 16


def turned(rows: np.ndarray, out: np.ndarray) -> None:
    """``out[z, y, x] = rows[x, y, z]``: an output's slab (x, y, z) as x-fastest formats
    (NIfTI, OME-Zarr) store it, copied in blocks of `TURN_PLANES` z planes, so each block's
    source stays in the cache (a plain transposed copy reads every value from another cache
    line)."""
    for k in range(0, rows.shape[2], TURN_PLANES):
        out[k : k + TURN_PLANES] = rows[:, :, k : k + TURN_PLANES].transpose(2, 1, 0)
