"""volconv: banks of 3D/4D convolution filters on OpenCL, exactly scipy.ndimage.convolve."""

from importlib.metadata import PackageNotFoundError, version

from volconv.engine import BankConvolver, convolve_bank

try:
    __version__ = version("volconv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["BankConvolver", "__version__", "convolve_bank"]
