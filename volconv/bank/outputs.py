"""The outputs of a run: the volumes a file stores, each a named function of the bank's responses.

The bank's filters make responses on the device; an `Output` is one stored volume: a filter's
response as it is, or one volume of a derived feature computed from several responses
(`volconv.bank.features`). Everything after the filters (the writer, the memory model, provenance,
resume, the batch key) counts and names outputs, never filters: the file's N is the number of
outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from volconv.bank.filters import stack_kernels

RESPONSE = "response"


@dataclass(frozen=True, eq=False)
class Output:
    """One stored volume of an output file.

    Attributes
    ----------
    name : str
        Unique within the file; the ``filter`` coordinate (HDF5), channel label (OME-Zarr),
        sidecar name (NIfTI).
    kind : str
        `RESPONSE` for a filter's response stored as it is, else the feature type that makes it
        (``hessian_eigenvalues``, ...).
    kernel : (kx, ky, kz) float64 array or None
        For a response: exactly the array ``scipy.ndimage.convolve`` is given (stored in
        ``/kernels``). None for a feature's output.
    params : dict
        What decides a feature's output beyond its kind (sigma, rho, truncate, which of its
        volumes); empty for a response. Part of what decides the output (provenance, resume).
    """

    name: str
    kind: str = RESPONSE
    kernel: np.ndarray | None = None
    params: dict[str, object] = field(default_factory=dict)

    @property
    def is_response(self) -> bool:
        return self.kind == RESPONSE


def responses(filters: list) -> list[Output]:
    """Each filter of a bank (`volconv.bank.filters.Filter`) as the output that stores its
    response."""
    return [Output(f.name, RESPONSE, f.kernel) for f in filters]


def stored_kernels(outputs: list[Output]) -> tuple[np.ndarray, np.ndarray]:
    """The ``/kernels`` array and the per-output extents: each response's kernel, and a
    (1, 1, 1) zero kernel for each feature output (the ``features`` attribute describes
    those), stacked to one extent (`volconv.bank.filters.stack_kernels`)."""
    arrays = [o.kernel if o.is_response else np.zeros((1, 1, 1)) for o in outputs]
    extents = np.array([a.shape for a in arrays], np.int64)
    return stack_kernels(arrays), extents
