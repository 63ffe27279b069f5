"""NIfTI: every output of one input as one NIfTI-1 file, for FSL, ANTs, FSLeyes, nilearn, SPM.

A 3D input gives a 4D file (x, y, z, outputs), a 4D input a 5D one (x, y, z, t, outputs), with
the input's sform and qform (and their codes), units, voxel size and repetition time. The
output names go in the header's ``descrip`` (as far as its 80 bytes reach) and, with the
provenance, in a BIDS-style JSON sidecar beside the file (``NAME.json``).

NIfTI data is x-fastest: a slab (rows [a, b) along x) is a run of ``b - a`` values in every
line of every output volume. The slabs are copied (on every core) into a shared mapping of an
uncompressed file in the private folder, at their places, so the file is written as the run
goes and the operating system writes it out; ``.nii`` is that file, its header written last.
``.nii.gz`` is compressed from it at the end, on every core, as independent gzip members one
after the other: a single file that every gzip reader (nibabel, FSL, ANTs, zcat) reads whole.
Then the sidecar and the file are renamed into place; the sidecar records the file's size and
a run id that the header's ``aux_file`` repeats, so a sidecar never vouches for another file.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import mmap
import os
import re
import secrets
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from volconv.errors import OutputError
from volconv.output.base import SlabWriter, _Slab
from volconv.output.codecs import _cores, _pool, turned
from volconv.output.provenance import made as made_from
from volconv.output.provenance import plain, provenance
from volconv.output.staging import is_regular
from volconv.output.stored import Lazy, PartialView, Stored

HEADER_BYTES = 352  # NIfTI-1's 348 bytes and the 4 that say no extension follows
# A member of a .nii.gz: large enough that its gzip header and the restart of the deflate
# window cost nothing measurable, small enough that every core gets several.
MEMBER_BYTES = 4 * 2**20
_CODES = {"float32": 16, "uint8": 2}  # NIfTI-1 datatype codes; NIfTI-1 has no float16


def check_beside(path: Path) -> None:
    """Refuse an output whose sidecar's name holds a file that is not volconv's (never
    replaced): checked while planning, before any work, and again when the writer opens."""
    beside = sidecar(path)
    if os.path.lexists(beside) and _volconv(path) is None:
        raise OutputError(
            f"{beside}: exists and is not a volconv sidecar; volconv never replaces it "
            "(the NIfTI output's names and provenance go there): move it or name the "
            "output otherwise"
        )


def sidecar(path: Path) -> Path:
    """The JSON beside a NIfTI output: ``a.nii.gz`` -> ``a.json`` (as BIDS names them)."""
    name = re.sub(r"\.nii(\.gz)?$", "", path.name, flags=re.IGNORECASE)
    return path.with_name(name + ".json")


def codec(name: str) -> int | None:
    """The gzip level a NIfTI output is compressed with for compression ``name``: None for
    ``none``, 1 for ``gzip``, N for ``gzip-N``; whether it is compressed at all is the path's
    suffix (``.nii.gz``)."""
    if name == "none":
        return None
    if m := re.fullmatch(r"gzip(?:-([1-9]))?", name):
        return int(m[1] or 1)
    raise OutputError(
        f"compression {name!r}: a NIfTI output is compressed with gzip only (a .nii.gz path; "
        "none, gzip, gzip-1 .. gzip-9)"
    )


def _volconv(path: Path) -> dict | None:
    """The sidecar's ``volconv`` record, or None where there is no volconv sidecar."""
    try:
        with open(sidecar(path), "rb") as f:
            record = json.loads(f.read()).get("volconv")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def _header(path: Path) -> bytes:
    """The first 348 bytes of a NIfTI file (decompressed for .nii.gz)."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read(348)


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a NIfTI file that its volconv sidecar says is complete: the size
    and the run id (the header's ``aux_file``) the sidecar records are the file's."""
    if not is_regular(path):
        return False
    record = _volconv(path)
    if not record or record.get("complete") is not True:
        return False
    try:
        if os.stat(path).st_size != record.get("bytes"):
            return False
        aux = _header(path)[228:252].rstrip(b"\x00").decode("ascii", "replace")
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    return aux == record.get("run")


