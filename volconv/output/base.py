"""The writer protocol every output format implements: open, write a slab, drain, finish (or
keep on an interrupt, or discard), read back, is complete.

`SlabWriter` holds what every format shares: the checks, the private folder beside the output
(`volconv.output.staging`), a background thread that takes slabs in order (so writes and
compression overlap the device work), the conversion to the stored type on every core, the
record of each slab written (`volconv.run.resume`), and the rename into place when complete. A
format (`volconv.output.hdf5`, `.nifti`, `.omezarr`) says how its file is laid out
(`_open`, `_layout`), how a slab's bytes are prepared on the pool and written (`_prepare`,
`_write`), and how the file is finished (`_commit`) or dropped (`_close_discarded`).
"""

from __future__ import annotations

import os
import queue
import shutil
import stat
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

from volconv import __version__
from volconv.checks import check_positive_int
from volconv.engines.convert import encode
from volconv.errors import OutputError, OutputExistsError, OutputWriteError
from volconv.output.codecs import DTYPES, _cores, _pool
from volconv.output.provenance import ROOT_ATTRS
from volconv.output.space import Space
from volconv.output.staging import (
    _WRITE_ERRNOS,
    _cause,
    _errno,
    _swap,
    private_prefix,
    remove_later,
    remove_stale_temps,
)

if TYPE_CHECKING:
    from volconv.run.resume import Progress


@dataclass(eq=False)
class _Slab:
    """A slab in the writer thread's hands: its rows and frame, what gives its buffer back,
    its stored values, its CRCs (futures, resume) and its chunks: where each goes with its
    bytes (and, HDF5, filter mask), or a future of them (made on the pool)."""

    a: int
    b: int
    frame: int | None
    release: Callable[[], None] | None
    stored: np.ndarray | None = None
    checksums: list[Future[int]] = field(default_factory=list)
    chunks: list[tuple[object, object]] = field(default_factory=list)


class _NoFlush:
    """What `volconv.run.resume.Progress.record` flushes for a format whose writes are in the
    operating system's hands once made (a shared mapping, a chunk file written whole)."""

    def flush(self) -> None:
        pass


