"""What an output records of how it was made, for the formats without HDF5's own attributes
(NIfTI's sidecar, OME-Zarr's attributes), and what of that decides its values (`made`).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from volconv.output.base import SlabWriter


ROOT_ATTRS = (
    "affine", "voxel_size", "source", "source_sha256", "pipeline", "volconv_version", "device",
    "gflop", "kernel_seconds", "wall_seconds", "gflops", "peak_gflops", "fraction_of_peak",
    "engine",
)  # fmt: skip


def provenance(writer: SlabWriter, attrs: dict) -> dict:
    """What a format without HDF5's own attributes records (NIfTI's sidecar, OME-Zarr's
    attributes): the provenance ``attrs``, and what decides the values (`made`)."""
    return {
        **{k: plain(v) for k, v in attrs.items()},
        "names": writer.names,
        "kernels": base64.b64encode(writer.kernels.astype("<f4").tobytes()).decode(),
        "kernel_shape": list(writer.kernels.shape),
        "extents": writer.extents.tolist(),
        "boundary": writer.boundary,
        "cval": writer.cval,
        "dtype": writer.dtype.name,
        "scale": writer.scale,
        "offset": writer.offset,
        "compression": writer.compression,
    }


def made(record: dict) -> dict:
    """How an output was made, from its `provenance` record (`volconv.output.made`)."""
    kernels = np.frombuffer(base64.b64decode(record["kernels"]), "<f4")
    return {
        "filter names": list(record["names"]),
        "bank": kernels.reshape(record["kernel_shape"]).astype(np.float32),
        "boundary": str(record["boundary"]),
        "cval": float(record["cval"]),
        "output dtype": str(record["dtype"]),
        "scale": float(record.get("scale", 1.0)),
        "offset": float(record.get("offset", 0.0)),
        "input": str(record.get("source_sha256", "")),
        "features": str(record.get("features", "[]")),
    }


def plain(value: object) -> object:
    """A value as JSON has it (arrays as lists, numpy scalars as numbers)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value
