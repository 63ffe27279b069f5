"""OME-Zarr (NGFF 0.5 on Zarr v3): every output of one input as one channel of an image, for
napari (napari-ome-zarr), Fiji, neuroglancer, ilastik, dask.

The image is the array ``0`` of the group at the path, with axes (c, z, y, x), or
(t, c, z, y, x) for a 4D input: NGFF puts x last, so ``image[c, z, y, x]`` is the output
``c`` at voxel (x, y, z). Units are the input's (millimeter; second for t), scale and
translation come from the affine (NGFF has no rotation: the full affine is kept among the
attributes), and ``omero`` names each channel. A chunk is one channel (and frame), whole z and
y, and a depth along x that divides the slab depth, so every slab fills whole chunks, written
once; zarr encodes them on its threads (every core). The group is made in the private folder
and renamed into place once its attributes say ``volconv.complete``. Beside the image, 1D
arrays ``x``, ``y``, ``z`` (mm), ``t`` (s) and ``c`` (the names) give xarray
(``engine="zarr"``) the world coordinates.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from volconv.errors import OutputError
from volconv.output.base import SlabWriter, _Slab
from volconv.output.codecs import _cores, _pool, turned
from volconv.output.hdf5 import MAX_CHUNK_BYTES
from volconv.output.provenance import made as made_from
from volconv.output.provenance import plain, provenance
from volconv.output.space import NGFF_UNITS
from volconv.output.stored import Lazy, PartialView, Stored

IMAGE = "0"  # the one resolution's array
NGFF = "0.5"


def _zarr():
    """zarr 3, or an OutputError that says what to install."""
    try:
        import zarr
        import zarr.codecs
    except ImportError:
        raise OutputError(
            "an OME-Zarr output needs zarr >= 3: pip install 'volconv[formats]'"
        ) from None
    if int(zarr.__version__.split(".")[0]) < 3:
        raise OutputError(
            f"an OME-Zarr output needs zarr >= 3 (Zarr v3, NGFF 0.5); this is zarr "
            f"{zarr.__version__}: pip install 'volconv[formats]'"
        )
    return zarr


def codec(name: str) -> list:
    """zarr's compressors for compression ``name``: none, gzip (gzip-N), zstd, blosc
    (lz4 with byte shuffle, as HDF5's blosc), lz4 (blosc's lz4 too)."""
    codecs = _zarr().codecs
    BloscCodec, GzipCodec, ZstdCodec = codecs.BloscCodec, codecs.GzipCodec, codecs.ZstdCodec

    if name == "none":
        return []
    if m := re.fullmatch(r"gzip(?:-([1-9]))?", name):
        return [GzipCodec(level=int(m[1] or 1))]
    if name == "zstd":
        return [ZstdCodec(level=1)]
    if name in ("blosc", "lz4"):
        return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]
    raise OutputError(
        f"compression {name!r}: an OME-Zarr output takes none, gzip, gzip-1 .. gzip-9, zstd, "
        "blosc or lz4"
    )


def _attributes(path: Path) -> dict:
    """The group's attributes, read from its ``zarr.json`` (no zarr import)."""
    with open(path / "zarr.json", "rb") as f:
        meta = json.loads(f.read())
    return meta.get("attributes", {}) if isinstance(meta, dict) else {}


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a folder holding an OME-Zarr group that volconv marked complete."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        record = _attributes(path).get("volconv", {})
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("complete") is True


def made(path: Path) -> dict:
    """How the complete output at ``path`` was made (`volconv.output.made`)."""
    return made_from(_attributes(path)["volconv"])


def read(path: Path) -> Stored:
    """The complete OME-Zarr output at ``path`` (`volconv.output.read`), through zarr."""
    zarr = _zarr()

    if not is_complete(path):
        raise OutputError(f"{path}: not a complete volconv output")
    group = zarr.open_group(str(path), mode="r")
    image = group[IMAGE]
    record = dict(group.attrs["volconv"])
    four_d = image.ndim == 5
    shape = image.shape[::-1][:3] + ((image.shape[0],) if four_d else ())

    def reader(i: int):
        def take(key: tuple[slice, ...]) -> np.ndarray:
            spatial = key[2::-1]  # (z, y, x)
            if four_d:
                return np.asarray(image[(key[3], i, *spatial)]).transpose(3, 2, 1, 0)
            return np.asarray(image[(i, *spatial)]).transpose(2, 1, 0)

        return take

    names = list(record["names"])
    outputs = [Lazy(shape, np.dtype(image.dtype), reader(i)) for i in range(len(names))]
    attrs = {k: v for k, v in record.items() if k != "kernels"}
    return Stored("zarr", path, names, outputs, tuple(record.get("voxel_size", (1, 1, 1))),
                  attrs, np.dtype(image.dtype), float(record.get("scale", 1.0)),
                  float(record.get("offset", 0.0)))  # fmt: skip


