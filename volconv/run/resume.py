"""Resume inside a volume: a rerun continues an interrupted output from its slabs complete.

An output is written in a private folder (`volconv.output.private_prefix`, mode 0700) that
also holds this module's progress log, ``progress``. After a slab is written, the HDF5 file
is flushed and only then is the slab recorded, with a CRC-32 of each filter's stored bytes:
a slab written but not flushed when the process dies (SIGKILL, a lost node) is never
counted. A rerun (`Progress.open`) takes over the folder of a run of this host that no longer
runs (`volconv.output.dead_runs`), or of one this process stopped (`leftovers`), when it is
this user's real folder, not open to others, its
log names the same fingerprint (`fingerprint`: bank, boundary, cval, output type and layout,
device, path; and the input's SHA-256), and its file is this user's regular file; the folder is
claimed by renaming it onto the rerun's own new one, so of two runs at once one takes it and
the other starts afresh. Every slab the log counts is read back and its CRCs checked before it
is kept, and its chunks must be stored in the file (an unwritten one reads as the fill value,
whose CRC a forged log could give): what the file holds is what counts, whatever the log
says. Nothing here ever makes a file look complete: ``complete = True`` and the final name
come from `volconv.output.SlabWriter.finish` alone.

The log is text, one record a line, each line ending in its own CRC-32 (a line cut short by a
kill is ignored)::

    volconv-progress 1 KEY
    input SHA256
    slab FRAME A B CRC,CRC,...
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

import volconv
from volconv.device.devices import device_name
from volconv.output import _pool, dead_runs, open_partial, private_prefix

if TYPE_CHECKING:
    from volconv.config import Config
    from volconv.engines.separable import SeparableConvolver
    from volconv.run.jobs import Job

LOG = "progress"  # the log's name in the private folder
FORMAT = "volconv-progress 1"
# Opened without following a link at the last component, and never a FIFO's blocking open.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# The private folders whose progress this process has open: any other folder named for this
# process was kept by a run it stopped (Ctrl-C in a notebook, a batch task) and may resume.
_OPEN: set[Path] = set()


def leftovers(path: Path) -> list[Path]:
    """Where a partial output of ``path`` may be: what runs that no longer run left
    (`volconv.output.dead_runs`), and this process's own folders that no run has open."""
    prefix = private_prefix(path)
    try:
        own = [path.parent / n for n in os.listdir(path.parent) if n.startswith(prefix)]
    except OSError:
        own = []
    return dead_runs(path) + [p for p in own if p not in _OPEN]


