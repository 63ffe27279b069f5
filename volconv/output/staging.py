"""Staging an output: path checks, the private folder it is written in, the atomic rename into
place, and the folders of dead runs.

An output (a file, or an OME-Zarr folder) is made in a private folder beside its final path
(``.NAME.partial-HOST-PID-RANDOM``, mode 0700, a name nobody can predict, see `private_prefix`)
and renamed into place only when complete: nothing that looks finished exists until it is,
and no link planted in a shared folder can redirect the writes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

from volconv.checks import file_kind
from volconv.errors import OutputError

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]


# Failures to write that are not the user's mistake: no space, quota, I/O, size limit.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (links followed): the only kind volconv ever opens
    as an output, since opening a FIFO blocks and a device is no file to read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing, a name too long, a loop of links
        return False


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
    try:
        if hasattr(os, "memfd_create") and not limited:
            other = os.memfd_create("volconv-discard")
        else:
            other = os.open(os.devnull, os.O_RDWR)
    except OSError as e:  # out of descriptors: closing writes to the file, deleted next
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return
        raise
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