def _extent(values: np.ndarray) -> tuple[float, float]:
    """The smallest and largest value, NaN left out (fmin and fmax: no copy)."""
    return float(np.fmin.reduce(values, axis=None)), float(np.fmax.reduce(values, axis=None))


@contextmanager
def partial(
    temp: Path, st: os.stat_result, shape: tuple[int, ...], dtype: np.dtype
) -> Iterator[PartialView | None]:
    """The partial group ``temp`` (the folder ``st`` describes) as `volconv.run.resume` reads
    it back."""
    zarr = _zarr()

    named = os.lstat(temp)
    if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
        yield None
        return
    image = zarr.open_group(str(temp), mode="r")[IMAGE]
    four_d = len(shape) == 5
    expected = ((shape[4],) if four_d else ()) + (shape[0], shape[3], shape[2], shape[1])
    if image.shape != expected or np.dtype(image.dtype) != dtype:
        yield None
        return

    def rows(f: int, a: int, b: int, frame: int | None) -> np.ndarray:
        at = () if frame is None else (frame,)
        return np.asarray(image[(*at, f, slice(None), slice(None), slice(a, b))]).T

    yield PartialView(shape, dtype, rows)


class ZarrWriter(SlabWriter):
    """Writes the N outputs of one input as an OME-Zarr image (`SlabWriter`)."""

    format = "zarr"

    def _codec_for(self, compression: str) -> list:
        return codec(compression)

    def _open(self, resumed: bool) -> None:
        self._resuming = resumed
        if resumed:  # its chunks are whole as written: the group itself continues
            os.rename(self._killed, self.temp)
        else:
            os.mkdir(self.temp)  # exclusive, in the private folder; the umask decides its mode

    def _layout(self) -> None:
        zarr = _zarr()
        from zarr.storage import LocalStore

        n, (nx, ny, nz) = len(self.names), self.shape[:3]
        four_d = len(self.shape) == 4
        depth = min(self.slab_depth, nx)
        fits = max(1, MAX_CHUNK_BYTES // (ny * nz * self.dtype.itemsize))
        chunk_x = max(d for d in range(1, depth + 1) if depth % d == 0 and d <= fits)
        shape = ((self.shape[3],) if four_d else ()) + (n, nz, ny, nx)
        chunks = ((1,) if four_d else ()) + (1, nz, ny, chunk_x)
        store = LocalStore(str(self.temp))
        if self._resuming:
            self._group = zarr.open_group(store=store, mode="r+", zarr_format=3)
            self._image = self._group[IMAGE]
            if self._image.shape != shape or self._image.chunks != chunks:
                raise OutputError(f"{self.path}: the partial output has another layout")
        else:
            self._group = zarr.open_group(store=store, mode="w-", zarr_format=3)
            self._image = self._group.create_array(
                IMAGE, shape=shape, chunks=chunks, dtype=self.dtype,
                compressors=self.codec_list, fill_value=0,
                dimension_names=("t", "c", "z", "y", "x")[0 if four_d else 1 :],
            )  # fmt: skip
        self._low = np.full(n, np.inf)
        self._high = np.full(n, -np.inf)

    @property
    def codec_list(self) -> list:
        return self._codec

    def _resumed(self) -> None:
        """The slabs the resumed group holds, checked by `volconv.run.resume`, count as written;
        their values count in each channel's range."""
        for (frame, a), b in self.progress.done.items():
            at = (frame,) if len(self.shape) == 4 else ()
            values = np.asarray(self._image[(*at, slice(None), slice(None), slice(None),
                                             slice(a, b))])  # fmt: skip
            for i in range(len(self.names)):
                self._extend(i, values[i])
        self._written |= self._resumed_rows()

    def _extend(self, i: int, values: np.ndarray) -> None:
        low, high = _extent(values)
        self._low[i] = min(self._low[i], low)
        self._high[i] = max(self._high[i], high)

    def _prepare(self, a: int, b: int, frame: int | None, stored: np.ndarray) -> list:
        """Each output's range (omero's window), on the pool, beside the write."""

        n, d, ny, nz = stored.shape
        # the chunks' own order; one slab at a time (`in_flight` is 1), so one buffer
        self._turned = np.empty((n, nz, ny, d), stored.dtype)

        def turn(i: int) -> tuple[float, float]:
            turned(stored[i], self._turned[i])
            return _extent(stored[i])

        return [(i, _pool().submit(turn, i)) for i in range(n)]

    def _write(self, slab: _Slab) -> None:
        """The slab's whole chunks, (c, z, y, x) from (N, x, y, z), encoded on zarr's threads."""
        zarr = _zarr()

        at = () if slab.frame is None else (slab.frame,)
        # a slab's chunks encoded at once, on as many threads as there are cores
        with zarr.config.set({"async.concurrency": max(10, 2 * _cores())}):
            for i, done in slab.chunks:
                low, high = done.result()
                self._low[i] = min(self._low[i], low)
                self._high[i] = max(self._high[i], high)
            where = (*at, slice(None), slice(None), slice(None), slice(slab.a, slab.b))
            self._image[where] = self._turned
        self._turned = None

    def _commit(self, attrs: dict) -> None:
        """Coordinates for xarray, NGFF's metadata and volconv's record, ``complete`` in it."""
        coords = self.space.coordinates(self.shape)
        axes = list(zip("xyz", coords[:3], strict=True))
        if len(self.shape) == 4:
            axes.append(("t", coords[3]))
        for axis, values in axes:  # beside the image: xarray (engine="zarr") shows them
            coord = self._group.create_array(axis, data=values, dimension_names=(axis,),
                                             overwrite=True)  # fmt: skip
            coord.attrs["units"] = "s" if axis == "t" else "mm"
        names = self._group.create_array("c", shape=(len(self.names),), dtype=str,
                                         dimension_names=("c",), overwrite=True)  # fmt: skip
        names[:] = np.array(self.names, dtype=object)  # zarr's variable-length UTF-8
        self._group.attrs.update({
            "ome": self._ngff(),
            "volconv": {**provenance(self, attrs), "voxel_size": plain(self.space.voxel_size),
                        "complete": True},
        })  # fmt: skip

    def _ngff(self) -> dict:
        space = self.space
        four_d = len(self.shape) == 4
        unit = NGFF_UNITS.get(space.space_unit, "millimeter")
        origin, step = space.axes()  # mm
        factor = 1.0 if unit == "millimeter" else 1.0 / space.unit_mm
        spatial = [
            {"name": k, "type": "space", "unit": unit} for k in ("z", "y", "x")
        ]  # fmt: skip
        axes = [{"name": "c", "type": "channel"}, *spatial]
        scale = [1.0, *(abs(step[::-1]) * factor).tolist()]
        translation = [0.0, *(origin[::-1] * factor).tolist()]
        if four_d:
            time = {"name": "t", "type": "time"}
            if space.repetition_time:
                time["unit"] = "second"
            axes.insert(0, time)
            scale.insert(0, float(space.repetition_time or 1.0))
            translation.insert(0, 0.0)
        scale = [s if s > 0 else 1.0 for s in scale]
        channels = []
        for i, name in enumerate(self.names):
            low, high = float(self._low[i]), float(self._high[i])
            if not (np.isfinite(low) and np.isfinite(high)):
                low, high = 0.0, 1.0
            channels.append({
                "label": name, "color": "FFFFFF", "active": True,
                "window": {"min": low, "max": high, "start": low, "end": high},
            })  # fmt: skip
        return {
            "version": NGFF,
            "multiscales": [{
                "name": self.path.name,
                "axes": axes,
                "datasets": [{"path": IMAGE, "coordinateTransformations": [
                    {"type": "scale", "scale": scale},
                    {"type": "translation", "translation": translation},
                ]}],
            }],
            "omero": {"channels": channels},
        }  # fmt: skip


WRITER = ZarrWriter
