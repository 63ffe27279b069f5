"""The readers of the files nibabel loads (NIfTI-1/2, MINC, Analyze, MGH; a plain single-file
NIfTI-1 without nibabel) and of ``.npy`` files (memory-mapped): each opens a file into a
`volconv.run.volume.Volume` without reading its voxels.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from volconv.run.volume import (
    COMPRESSED,
    InputError,
    Volume,
    check_shape_type,
    check_size,
    make_volume,
    read_errors,
    squeeze_tail,
)

if TYPE_CHECKING:
    import nibabel as nib


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _is_hdf5(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE


def open_nibabel(path: str, file: Path) -> Volume:
    import nibabel as nib

    try:
        img = nib.load(file)
    except read_errors() as e:
        if _is_hdf5(file):  # MINC2 is HDF5: any other HDF5 file fails deep inside nibabel
            raise InputError(
                f"{path}: is an HDF5 file but not a MINC2 volume ({type(e).__name__}: "
                f"{' '.join(str(e).split())}); to read one of its datasets, give it an .h5 "
                "name and the input as file.h5:/dataset"
            ) from e
        raise
    proxy = img.dataobj
    shape, extra = squeeze_tail(img.shape)
    check_shape_type(path, shape, img.get_data_dtype())
    if isinstance(proxy, nib.arrayproxy.ArrayProxy) and isinstance(proxy.file_like, str):
        needed = proxy.offset + int(np.prod(proxy.shape)) * np.dtype(proxy.dtype).itemsize
        check_size(path, Path(proxy.file_like), needed)
    # scl_slope/inter make the proxy return floats: ask it for one voxel to learn which.
    dtype = np.asarray(proxy[(0,) * len(img.shape)]).dtype
    zooms = tuple(float(z) for z in img.header.get_zooms())
    axes = _minc_axes(path, img) if isinstance(img, nib.minc1.Minc1Image) else None
    if axes is not None:  # time first in the file: (x, y, z, t) for the pipeline
        shape = tuple(shape[a] for a in axes)
        zooms = tuple(zooms[a] for a in axes)
    mapped = (  # nibabel maps such a file: np.asarray(proxy) reads nothing until used
        isinstance(proxy, nib.arrayproxy.ArrayProxy)
        and isinstance(proxy.file_like, str)
        and Path(proxy.file_like).suffix.lower() not in COMPRESSED
        and getattr(proxy, "_mmap", False) is not False
        and dtype == np.dtype(proxy.dtype)
        and np.dtype(proxy.dtype).isnative
    )
    return make_volume(path, file, shape, dtype, img.affine, zooms[:3], lambda: nullcontext(proxy),
                   extra, axes, mapped, _unknown_zooms(img, zooms[:3]))  # fmt: skip


# NIfTI-1 datatype codes nibabel reads as these types (bool and complex: nibabel's path).
_NIFTI_TYPES = {2: "u1", 4: "i2", 8: "i4", 16: "f4", 64: "f8", 256: "i1", 512: "u2",
                768: "u4", 1024: "i8", 1280: "u8"}  # fmt: skip


# The 348-byte header and the 4 bytes after it (nonzero: extensions follow), native order.
_NIFTI_FIELDS = [
    ("sizeof_hdr", "i4"), ("_1", "V36"), ("dim", "i2", 8), ("_2", "V14"), ("datatype", "i2"),
    ("bitpix", "i2"), ("_3", "V2"), ("pixdim", "f4", 8), ("vox_offset", "f4"),
    ("scl_slope", "f4"), ("scl_inter", "f4"), ("_4", "V3"), ("xyzt_units", "u1"),
    ("_5", "V128"), ("qform_code", "i2"),
    ("sform_code", "i2"), ("_6", "V24"), ("srow", "f4", (3, 4)), ("_7", "V16"),
    ("magic", "S4"), ("ext", "u1", 4),
]  # fmt: skip


def open_plain_nifti(path: str, file: Path) -> Volume | None:
    """A plain single-file NIfTI-1 (``.nii``) read without nibabel (whose import costs more
    than the rest of a small run's start), or None where nibabel must read it: the volume
    is the one nibabel gives for such a file, which this accepts only where nibabel would
    fix nothing in the header and scale nothing (a scl_slope of 0, NaN or 1 with scl_inter
    0): native byte order (sizeof_hdr reads 348), no extensions, 3D or 4D, a known integer
    or float type, positive voxel sizes, an sform (a qform, or no transform, is nibabel's),
    the data after the header."""
    header = np.dtype(_NIFTI_FIELDS)
    with open(file, "rb") as f:
        raw = f.read(header.itemsize)
    if len(raw) < header.itemsize:
        return None
    h = np.frombuffer(raw, header)[0]
    ndim = int(h["dim"][0])
    dtype = _NIFTI_TYPES.get(int(h["datatype"]))
    offset = float(h["vox_offset"])
    slope = float(h["scl_slope"])
    unscaled = slope == 0 or not math.isfinite(slope) or (slope, float(h["scl_inter"])) == (1, 0)
    pixdim = h["pixdim"]
    if not (
        h["sizeof_hdr"] == 348 and h["magic"] == b"n+1" and not h["ext"][0]
        and ndim in (3, 4) and min(h["dim"][1 : ndim + 1]) >= 1 and dtype is not None
        and h["bitpix"] == 8 * np.dtype(dtype).itemsize and pixdim[0] in (-1, 1)
        and all(math.isfinite(v) and v > 0 for v in pixdim[1 : ndim + 1])
        and 352 <= offset == int(offset) and unscaled
        and 0 < h["sform_code"] <= 4 and 0 <= h["qform_code"] <= 4  # codes every nibabel knows
    ):  # fmt: skip
        return None
    shape = tuple(int(n) for n in h["dim"][1 : ndim + 1])
    check_size(path, file, int(offset) + math.prod(shape) * np.dtype(dtype).itemsize)
    affine = np.eye(4)
    affine[:3] = h["srow"]

    def opener() -> AbstractContextManager:  # a fresh map per read, as for a .npy
        return nullcontext(_NiftiData(np.memmap(file, dtype, "c", int(offset), shape, order="F")))

    volume = make_volume(path, file, shape, np.dtype(dtype), affine,
                     tuple(float(v) for v in pixdim[1:4]), opener, 0, mapped=True)  # fmt: skip
    units = int(h["xyzt_units"])
    if h["qform_code"] == 0 and units % 8 in _UNITS and units - units % 8 in _UNITS:
        volume.nifti_header = _PlainHeader(h, ndim)
    return volume


# NIfTI's unit codes, as nibabel names them.
_UNITS = {0: "unknown", 1: "meter", 2: "mm", 3: "micron", 8: "sec", 16: "msec", 24: "usec",
          32: "hz", 40: "ppm", 48: "rads"}  # fmt: skip


class _PlainHeader:
    """What `volconv.output.space` reads of a NIfTI header, as nibabel's gives it, for a
    plain NIfTI-1 (`open_plain_nifti`) without a qform."""

    def __init__(self, h: np.void, ndim: int) -> None:
        self._h, self._ndim = h, ndim

    def get_sform(self, coded: bool = False) -> Any:
        out = np.eye(4)
        out[:3] = self._h["srow"]
        return (out, int(self._h["sform_code"])) if coded else out

    def get_qform(self, coded: bool = True) -> tuple[None, int]:
        if not coded:  # the matrix of a qform code 0 is nibabel's to make
            raise NotImplementedError("only get_qform(coded=True)")
        return None, 0

    def get_xyzt_units(self) -> tuple[str, str]:
        code = int(self._h["xyzt_units"])
        return _UNITS[code % 8], _UNITS[code - code % 8]

    def get_zooms(self) -> tuple[np.float32, ...]:
        return tuple(self._h["pixdim"][1 : self._ndim + 1])


class _NiftiData:
    """Slices as nibabel's proxy does: the whole volume as the memory map itself (read as
    used), any part of it as an array of its own."""

    def __init__(self, mapped: np.memmap) -> None:
        self._mapped = mapped

    def __getitem__(self, index: Any) -> np.ndarray:
        if index is Ellipsis:
            return self._mapped
        return np.array(self._mapped[index])


def _unknown_zooms(img: Any, zooms: tuple[float, ...]) -> str:
    """Why the header gives no voxel size ("" where it does). nibabel replaces a NIfTI or
    Analyze pixdim of 0 by 1 on loading (with a log line only): the raw header decides."""
    raw = zooms
    header = img.header
    if "pixdim" in getattr(header, "keys", lambda: ())():
        import nibabel as nib

        try:
            holder = img.file_map.get("header") or img.file_map["image"]  # .hdr, or .nii
            with nib.openers.ImageOpener(holder.filename) as f:
                unchecked = type(header).from_fileobj(f, check=False)
            raw = tuple(float(v) for v in unchecked["pixdim"][1:4])
        except (OSError, ValueError, KeyError, EOFError):
            pass
    if len(raw) == 3 and all(math.isfinite(v) and v != 0 for v in raw):
        return ""  # a negative pixdim is a sign nibabel drops, not a missing size
    return f"its header's voxel size is {' x '.join(f'{v:g}' for v in raw)}"


def _minc_axes(path: str, img: nib.minc1.Minc1Image) -> tuple[int, ...] | None:
    """For a 4D MINC file (MINC2 derives from MINC1 in nibabel) whose time axis is not the
    last: the file's axes as (three spatial ones in the file's order, time). nibabel's
    affine maps the spatial axes in that order already. The dimension names decide."""
    if len(img.shape) != 4:
        return None
    minc = getattr(img.dataobj, "minc_file", None)
    names = [str(n) for n in getattr(minc, "_dim_names", None) or ()]
    spatial = [str(n) for n in getattr(minc, "_spatial_dims", None) or ()]
    other = [i for i, n in enumerate(names) if n not in spatial]
    if len(names) != 4 or len(spatial) != 3 or len(other) != 1 or names[other[0]] != "time":
        raise InputError(
            f"{path}: a 4D MINC volume needs three spatial dimensions and time; its "
            f"dimensions are {', '.join(names) or 'not named'}"
        )
    t = other[0]
    return None if t == 3 else (*(i for i in range(4) if i != t), t)


def open_npy(path: str, file: Path) -> Volume:
    with open(file, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major in (1, 2):  # 3 (UTF-8 field names) is rare: reading tells
            read = (np.lib.format.read_array_header_1_0 if major == 1
                    else np.lib.format.read_array_header_2_0)  # fmt: skip
            shape, _, dtype = read(f)
            if not dtype.hasobject:  # refused below, without reading
                check_size(path, file, f.tell() + int(np.prod(shape)) * dtype.itemsize)
    arr = np.load(file, mmap_mode="r", allow_pickle=False)
    shape, extra = squeeze_tail(arr.shape)
    check_shape_type(path, shape, arr.dtype)
    # A fresh memory map per read, so no mapping outlives the slab that needed it.
    opener = lambda: nullcontext(np.load(file, mmap_mode="r"))  # noqa: E731
    return make_volume(path, file, shape, arr.dtype, np.eye(4), None, opener, extra,
                   mapped=arr.dtype.isnative,
                   voxel_unknown="a .npy file records no voxel size")  # fmt: skip
