"""volconv: banks of 3D/4D convolution filters on OpenCL, exactly scipy.ndimage.convolve."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The one place the version is written; pyproject.toml reads it from here, and reading it
# costs no package-metadata look-up at start.
__version__ = "0.2.0"

__all__ = ["BankConvolver", "__version__", "convolve_bank"]

if TYPE_CHECKING:
    from volconv.engines.direct import BankConvolver, convolve_bank


def __getattr__(name: str) -> Any:
    # The engine (numpy, pyopencl) loads on first use, not for `volconv --help`.
    if name in ("BankConvolver", "convolve_bank"):
        from volconv.engines import direct as engine

        return getattr(engine, name)
    raise AttributeError(f"module 'volconv' has no attribute {name!r}")