def fingerprint(job: Job, cfg: Config, conv: SeparableConvolver) -> str:
    """What decides the bytes of ``job``'s output: a partial made with another value of any
    of these is never resumed. The input's SHA-256 is checked beside it (`Progress`)."""
    parts = {
        "format": FORMAT,
        "volconv": volconv.__version__,
        "shape": [int(s) for s in job.volume.shape],
        "names": job.names,
        "kernels": hashlib.sha256(np.asarray(job.kernels, np.float32).tobytes()).hexdigest(),
        "extents": [list(e) for e in job.extents],
        "boundary": cfg.boundary,
        "cval": float(cfg.cval),
        "dtype": cfg.dtype,
        "scale": float(job.scale),
        "offset": float(job.offset),
        "compression": cfg.compression,
        "slab_depth": int(conv.plan.slab_depth),
        "device": device_name(conv.device),
        "engines": list(conv.engines),
        "choices": repr(job.plan.choices),
        "outputs": [[o.name, o.kind, o.params] for o in job.outputs],  # volconv.bank.features
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _line(body: str) -> bytes:
    return f"{body}\t{zlib.crc32(body.encode()):08x}\n".encode()


def _records(text: bytes) -> list[list[str]]:
    """The whole, intact lines of a log, split into words."""
    records = []
    for raw in text.split(b"\n")[:-1]:  # the last piece has no newline: cut short, or empty
        body, _, crc = raw.decode("utf-8", "replace").rpartition("\t")
        if crc == f"{zlib.crc32(body.encode()):08x}":
            records.append(body.split(" "))
    return records


def _partial_kind(mode: int) -> bool:
    """A partial output is a file (HDF5, NIfTI) or a folder (OME-Zarr)."""
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


def _ours(st: os.stat_result, kind: Callable[[int], bool], private: bool = False) -> bool:
    """This user's entry of the kind asked (a link is of no kind asked); ``private``: one
    that nobody else may enter or change (a folder made by `tempfile.mkdtemp`)."""
    return kind(st.st_mode) and st.st_uid == os.geteuid() and not (private and st.st_mode & 0o077)


class Progress:
    """The progress of one output: which slabs of which frames are complete.

    Parameters
    ----------
    key : str
        The `fingerprint` of the job.
    input_sha : callable
        The input's SHA-256; called only when a partial output with the same key is found.

    Attributes
    ----------
    done : dict
        ``(frame, a) -> b`` for every slab ``[a, b)`` complete on disk (frame 0 for 3D).
    kept : int
        How many of them a run that no longer runs had made (0: a fresh file).
    """

    def __init__(self, key: str, input_sha: Callable[[], str]) -> None:
        self.key = key
        self.flush_seconds = 0.0  # spent flushing the file before records (benchmarks)
        self._input_sha = input_sha
        self.done: dict[tuple[int, int], int] = {}
        self.kept = 0
        self._crcs: dict[tuple[int, int], list[int]] = {}
        self._input: str | None = None
        self._input_logged = False
        self._fd: int | None = None
        self._folder: Path | None = None
        self._lock = threading.Lock()

    # -- a rerun: find, check and claim a dead run's partial output ----------------------
    def open(self, path: Path, folder: Path, shape: tuple[int, ...], dtype: np.dtype) -> bool:
        """Start the log in ``folder`` (this run's new, empty private folder), first moving
        into it the partial output of a dead run that matches, if there is one.

        Returns
        -------
        bool
            Whether ``folder / path.name`` now holds a partial output whose `done` slabs
            were read back and found whole; the writer opens it to continue.
        """
        self._folder = folder
        _OPEN.add(folder)  # first: what is claimed into it is this run's, never another's
        resumed = False
        for candidate, records in self._candidates(path):
            if not self._claim(candidate, folder):
                continue
            if self._verify(folder / path.name, records, shape, dtype):
                resumed = True
                break
            self._clear(folder)  # claimed, but not whole: start afresh
        self.kept = len(self.done)
        self._start(folder)
        return resumed

    def _candidates(self, path: Path) -> Iterator[tuple[Path, list[list[str]]]]:
        """Dead runs' folders of this user whose log has this key and this input, most
        slabs first; the input's SHA-256 is computed once, only if one has the key."""
        found = []
        for entry in leftovers(path):
            try:
                if not _ours(os.lstat(entry), stat.S_ISDIR, private=True):
                    continue
                records = self._read_log(entry / LOG)
                if not _ours(os.lstat(entry / path.name), _partial_kind):
                    continue
            except OSError:  # gone meanwhile (another run claimed it), or no log
                continue
            slabs = sum(r[0] == "slab" for r in records)
            if slabs and records[0] == [*FORMAT.split(" "), self.key]:
                found.append((slabs, entry, records))
        for _, entry, records in sorted(found, key=lambda c: -c[0]):
            if ["input", self._sha()] in records:
                yield entry, records

    def _sha(self) -> str:
        if self._input is None:
            self._input = self._input_sha()
        return self._input

    @staticmethod
    def _read_log(log: Path) -> list[list[str]]:
        fd = os.open(log, os.O_RDONLY | _NOFOLLOW)
        try:
            if not _ours(os.fstat(fd), stat.S_ISREG):
                return []
            with os.fdopen(os.dup(fd), "rb") as f:
                return _records(f.read())
        finally:
            os.close(fd)

    @staticmethod
    def _claim(candidate: Path, folder: Path) -> bool:
        """Move ``candidate`` onto this run's empty ``folder``: atomic, so of two runs that
        found it one has it and the other sees it gone."""
        try:
            os.rename(candidate, folder)
        except OSError:
            return False
        return True

    def _verify(
        self, temp: Path, records: list[list[str]], shape: tuple[int, ...], dtype: np.dtype
    ) -> bool:
        """Keep the slabs of ``records`` whose stored bytes read back with their CRCs."""
        try:
            fd = os.open(temp, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not _ours(st, _partial_kind) or (stat.S_ISREG(st.st_mode) and st.st_nlink != 1):
                return False
            # (N, x, y, z[, t]) of the partial, whatever its format; None: not the one checked
            with open_partial(temp, st, shape, dtype) as responses:
                if responses is None or responses.shape != shape or responses.dtype != dtype:
                    return False
                for record in records:
                    if record[0] == "slab" and len(record) == 5:
                        self._check_slab(responses, record)
        except Exception:  # a killed writer's file may fail in any way
            self.done.clear()
            self._crcs.clear()
            return False
        finally:
            os.close(fd)
        return bool(self.done)

    def _check_slab(self, responses: h5py.Dataset, record: list[str]) -> None:
        frame, a, b = (int(v) for v in record[1:4])
        crcs = [int(c, 16) for c in record[4].split(",")]
        tail = (frame,) if responses.ndim == 5 else ()
        if len(crcs) != responses.shape[0] or not 0 <= a < b <= responses.shape[1]:
            return
        if not _on_disk(responses, a, b, frame):
            return  # an unwritten chunk reads as the fill value, whatever a log claims
        for f, crc in enumerate(crcs):
            if zlib.crc32(np.ascontiguousarray(responses[(f, slice(a, b), ..., *tail)])) != crc:
                return
        self.done[frame, a] = b
        self._crcs[frame, a] = crcs

    @staticmethod
    def _clear(folder: Path) -> None:
        """Empty this run's own folder (what a claimed partial that failed its checks left)."""
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)  # fd-based on Linux: never follows links inside
            else:
                os.unlink(entry.path)

    # -- the log --------------------------------------------------------------------------
    def _start(self, folder: Path) -> None:
        """A new log in ``folder``, holding what is kept, replacing the dead run's."""
        fd, new = tempfile.mkstemp(prefix=f"{LOG}.", dir=folder)  # exclusive, 0600
        lines = [_line(f"{FORMAT} {self.key}")]
        self._input_logged = self._input is not None  # known when a candidate was checked
        if self._input_logged:
            lines.append(_line(f"input {self._input}"))
        lines += [_slab_line(frame, a, b, self._crcs[frame, a])
                  for (frame, a), b in sorted(self.done.items())]  # fmt: skip
        os.write(fd, b"".join(lines))
        os.replace(new, folder / LOG)
        os.close(fd)
        self._fd = os.open(folder / LOG, os.O_WRONLY | os.O_APPEND | _NOFOLLOW)
        if not _ours(os.fstat(self._fd), stat.S_ISREG):
            raise OSError(f"{folder / LOG} was replaced")

    def input_known(self, sha: Future[str]) -> None:
        """Record the input's SHA-256 once it is computed (a callback of its future): only
        a log that names it is ever resumed."""
        if sha.cancelled() or sha.exception() is not None:
            return
        with self._lock:
            if not self._input_logged:
                self._input_logged = True
                self._append(_line(f"input {sha.result()}"))

    @staticmethod
    def checksums(stored: np.ndarray) -> list[Future[int]]:
        """The CRC-32 of each filter's stored bytes (``stored``: N, rows, y, z), computed on
        the writer's pool while the slab is written (crc32 releases the GIL; 3.5 GB/s a core)."""
        return [_pool().submit(lambda s=s: zlib.crc32(np.ascontiguousarray(s))) for s in stored]

    def record(
        self, file: h5py.File, a: int, b: int, frame: int | None, checksums: list[Future[int]]
    ) -> None:
        """Slab ``[a, b)`` of ``frame`` is written (its `checksums`): flush the file, and only
        then count the slab complete."""
        start = time.perf_counter()
        file.flush()  # the slab's data and HDF5's metadata, out of this process
        self.flush_seconds += time.perf_counter() - start
        crcs = [c.result() for c in checksums]
        with self._lock:
            self.done[frame or 0, a] = b
            self._crcs[frame or 0, a] = crcs
            self._append(_slab_line(frame or 0, a, b, crcs))

    def _append(self, line: bytes) -> None:
        if self._fd is not None:
            os.write(self._fd, line)  # one write: whole or, if killed, cut (and ignored)

    def remaining(self, work: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The ``(frame, a, b)`` of ``work`` not complete on disk."""
        return [(t, a, b) for t, a, b in work if self.done.get((t, a)) != b]

    def close(self) -> None:
        """Close the log: from now on the folder is free for a later run to resume."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            _OPEN.discard(self._folder)


def _on_disk(responses: object, a: int, b: int, frame: int) -> bool:
    """Whether every chunk of rows ``[a, b)`` of ``frame`` (every filter) is stored in the
    file: only those were written (the writer writes whole chunks; the rerun copies them).
    Other formats' partials (a NIfTI's reserved file, a Zarr group) are taken as their CRCs
    say."""
    if not isinstance(responses, h5py.Dataset):
        return True
    if responses.chunks is None:
        return False  # volconv writes chunks only
    index = (slice(None), slice(a, b), slice(None), slice(None))
    if responses.ndim == 5:
        index += (slice(frame, frame + 1),)
    for part in responses.iter_chunks(index):
        corner = tuple(s.start // c * c for s, c in zip(part, responses.chunks, strict=True))
        if responses.id.get_chunk_info_by_coord(corner).byte_offset is None:
            return False
    return True


def _slab_line(frame: int, a: int, b: int, crcs: list[int]) -> bytes:
    return _line(f"slab {frame} {a} {b} {','.join(f'{c:08x}' for c in crcs)}")


def recorded_slabs(path: Path) -> int:
    """The most slabs that a partial output of ``path`` left by an interrupted run records
    (0: none), from the logs alone: what `volconv validate` shows. Whether a rerun resumes it
    (same fingerprint and input, bytes that match) is decided by `Progress.open`."""
    most = 0
    for entry in leftovers(path):
        try:
            if _ours(os.lstat(entry), stat.S_ISDIR, private=True):
                most = max(most, sum(r[0] == "slab" for r in Progress._read_log(entry / LOG)))
        except OSError:
            continue
    return most