class SlabWriter:
    """Writes the N outputs of one input, slab by slab, into one output at ``path``.

    Use it as a context manager: `write_slab` every slab (of every frame), then `finish`.
    Leaving the ``with`` block by an exception (KeyboardInterrupt too) stops the writer
    thread and deletes the temporary output, unless `keep` was called; the final path is
    never touched.

    The output is written as `temp` in a private folder beside ``path``
    (``.NAME.partial-HOST-PID-RANDOM``, mode 0700, removed when done): made by this process
    alone, so nobody can plant a link at its name, and created exclusively. Only that entry,
    checked to be the one created, is renamed onto ``path`` (a link at ``path`` is replaced,
    never followed).

    Parameters
    ----------
    path : Path
        The output. Its parent folders are created.
    input_shape : tuple of int
        ``(x, y, z)`` or ``(x, y, z, t)``.
    names : list of str
        The N output names, in order (the ``filter`` coordinate).
    kernels : (K, sx, sy, sz) array
        The N kernels, stored as float32 (a feature output's: a (1, 1, 1) zero kernel;
        `volconv.output.open_writer` makes them from the outputs).
    dtype : {'float32', 'float16', 'uint8'}
        Stored type. float16 saturates finite values at +-65504 (inf and NaN stay); uint8 stores
        ``clip(round((value - offset) / scale), 0, 255)`` computed in float32, NaN as 0.
    compression : str
        The format's codec name (`volconv.output.codecs`).
    scale, offset : float
        uint8 quantisation (value = stored * scale + offset), recorded beside the values.
    boundary, cval
        Recorded beside the values.
    slab_depth : int
        Rows along x per slab (the last may be shorter); sets the chunk shape.
    overwrite : bool
        Replace an existing output at ``path`` when the new one is complete.
    extents : (K, 3) array of int, optional
        Each kernel's own extent before zero-padding to the common one; default: the common
        extent for every kernel.
    progress : volconv.run.resume.Progress, optional
        Record each slab once written, and continue a dead run's partial output that matches
        (`volconv.run.resume`); its ``done`` slabs are then already written.
    space : Space, optional
        Where the input lies (affine, codes, units, repetition time); default from the
        ``affine`` given to `finish` (HDF5) or the identity.

    Attributes
    ----------
    temp : Path
        The output being written, until `finish` renames it.
    clipped, nans : int
        uint8 only: voxels saturated at 0 or 255, and NaN voxels stored as 0, so far (the
        caller warns once).
    write_seconds : float
        Time the writer thread spent writing.

    Raises
    ------
    OutputExistsError
        ``path`` holds something (complete or not) and ``overwrite`` is false.
    OutputError
        A bad dtype, compression, scale, or a path that cannot be written.
    OutputWriteError
        From `write_slab` and `finish`: writing failed (disk full, I/O error); the
        temporary output is removed.
    """

    format = ""
    # Slabs the writer thread works on at once (their chunks made on the pool meanwhile).
    in_flight = 1

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
        space: Space | None = None,
    ) -> None:
        self.path = Path(path)
        self.progress = progress
        self.shape = tuple(int(s) for s in input_shape)
        self.names = list(names)
        kernels = np.asarray(kernels, dtype=np.float32)
        self._check(self.names, kernels, dtype, scale, offset, slab_depth)
        self.extents = self._check_extents(extents, kernels)
        self.kernels = kernels
        self.compression = compression
        self._codec = self._codec_for(compression)
        self._check_path(overwrite)
        self.dtype = np.dtype(dtype)
        self.scale, self.offset = float(scale), float(offset)
        self.boundary, self.cval = boundary, float(cval)
        self.slab_depth = int(slab_depth)
        self.space = space
        self.write_seconds = 0.0
        self.clipped = self.nans = 0
        # Rows handed over per frame: finish() refuses to mark an incomplete output complete.
        self._written = np.zeros(
            (self.shape[3] if len(self.shape) == 4 else 1, self.shape[0]), bool
        )
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._stop = False
        self._done = False
        self._folder: Path | None = None
        self._keep = False
        self._sync: object = _NoFlush()
        resumed = self._create((len(self.names), *self.shape))
        try:
            self._layout()
            if resumed:  # volconv.run.resume: a dead run's output, its complete slabs checked
                self._resumed()
        except OSError as e:  # no room for the file (NIfTI reserves it whole), I/O
            self._discard()
            error = OutputWriteError if _errno(e) in _WRITE_ERRNOS else OutputError
            raise error(f"{self.path}: cannot write there ({_cause(e)})") from e
        except BaseException:
            self._discard()
            raise
        self._thread = threading.Thread(target=self._run, name="volconv-writer", daemon=True)
        self._thread.start()

    # -- what a format defines ---------------------------------------------------------
    def _codec_for(self, compression: str) -> object:
        """Check ``compression`` for this format and return what `_layout` uses."""
        raise NotImplementedError

    def _open(self, resumed: bool) -> None:
        """Create `temp` exclusively (``resumed``: a dead run's partial is at `_killed`)."""
        raise NotImplementedError

    def _layout(self) -> None:
        """Lay out the file: arrays, coordinates, attributes known before the data."""
        raise NotImplementedError

    def _resumed(self) -> None:
        """Take the complete slabs of the partial `progress` resumed into the new output."""
        raise NotImplementedError

    def _prepare(self, a: int, b: int, frame: int | None, stored: np.ndarray) -> list:
        """A slab's chunks, or futures of them on the pool (empty: `_write` does it all)."""
        return []

    def _write(self, slab: _Slab) -> None:
        raise NotImplementedError

    def _commit(self, attrs: dict) -> None:
        """Write what ends the file (attributes, ``complete``, a header) and close it."""
        raise NotImplementedError

    def _close_discarded(self) -> None:
        """Close the file without caring for what it holds (it is being deleted or kept)."""

    def _flush(self) -> None:
        """Hand what is written to the operating system; a failure raises OutputWriteError."""

    def _rename_beside(self) -> None:
        """Move files that go beside the output (a NIfTI's sidecar) into place first."""

    # -- checks --------------------------------------------------------------------------
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
                f"kernels must be ({len(names)}, sx, sy, sz) for {len(names)} outputs; "
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

    def _check_path(self, overwrite: bool) -> None:
        from volconv.output import check_output_path, is_complete  # format-aware

        check_output_path(self.path)  # a folder, a FIFO, a name too long: before creating
        if self.path.exists() and not overwrite:
            what = (
                "is already complete"
                if is_complete(self.path)
                else "holds a file that is not a complete volconv output"
            )
            raise OutputExistsError(f"{self.path}: {what}; use --overwrite to replace it")

    # -- the private folder --------------------------------------------------------------
    def _create(self, shape: tuple[int, ...]) -> bool:
        """Make the private folder and, in it, the output, exclusively, or with a `progress`,
        continue there a dead run's partial output that it claims and checks
        (`volconv.run.resume`). Whether the output is a resumed one."""
        resumed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix=private_prefix(self.path),
                                                 dir=self.path.parent))  # fmt: skip
            self.temp = self._folder / self.path.name
            if self.progress is not None:  # before the stale folders go: one may be resumed
                resumed = self.progress.open(self.path, self._folder, shape, self.dtype)
            remove_stale_temps(self.path)
            if resumed:  # its slabs are copied into a new output: a killed writer's own
                # state may not hold
                os.rename(self.temp, self._killed)
            self._open(resumed)
        except OSError as e:
            self._remove_folder()
            error = OutputWriteError if _errno(e) in _WRITE_ERRNOS else OutputError
            raise error(f"{self.path}: cannot write there ({_cause(e)})") from e
        except BaseException:  # the input's SHA-256 failed while checking a partial, Ctrl-C
            self._remove_folder()
            raise
        named = os.lstat(self.temp)
        self._identity = (named.st_dev, named.st_ino)
        return resumed

    @property
    def _killed(self) -> Path:
        """Where the partial output `progress` resumed waits while its slabs are copied."""
        return self.temp.with_name(self.temp.name + ".resumed")

    def _resumed_rows(self) -> np.ndarray:
        """(frame, row): the rows the resumed partial holds complete; counted as written."""
        rows = np.zeros(self._written.shape, bool)
        for (frame, a), b in self.progress.done.items():
            rows[frame, a:b] = True
        return rows

    def _remove_folder(self, later: bool = False) -> None:
        if self.progress is not None:
            self.progress.close()
        if self._folder is not None:
            if later:
                remove_later(self._folder)
            else:
                shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

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
        """Queue the outputs ``(N, b - a, y, z)`` of rows ``[a, b)`` for writing.

        ``responses`` of the stored type (converted on the device, `volconv.engines.convert`) are
        written as they are, with ``counts``, their uint8 NaN and clipped voxels; others
        (float32) are converted here. Blocks while two slabs wait, so the device runs at
        most two slabs ahead of the disk. The writer keeps ``responses`` until it is
        written, then calls ``release`` (from the writer thread; also when the slab is
        dropped after an error), so a caller can reuse a buffer, e.g. page-locked memory
        the device downloads into fast. ``frame`` is the volume of a 4D input (None or 0
        for 3D). An error of the writer thread is raised here, on the next call.
        """
        self._raise_pending()
        if self._done or self._stop:
            raise RuntimeError(f"{self.path}: the writer is closed")
        nx, ny, nz = self.shape[:3]
        if not 0 <= a < b <= nx:
            raise ValueError(f"rows [{a}, {b}) must lie within [0, {nx})")
        expected = (len(self.names), b - a, ny, nz)
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
        (`_begin`: its chunks go to the pool) while fewer than `in_flight` are, and write
        them in order (`_end`); after an error or an abort, keep draining so `write_slab`
        never blocks on a full queue."""
        flight: deque[_Slab] = deque()
        closing = False
        while flight or not closing:
            room = len(flight) < self.in_flight and not self._queue.empty()
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
        """Start writing a slab: its stored values, its CRCs (resume) and its chunks on the
        pool."""
        slab = _Slab(a, b, frame, release)
        if self._error is not None or self._stop:
            return slab
        start = perf_counter()
        try:
            stored = responses if responses.dtype == self.dtype else self._encode(responses)
            slab.stored = stored
            if self.progress is not None:  # volconv.run.resume: CRCs beside the write
                slab.checksums = self.progress.checksums(stored)
            slab.chunks = self._prepare(a, b, frame, stored)
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
                if self.progress is not None:  # written, then counted (volconv.run.resume)
                    self.progress.record(self._sync, slab.a, slab.b, slab.frame,
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

    def _encode(self, values: np.ndarray) -> np.ndarray:
        """Outputs in the stored type, converted on every core: numpy's float16 and uint8
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
            self._stop = True  # the output is incomplete now; nothing more is written
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
        if hasattr(self, "_thread") and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    # -- finishing ---------------------------------------------------------------------
    def finish(self, attrs: dict) -> Path:
        """Wait for every slab, write the provenance and the mark of a complete output last,
        and rename the output to `path`.

        Parameters
        ----------
        attrs : dict
            Provenance: every name of `ROOT_ATTRS` (``volconv_version`` defaults to this
            volconv's), and any others.

        Returns
        -------
        Path
            The finished output.
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
            if self.space is None:  # where the input lies: from the affine given, if one
                affine = np.asarray(attrs["affine"], np.float64)
                self.space = Space.from_affine(affine if affine.shape == (4, 4) else np.eye(4))
            self._commit(attrs)
            self._rename()
        except BaseException:
            self._discard()
            raise
        self._done = True
        return self.path

    def _rename(self) -> None:
        """Move `temp` onto `path` if it is still what this writer created.

        An output at `path` is swapped with `temp` in one step (`_swap`) rather than
        replaced: ext4 writes a file renamed over another out to the disk first, and freeing
        the old file's blocks and pages is done in the background (`remove_later`). At every
        moment `path` holds the old output or the new complete one.
        """
        st = os.lstat(self.temp)
        kind = stat.S_ISDIR if self.format == "zarr" else stat.S_ISREG
        if (st.st_dev, st.st_ino) != self._identity or not kind(st.st_mode):
            raise OutputError(f"{self.path}: the temporary output {self.temp} was replaced")
        self._rename_beside()
        try:
            old = os.lstat(self.path)
        except FileNotFoundError:
            old = None
        modes = (stat.S_ISREG, stat.S_ISLNK, stat.S_ISDIR)
        replaceable = old is not None and any(m(old.st_mode) for m in modes)
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
        if old is not None and stat.S_ISDIR(old.st_mode):  # no swap: a folder moves aside
            os.rename(self.path, self._folder / f"{self.path.name}.replaced")
        os.replace(self.temp, self.path)  # atomic, and a link at `path` is replaced itself
        self._remove_folder(later=old is not None and stat.S_ISDIR(old.st_mode))

    def keep(self) -> None:
        """Stop writing but keep the temporary output and its progress, for a later run to
        resume (`volconv.run.resume`): what Ctrl-C and SIGTERM do. Safe from another thread."""
        self._keep = self.progress is not None
        self._stop = True

    def _discard(self) -> None:
        """Stop the writer thread, close and delete the temporary output and its folder (or,
        after `keep`, close it and keep both)."""
        self._stop = True
        self._join()
        if self._keep:
            self._close_discarded()
            self.progress.close()
            return
        self._close_discarded()
        self._remove_folder()

    def __enter__(self) -> SlabWriter:
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
            raise RuntimeError(f"{self.path}: the writer was left without finish(); discarded")
