"""volconv's cache folder and the one rule for what in it is trusted.

The folder (`default_cache_dir`) holds three caches, each keyed by the one `device_key`: the
program binaries (``programs/``, `volconv.device.programs`), the FMA probe's rates (``peak.json``,
`volconv.device.peak`) and the tuning (``tune.json``, `volconv.plan.tune`). Every read and write of
them goes through `read_cached` and `write_cached`, which apply the trust rule:

- a folder (the cache folder, ``programs/``) is used only if it is a real folder, not a
  link, owned by this user (the effective uid) and writable by no one else (no group or
  other write bit, sticky or not);
- a file is read only if it is a regular file (not a link, FIFO or device: it is opened
  with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``, so nothing blocks), owned by
  this user and writable by no one else, in folders that pass.

What fails is ignored, with one warning per path and process naming it and why, and made
again: a file is replaced through a private temporary file renamed over it (never written
in place); a cache folder that fails is not used at all: the per-user cache folder (or, if
that fails too, a private temporary one for this process) takes its place.
"""

from __future__ import annotations

import atexit
import errno
import os
import secrets
import shutil
import stat
import tempfile
import warnings
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyopencl as cl

CACHE_ENV = "VOLCONV_CACHE_DIR"
SUBFOLDERS = ("programs",)  # checked with the cache folder: a bad one moves the whole cache

_WARNED: set[str] = set()  # paths warned about in this process
_PRIVATE: list[Path] = []  # the private temporary fallback, made once a process


def default_cache_dir() -> Path:
    """``$VOLCONV_CACHE_DIR``, else the user cache dir (platformdirs), else ~/.cache/volconv."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    return user_cache_dir()


def user_cache_dir() -> Path:
    """The per-user cache folder: platformdirs' (``$XDG_CACHE_HOME/volconv``), else
    ~/.cache/volconv."""
    try:
        from platformdirs import user_cache_dir as platform_dir  # a pyopencl dependency
    except ImportError:
        return Path.home() / ".cache" / "volconv"
    return Path(platform_dir("volconv"))


def device_key(device: cl.Device) -> str:
    """The one key of a device in every cache: its platform, name and driver version (a new
    driver builds, measures and tunes again)."""
    parts = (device.platform.name, device.name, device.driver_version)
    return " | ".join(p.strip() for p in parts)


# -- the trust rule ---------------------------------------------------------------------------


def _writers(st: os.stat_result) -> str | None:
    """Who else may write, or None: the owner must be this user, no group or other write."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def folder_problem(st: os.stat_result) -> str | None:
    """Why a folder with this ``fstat`` fails the trust rule, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    return _writers(st)


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))  # fmt: skip


def file_problem(st: os.stat_result) -> str | None:
    """Why a cached file with this ``fstat`` fails the trust rule, or None."""
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "something")
        return f"{kind}, not a regular file"
    return _writers(st)


def _open_problem(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "a symbolic link"
    if e.errno == errno.ENOTDIR:
        return "not a folder"
    return e.strerror or type(e).__name__


def warn_once(path: Path | str, why: str, then: str) -> None:
    """The trust rule's warning: once a path and process."""
    say_once(str(path), f"{path}: {why}; not trusted, ignored ({then})", stacklevel=4)