def _dims(n: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The volumes' shape in C order, (N, [t,] z, y, x): NIfTI's (x, y, z, [t,] N)."""
    frames = (shape[3],) if len(shape) == 4 else ()
    return (n, *frames, shape[2], shape[1], shape[0])


@contextmanager
def partial(
    temp: Path, st: os.stat_result, shape: tuple[int, ...], dtype: np.dtype
) -> Iterator[PartialView | None]:
    """The uncompressed partial file ``temp`` (the file ``st`` describes, of the size
    ``shape`` and ``dtype`` make) as `volconv.run.resume` reads it back."""
    dims = _dims(shape[0], shape[1:])
    named = os.lstat(temp)
    size = HEADER_BYTES + int(np.prod(dims)) * dtype.itemsize
    if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino) or named.st_size != size:
        yield None
        return
    volumes = np.memmap(temp, dtype.newbyteorder("<"), "r", HEADER_BYTES, dims)

    def rows(f: int, a: int, b: int, frame: int | None) -> np.ndarray:
        at = () if frame is None else (frame,)
        return volumes[(f, *at, slice(None), slice(None), slice(a, b))].T.astype(dtype)

    yield PartialView(shape, dtype, rows)


def made(path: Path) -> dict:
    """How the complete output at ``path`` was made (`volconv.output.made`)."""
    record = _volconv(path)
    if not record:
        raise KeyError(f"{sidecar(path)}: no volconv record")
    return made_from(record)


def read(path: Path) -> Stored:
    """The complete NIfTI output at ``path`` (`volconv.output.read`), through nibabel."""
    import nibabel as nib

    if not is_complete(path):
        raise OutputError(f"{path}: not a complete volconv output")
    record = _volconv(path) or {}
    img = nib.load(path)
    proxy = img.dataobj

    def reader(i: int):
        # nibabel reads only what the key takes and applies scl_slope and scl_inter
        return lambda key: np.asarray(proxy[(*key, slice(i, i + 1))])[..., 0]

    names = list(record.get("names", []))
    dtype = np.dtype(img.get_data_dtype() if record.get("dtype") != "uint8" else np.float32)
    outputs = [Lazy(tuple(img.shape[:-1]), dtype, reader(i)) for i in range(len(names))]
    attrs = {k: v for k, v in record.items() if k != "kernels"}
    # values as nibabel gives them: uint8 already decoded (scale 1, offset 0 here)
    return Stored("nifti", path, names, outputs,
                  tuple(float(z) for z in img.header.get_zooms()[:3]), attrs, dtype)  # fmt: skip


class NiftiWriter(SlabWriter):
    """Writes the N outputs of one input as one NIfTI-1 file (`SlabWriter`): ``.nii``, or
    ``.nii.gz`` compressed at the end on every core; float32 or uint8 (scl_slope and
    scl_inter hold scale and offset, so nibabel returns the values they stand for)."""

    format = "nifti"

    def _codec_for(self, compression: str) -> int | None:
        level = codec(compression)
        self._gz = self.path.name.lower().endswith(".gz")
        if level is not None and not self._gz:
            raise OutputError(
                f"{self.path}: compression {compression!r} needs a .nii.gz path (.nii is "
                "uncompressed)"
            )
        return (level or 1) if self._gz else None

    def _check_path(self, overwrite: bool) -> None:
        check_beside(self.path)
        super()._check_path(overwrite)

    def _open(self, resumed: bool) -> None:
        if self.dtype.name not in _CODES:
            raise OutputError(
                f"{self.path}: NIfTI stores float32 or uint8, not {self.dtype.name}; set "
                "output.dtype or write HDF5 or OME-Zarr"
            )
        # The uncompressed file is the partial output (`volconv.run.resume` reads it back under
        # the output's name); a .nii.gz is compressed from it into `temp` at the end.
        self._raw = self.temp
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        if resumed:  # its bytes are plain values: the file itself continues
            os.rename(self._killed, self._raw)
            self._fd = os.open(self._raw, flags)
        else:
            # 0666 less the umask, as h5py makes a file
            self._fd = os.open(self._raw, flags | os.O_CREAT | os.O_EXCL, 0o666)
        if self._gz:
            self.temp = self._folder / f"compressed-{self.path.name}"
            if resumed:  # the claimed run's own, in the private folder: made afresh
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.temp)
            os.close(os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        self.run_id = secrets.token_hex(8)

    def _layout(self) -> None:
        """The file's size, and the volumes as a shared mapping: (N, [t,] z, y, x) in C order
        is NIfTI's (x, y, z, [t,] N) in Fortran order."""
        self._dims = _dims(len(self.names), self.shape)
        data_bytes = int(np.prod(self._dims)) * self.dtype.itemsize
        # The blocks are reserved first: a full disk is an error here, where writing to a
        # mapping of a sparse file would kill the process (SIGBUS).
        os.posix_fallocate(self._fd, 0, HEADER_BYTES + data_bytes)
        self._map = mmap.mmap(self._fd, HEADER_BYTES + data_bytes)
        self._volumes = np.ndarray(self._dims, self.dtype.newbyteorder("<"), self._map,
                                   HEADER_BYTES)  # fmt: skip

    def _resumed(self) -> None:
        """The rows the resumed file holds, checked by `volconv.run.resume`, count as written."""
        self._written |= self._resumed_rows()

    def _prepare(
        self, a: int, b: int, frame: int | None, stored: np.ndarray
    ) -> list[tuple[int, Future]]:
        """Each output's rows copied to their places in the mapping, on the pool (a strided
        copy: the slab's values are a run of ``b - a`` in every line)."""
        at = () if frame is None else (frame,)

        def copy(i: int) -> None:
            turned(stored[i], self._volumes[(i, *at, slice(None), slice(None), slice(a, b))])

        return [(i, _pool().submit(copy, i)) for i in range(stored.shape[0])]

    def _write(self, slab: _Slab) -> None:
        for _, done in slab.chunks:
            done.result()

    # -- finishing ---------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every slab, then write the header and, for .nii.gz, compress: the file's
        writing ends here (a run's wall time covers it); `finish` adds the sidecar."""
        super().drain()
        if self.space is not None:  # else the header waits for finish's affine
            self._seal()

    def _seal(self) -> None:
        """The header, then for .nii.gz the compressed file; the raw file closed."""
        if self._fd is None:
            return
        try:
            self._write_out()
        except OSError as e:  # no room for the .nii.gz, an I/O error
            self._stop = True
            raise self._write_error(e) from e

    def _write_out(self) -> None:
        self._map[:HEADER_BYTES] = self._header_bytes()
        self._volumes = None  # no msync: the operating system writes the pages, as for HDF5
        self._map.close()
        if self._gz:
            compress(self._fd, self.temp, self._level)
        os.close(self._fd)
        self._fd = None
        if self._gz:
            os.unlink(self._raw)

    def _commit(self, attrs: dict) -> None:
        """The file sealed (`drain`), the sidecar beside it."""
        self._seal()
        size = os.stat(self.temp).st_size
        self._sidecar = self._folder / sidecar(self.path).name
        with open(self._sidecar, "x", encoding="utf-8") as f:
            json.dump(self._sidecar_record(attrs, size), f, indent=1, default=plain)

    @property
    def _level(self) -> int:
        return int(self._codec)

    def _header_bytes(self) -> bytes:
        import nibabel as nib

        space = self.space
        header = nib.Nifti1Header()
        header.set_data_dtype(self.dtype)
        header.set_data_shape(self._dims[::-1])
        if space.qform is not None:
            header.set_qform(space.qform, int(space.qform_code))
        else:
            header.set_qform(space.affine, 0)
        header.set_sform(space.sform, int(space.sform_code))
        zooms = [*space.voxel_size]
        if len(self.shape) == 4:
            zooms.append(_time_zoom(space))
        zooms.append(1.0)
        header.set_zooms(zooms)
        header.set_xyzt_units(
            space.space_unit if space.space_unit != "unknown" else 0,
            space.time_unit if len(self.shape) == 4 and space.time_unit != "unknown" else 0,
        )
        if self.dtype == np.uint8:
            header.set_slope_inter(self.scale, self.offset)
        header["descrip"] = ("volconv: " + ", ".join(self.names)).encode()[:79]
        header["aux_file"] = self.run_id.encode()
        header["vox_offset"] = HEADER_BYTES
        return header.binaryblock + b"\x00" * (HEADER_BYTES - 348)

    def _sidecar_record(self, attrs: dict, size: int) -> dict:
        """BIDS-style names (``Description``, ``RepetitionTime``) and volconv's record."""
        record: dict = {
            "Description": "volconv outputs, one volume each along the last axis: "
            + ", ".join(self.names),
            "VolumeNames": self.names,
            "Dimensions": ["x", "y", "z", *(["t"] if len(self.shape) == 4 else []), "output"],
            "Sources": [str(attrs.get("source", ""))],
        }
        if len(self.shape) == 4 and self.space.repetition_time:
            record["RepetitionTime"] = self.space.repetition_time
        record["volconv"] = {
            **provenance(self, attrs),
            "file": self.path.name,
            "bytes": size,
            "run": self.run_id,
            "complete": True,
        }
        return record

    def _rename_beside(self) -> None:
        os.replace(self._sidecar, sidecar(self.path))  # first: the file is the mark

    def _close_discarded(self) -> None:
        self._volumes = None
        if getattr(self, "_map", None) is not None and not self._map.closed:
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


def _time_zoom(space) -> float:
    """pixdim[4] as the input's header has it (its own time unit)."""
    from volconv.output.space import TIME_UNITS

    if space.repetition_time is None:
        return 1.0
    return space.repetition_time / TIME_UNITS.get(space.time_unit, 1.0)


def compress(fd: int, target: Path, level: int) -> None:
    """gzip the file at ``fd`` into ``target`` as independent members of `MEMBER_BYTES`,
    compressed on every core (zlib lets go of the GIL) and written in order, one per core and
    one more in memory (each a copy of its data and its compressed bytes)."""
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as source, open(target, "wb") as out:
        pending: deque[Future[bytes]] = deque()
        for start in range(0, size, MEMBER_BYTES):
            block = source[start : start + MEMBER_BYTES]  # a copy: the map closes after
            pending.append(_pool().submit(gzip.compress, block, level, mtime=0))
            while len(pending) > _cores():
                out.write(pending.popleft().result())
        while pending:
            out.write(pending.popleft().result())


WRITER = NiftiWriter
