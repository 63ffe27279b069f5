"""The errors volconv raises across stages, in a module that imports nothing heavy, so that the
command line can tell them apart (exit 2 for the user's mistakes, 1 for the rest) without
loading OpenCL or HDF5 first."""

from __future__ import annotations


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