def say_once(key: str, message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning, once per ``key`` and process: a cache entry is named once a run, not
    once for every plan or program that meets it."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Untrusted(OSError):
    """A cache path that fails the trust rule: ``path`` and why."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def _open_folder(path: Path, parent: int | None = None, make: bool = False) -> int | None:
    """A descriptor of the folder ``path`` (a name under ``parent``'s descriptor when given),
    checked against the rule; None when it is missing (made first, private, with ``make``:
    an OSError where it cannot be). Raises `Untrusted`."""
    where = path.name if parent is not None else str(path)
    for attempt in (0, 1):
        try:
            fd = os.open(where, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not make or attempt:
                return None
            if parent is None:
                os.makedirs(path.parent, exist_ok=True)
            with suppress(FileExistsError):  # another process made it: checked as any other
                os.mkdir(where, 0o700, dir_fd=parent)
            continue
        except OSError as e:
            why = _open_problem(e)
            with suppress(OSError):  # O_DIRECTORY on a link says ENOTDIR: name what is there
                if stat.S_ISLNK(os.lstat(where, dir_fd=parent).st_mode):
                    why = "a symbolic link"
            raise Untrusted(path, why) from None
        why = folder_problem(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise Untrusted(path, why)
        return fd
    return None


def _open_chain(folder: Path, parts: tuple[str, ...], make: bool) -> int | None:
    """The descriptor of ``folder``/``parts`` with every folder on the way checked; None
    when one is missing. Raises `Untrusted`."""
    fd = _open_folder(folder, make=make)
    path = folder
    for part in parts:
        if fd is None:
            return None
        path = path / part
        try:
            inner = _open_folder(path, fd, make=make)
        finally:
            os.close(fd)
        fd = inner
    return fd


def check_folder(folder: Path, make: bool = True) -> tuple[Path, str] | None:
    """The path in the cache folder ``folder`` (itself, or one of its `SUBFOLDERS` where
    present) that fails the rule and why, or None; ``folder`` is made (private) when missing
    and ``make``."""
    try:
        fd = _open_folder(folder, make=make)
    except Untrusted as e:
        return e.path, e.why
    except OSError:  # cannot be made (a read-only place): nothing in it to trust
        return None
    if fd is None:
        return None
    try:
        for sub in SUBFOLDERS:
            try:
                inner = _open_folder(folder / sub, fd)
            except Untrusted as e:
                return e.path, e.why
            if inner is not None:
                os.close(inner)
    finally:
        os.close(fd)
    return None


def cache_folder(cache_dir: Path | None = None) -> Path:
    """The cache folder to use: ``cache_dir`` (default `default_cache_dir`) where it passes
    the trust rule (made, private, when missing); else, with one warning, the per-user cache
    folder, or where that fails too a private temporary folder for this process."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    problem = check_folder(folder)
    if problem is None:
        return folder
    user = user_cache_dir()
    if user.absolute() != folder.absolute() and check_folder(user) is None:
        fallback = user
    else:
        fallback = _private_folder()
    warn_once(problem[0], problem[1], f"the cache is {fallback} instead")
    return fallback


def is_private(folder: Path) -> bool:
    """Whether ``folder`` is this process's private fallback (nothing in it outlives it)."""
    return Path(folder) in _PRIVATE


def _private_folder() -> Path:
    """A folder only this process knows (mode 0700, removed at exit)."""
    if not _PRIVATE:
        path = Path(tempfile.mkdtemp(prefix="volconv-cache-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _PRIVATE.append(path)
    return _PRIVATE[0]


def read_cached(folder: Path, name: str, then: str = "made again") -> bytes | None:
    """The bytes of ``folder``/``name`` (``name`` may hold one ``/``) where the file and its
    folders pass the trust rule; None when it is missing, or, with one warning naming the
    path, why and ``then`` (what happens instead), when it fails the rule."""
    *parts, leaf = name.split("/")
    path = folder.joinpath(*parts, leaf)
    try:
        fd = _open_chain(folder, tuple(parts), make=False)
    except Untrusted as e:
        warn_once(e.path, e.why, then)
        return None
    if fd is None:
        return None
    try:
        try:
            file = os.open(leaf, _FILE_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            warn_once(path, _open_problem(e), then)
            return None
    finally:
        os.close(fd)
    with os.fdopen(file, "rb") as f:
        why = file_problem(os.fstat(f.fileno()))
        if why is not None:
            warn_once(path, why, then)
            return None
        try:
            return f.read()
        except OSError as e:
            warn_once(path, _open_problem(e), then)
            return None


def write_cached(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` to ``folder``/``name`` through a private temporary file (created
    exclusively, mode 0600, under a name nobody can predict) renamed over it: whatever was
    there (a planted file, a FIFO, a link) is replaced, never written through, and a reader
    never sees half a file. Missing folders are made private. Raises OSError where it cannot
    be written (`Untrusted`, after its warning, for a folder that fails the rule)."""
    *parts, leaf = name.split("/")
    try:
        fd = _open_chain(folder, tuple(parts), make=True)
    except Untrusted as e:
        warn_once(e.path, e.why, "not written")
        raise
    if fd is None:  # removed as it was made
        raise FileNotFoundError(errno.ENOENT, "cache folder vanished", str(folder))
    tmp = f".{leaf}.{secrets.token_hex(8)}.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=fd)  # fmt: skip
        try:
            with os.fdopen(out, "wb") as f:
                f.write(data)
            os.replace(tmp, leaf, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
    finally:
        os.close(fd)
