"""The errors volconv raises across stages, in a module that imports nothing heavy, so that the
command line can tell them apart (exit 2 for the user's mistakes, 1 for the rest) without
loading OpenCL or HDF5 first."""

from __future__ import annotations

import errno


class NoDeviceError(RuntimeError):
    """No usable OpenCL device; the message says what to install or register."""


class DeviceError(ValueError):
    """A device spec (the ``device`` argument, ``--device``, ``run.device`` or
    ``PYOPENCL_CTX``) that names no device of this machine: the user's mistake."""


class OutputError(ValueError):
    """An output the user asked for cannot be written; the message names the path or value."""


class OutputExistsError(OutputError, FileExistsError):
    """The output path holds a file and overwriting was not asked for."""


class OutputWriteError(OSError):
    """Writing an output failed (disk full, I/O error): not the user's mistake. The message
    is one line naming the output and the cause; nothing that looks complete is left."""


class MidRunError(RuntimeError):
    """What would be the user's mistake (exit 2) found after the work began (an input that
    changed or vanished meanwhile): exit 1, as 2 is kept for mistakes found before any work.
    The message is the mistake's."""


def one_line(text: str) -> str:
    """``text`` with its control characters escaped as Python writes them (a newline in a file
    name as ``\\n``, an escape as ``\\x1b``), so that a name never splits a one-line message or
    sends the terminal a sequence."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# errno values that say the machine ran out of something (descriptors, memory, disk), not
# that the user gave a wrong file or value: what they stop is exit status 1, never 2
RESOURCE_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT, errno.EIO}
)


def resource_cause(e: BaseException) -> OSError | None:
    """The OSError in ``e``'s chain of causes that says the machine ran out of something."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None
