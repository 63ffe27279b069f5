"""The read stage: every input format gives the oracle's voxels, row by row, and every bad
input an `InputError` that names the file."""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

import h5py
import nibabel as nib
import numpy as np
import pytest
from conftest import assert_spec_close, reference

from volconv.engines.direct import convolve_bank
from volconv.run.inputs import expand_inputs, open_volume
from volconv.run.volume import InputError

SHAPE = (9, 7, 5)
AFFINE = np.diag([1.5, 2.0, 3.0, 1.0])
# Rows in runs and out of order, as reflect boundaries and slabs ask for them.
ROWS = np.array([2, 1, 0, 0, 1, 2, 3, 4, 7, 8])


def volume(shape: tuple[int, ...] = SHAPE, dtype: str = "int16") -> np.ndarray:
    """Distinct, signed values, so a misplaced row or a byte swap shows."""
    return (np.arange(np.prod(shape)).reshape(shape) * 7 % 1000 - 300).astype(dtype)


def save_nifti(cls: type, path: Path, data: np.ndarray, endianness: str = "<") -> Path:
    header = cls.header_class(endianness=endianness)
    img = cls(data, AFFINE, header=header)
    img.set_data_dtype(data.dtype.newbyteorder(endianness))
    nib.save(img, path)
    return path


def save_scaled(path: Path, data: np.ndarray) -> Path:
    img = nib.Nifti1Image(data, AFFINE)
    img.header.set_slope_inter(0.25, -3.0)
    nib.save(img, path)
    return path


def save_h5(path: Path, name: str, data: np.ndarray, **attrs: object) -> Path:
    with h5py.File(path, "a") as f:
        f.create_dataset(name, data=data)
        f[name].attrs.update(attrs)
    return path


# (file name, writer, spec suffix); every writer stores `volume()` (4D where the name says).
FORMATS = {
    "nifti1": ("a.nii", lambda p, v: save_nifti(nib.Nifti1Image, p, v), ""),
    "nifti1-gz": ("a.nii.gz", lambda p, v: save_nifti(nib.Nifti1Image, p, v), ""),
    "nifti2": ("a.nii", lambda p, v: save_nifti(nib.Nifti2Image, p, v), ""),
    "nifti2-gz": ("a.nii.gz", lambda p, v: save_nifti(nib.Nifti2Image, p, v), ""),
    "nifti1-big-endian": ("a.nii", lambda p, v: save_nifti(nib.Nifti1Image, p, v, ">"), ""),
    "nifti1-scaled": ("a.nii", save_scaled, ""),
    "analyze": ("a.img", lambda p, v: nib.save(nib.AnalyzeImage(v, AFFINE), p), ""),
    "mgh": ("a.mgz", lambda p, v: nib.save(nib.MGHImage(v.astype(np.float32), AFFINE), p), ""),
    "npy": ("a.npy", lambda p, v: np.save(p, v), ""),
    "npy-big-endian-fortran": ("a.npy", lambda p, v: np.save(p, np.asfortranarray(v, ">i2")), ""),
    "hdf5": ("a.h5", lambda p, v: save_h5(p, "data", v), ":/data"),
    "hdf5-no-slash": ("a.h5", lambda p, v: save_h5(p, "data", v), ":data"),
    "hdf5-group": ("a.hdf5", lambda p, v: save_h5(p, "g/vol", v.astype(">f4")), ":/g/vol"),
}


def oracle(file: Path, spec: str) -> np.ndarray:
    """The voxels docs/contract.md filters: nibabel's get_fdata, numpy.load, or the HDF5 dataset."""
    if spec.endswith(".npy"):
        return np.load(file)
    if ":" in spec:
        with h5py.File(file) as f:
            return f[spec.split(":", 1)[1]][()]
    return nib.load(file).get_fdata()


@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_read_rows_equal_the_oracles_rows(tmp_path: Path, fmt: str, ndim: int) -> None:
    name, save, suffix = FORMATS[fmt]
    shape = SHAPE if ndim == 3 else (*SHAPE, 3)
    file = tmp_path / "scans" / name
    file.parent.mkdir()
    save(file, volume(shape))
    spec = f"{file}{suffix}"
    full = oracle(file, spec)

    vol = open_volume(spec)
    assert vol.path == spec
    assert vol.shape == shape and vol.n_frames == (1 if ndim == 3 else 3)
    assert vol.dtype.isnative and vol.dtype.kind in "iuf"
    assert (vol.stem, vol.parent) == ("a", "scans")
    for t in range(vol.n_frames):
        rows = vol.read_rows(ROWS, frame=t)
        assert rows.dtype == vol.dtype and rows.dtype.isnative
        expected = full[ROWS] if ndim == 3 else full[ROWS, ..., t]
        np.testing.assert_array_equal(rows, expected)
    assert vol.read_rows(np.arange(SHAPE[0])).shape == SHAPE


def test_scaled_nifti_reads_as_get_fdata(tmp_path: Path) -> None:
    file = save_scaled(tmp_path / "s.nii", volume())
    vol = open_volume(file)
    assert vol.dtype == np.float64  # what nibabel's scaling gives, exactly get_fdata's values
    np.testing.assert_array_equal(vol.read_rows(ROWS), nib.load(file).get_fdata()[ROWS])


def test_geometry_and_checksum(tmp_path: Path) -> None:
    nii = save_nifti(nib.Nifti1Image, tmp_path / "sub-01_T1w.nii.gz", volume())
    vol = open_volume(nii)
    assert vol.stem == "sub-01_T1w" and vol.parent == tmp_path.name
    np.testing.assert_array_equal(vol.affine, AFFINE)
    assert vol.voxel_size == (1.5, 2.0, 3.0)
    assert vol.sha256() == hashlib.sha256(nii.read_bytes()).hexdigest()

    h5 = save_h5(tmp_path / "scan.v2.h5", "data", volume(), affine=AFFINE)
    vol = open_volume(f"{h5}:/data")
    assert vol.stem == "scan.v2"
    np.testing.assert_array_equal(vol.affine, AFFINE)
    assert vol.voxel_size == (1.5, 2.0, 3.0)
    assert vol.sha256() == hashlib.sha256(h5.read_bytes()).hexdigest()

    npy = tmp_path / "plain.npy"
    np.save(npy, volume())
    vol = open_volume(npy)
    np.testing.assert_array_equal(vol.affine, np.eye(4))
    assert vol.voxel_size == (1.0, 1.0, 1.0)


def test_trailing_unit_axes_beyond_the_fourth_are_dropped(tmp_path: Path) -> None:
    data = volume((*SHAPE, 2, 1))
    file = tmp_path / "five.npy"
    np.save(file, data)
    vol = open_volume(file)
    assert vol.shape == (*SHAPE, 2) and vol.n_frames == 2
    np.testing.assert_array_equal(vol.read_rows(ROWS, frame=1), data[ROWS, :, :, 1, 0])


def bad_inputs(tmp: Path) -> dict[str, tuple[str, str]]:
    """Each bad input: (spec, a fragment of the message besides the file name)."""
    np.save(tmp / "flat.npy", np.zeros((4, 4)))
    np.save(tmp / "five.npy", np.zeros((2, 2, 2, 2, 2)))
    np.save(tmp / "empty.npy", np.zeros((0, 4, 4)))
    np.save(tmp / "complex.npy", np.zeros((2, 2, 2), complex))
    np.save(tmp / "bool.npy", np.zeros((2, 2, 2), bool))
    np.save(tmp / "objects.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    nib.save(nib.Nifti1Image(np.zeros((4, 4), np.int16), np.eye(4)), tmp / "flat.nii")
    (tmp / "text.nii").write_text("not a NIfTI file")
    (tmp / "notes.txt").write_text("hello")
    (tmp / "folder.nii").mkdir()
    save_h5(tmp / "f.h5", "data", volume())
    save_h5(tmp / "f.h5", "labels", np.zeros((2, 2, 2), bool))
    (tmp / "broken.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    return {
        "missing": (str(tmp / "absent.nii.gz"), "no such file"),
        "missing-h5": (f"{tmp / 'absent.h5'}:/data", "no such file"),
        "folder": (str(tmp / "folder.nii"), "folder"),
        "2D": (str(tmp / "flat.npy"), "3D or 4D"),
        "2D-nifti": (str(tmp / "flat.nii"), "3D or 4D"),
        "5D": (str(tmp / "five.npy"), "3D or 4D"),
        "empty": (str(tmp / "empty.npy"), "empty"),
        "complex": (str(tmp / "complex.npy"), "complex128"),
        "bool": (str(tmp / "bool.npy"), "bool"),
        "objects": (str(tmp / "objects.npy"), "cannot read"),
        "not-a-nifti": (str(tmp / "text.nii"), "cannot read"),
        "unknown-format": (str(tmp / "notes.txt"), "cannot read"),
        "h5-missing-dataset": (f"{tmp / 'f.h5'}:/volume", "/data, /labels"),
        "h5-no-dataset": (str(tmp / "f.h5"), "/data, /labels"),
        "h5-bool": (f"{tmp / 'f.h5'}:/labels", "bool"),
        "h5-broken": (f"{tmp / 'broken.h5'}:/data", "cannot read"),
    }


BAD = [
    "missing", "missing-h5", "folder", "2D", "2D-nifti", "5D", "empty", "complex", "bool",
    "objects", "not-a-nifti", "unknown-format", "h5-missing-dataset", "h5-no-dataset",
    "h5-bool", "h5-broken",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_name_the_file(tmp_path: Path, case: str) -> None:
    spec, fragment = bad_inputs(tmp_path)[case]
    with pytest.raises(InputError) as info:
        open_volume(spec)
    message = str(info.value)
    assert Path(spec.split(".h5:")[0]).name in message and fragment in message, message


def cut(file: Path, keep: float = 0.6) -> None:
    """Truncate ``file`` to ``keep`` of its bytes, as an interrupted copy leaves it."""
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def regzip(file: Path, transform) -> None:
    """Rewrite a gzip file's uncompressed content with ``transform(content) -> bytes``."""
    file.write_bytes(gzip.compress(transform(gzip.decompress(file.read_bytes()))))


TRUNCATED = {
    "nii": ("cut.nii", lambda p: cut(save_nifti(nib.Nifti1Image, p, volume((40, 30, 20))))),
    "nii.gz stream cut": (
        "cut.nii.gz",
        lambda p: cut(save_nifti(nib.Nifti1Image, p, volume((40, 30, 20)))),
    ),
    "nii.gz whole stream of half the data": (
        "cut.nii.gz",
        lambda p: regzip(
            save_nifti(nib.Nifti1Image, p, volume((40, 30, 20))),
            lambda d: d[: len(d) // 2],
        ),
    ),
    "nifti pair img": (
        "cut.img",
        lambda p: (nib.save(nib.Nifti1Pair(volume((40, 30, 20)), AFFINE), p), cut(p)),
    ),
    "mgz": (
        "cut.mgz",
        lambda p: (
            nib.save(nib.MGHImage(volume((40, 30, 20)).astype(np.float32), AFFINE), p),
            cut(p, 0.9),
        ),
    ),
    "npy": ("cut.npy", lambda p: (np.save(p, volume((40, 30, 20))), cut(p))),
    "h5 contiguous": (
        "cut.h5:/v",
        lambda p: (save_h5(p, "v", volume((40, 30, 20))), cut(p, 0.9)),
    ),
    "h5 chunked": (
        "cut.h5:/v",
        lambda p: (
            h5py.File(p, "w")
            .create_dataset("v", data=volume((40, 30, 20)), chunks=(4, 30, 20))
            .file.close(),
            cut(p, 0.9),
        ),
    ),
}


@pytest.mark.parametrize("case", TRUNCATED)
def test_truncated_data_is_refused_on_open_naming_the_file(tmp_path: Path, case: str) -> None:
    """What `validate` and `run` meet before any work: opening checks the data is there."""
    name, make = TRUNCATED[case]
    make(tmp_path / name.split(":")[0])
    # nibabel reads an MGH file's footer on load, HDF5 compares the end its superblock
    # records with the file's: their readers say so first.
    said = r"(the file is truncated: \d+ of|cannot read it \((EOFError|OSError: .*truncated))"
    with pytest.raises(InputError, match=rf"cut\.[a-z.0-9]+(:/v)?: {said}"):
        open_volume(tmp_path / name)


def test_gzip_with_several_members_or_a_trailer_is_whole(tmp_path: Path) -> None:
    """The gzip trailer's size differs from the data's here, yet all the data is there."""
    data = volume((40, 30, 20))
    file = save_nifti(nib.Nifti1Image, tmp_path / "two.nii.gz", data)
    whole = gzip.decompress(file.read_bytes())
    file.write_bytes(gzip.compress(whole[:5000]) + gzip.compress(whole[5000:]))  # pigz -i
    np.testing.assert_array_equal(open_volume(file).read_rows(np.arange(40)), data)
    regzip(file, lambda d: d + b"extra bytes after the data")
    np.testing.assert_array_equal(open_volume(file).read_rows(np.arange(40)), data)


def test_sha256_checks_the_crc_and_size_of_every_gzip_member(tmp_path: Path) -> None:
    data = volume((40, 30, 20))
    file = save_nifti(nib.Nifti1Image, tmp_path / "v.nii.gz", data)
    whole = gzip.decompress(file.read_bytes())
    sound = gzip.compress(whole[:5000]) + gzip.compress(whole[5000:]) + bytes(7)  # zero padding
    file.write_bytes(sound)
    assert open_volume(file).sha256() == hashlib.sha256(sound).hexdigest()
    damaged = bytearray(gzip.compress(whole))
    damaged[len(damaged) // 2 : len(damaged) // 2 + 64] = bytes(64)  # the trailer is intact
    file.write_bytes(damaged)
    opened = open_volume(file)  # the header and the trailer's size look right
    with pytest.raises(InputError, match=f"{file}: the gzip stream is corrupt .*data check"):
        opened.sha256()
    file.write_bytes(sound[: len(sound) // 2])  # cut after the volume was opened
    with pytest.raises(InputError, match=f"{file}: the gzip stream is cut short"):
        opened.sha256()


def test_a_folder_is_said_to_be_a_folder(tmp_path: Path) -> None:
    (tmp_path / "scans").mkdir()
    (tmp_path / "vol.nii.gz").mkdir()
    (tmp_path / "d.h5").mkdir()
    for pattern in ("scans", "vol.nii.gz", "d.h5:/data", str(tmp_path / "scans")):
        with pytest.raises(InputError, match=f"{pattern}: is a folder, not a volume file"):
            expand_inputs([pattern], tmp_path)
    with pytest.raises(InputError, match="scans: is a folder, not a volume file"):
        open_volume(tmp_path / "scans")
    os.mkfifo(tmp_path / "pipe.npy")  # opening it would block
    for pattern in ("pipe.npy", str(tmp_path / "pipe.npy")):
        with pytest.raises(InputError, match=r"pipe\.npy: is a FIFO \(named pipe\), not a vol"):
            expand_inputs([pattern], tmp_path)
    with pytest.raises(InputError, match=r"pipe\.npy: is a FIFO"):
        open_volume(tmp_path / "pipe.npy")


def test_read_rows_refuses_rows_and_frames_outside(tmp_path: Path) -> None:
    np.save(tmp_path / "v.npy", volume())
    vol = open_volume(tmp_path / "v.npy")
    with pytest.raises(IndexError):
        vol.read_rows(np.array([SHAPE[0]]))
    with pytest.raises(IndexError):
        vol.read_rows(np.array([0]), frame=1)


def test_expand_inputs(tmp_path: Path) -> None:
    for name in ("b.nii.gz", "a.nii.gz", "sub/c.nii.gz", "x.h5", "y.h5"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "d.nii.gz").mkdir()  # a folder that matches the glob is not an input
    found = expand_inputs(["*.nii.gz", "a.nii.gz", "**/c.nii.gz", "*.h5:/data"], tmp_path)
    names = [str(Path(p).relative_to(tmp_path)) for p in found]
    assert names == ["a.nii.gz", "b.nii.gz", "sub/c.nii.gz", "x.h5:/data", "y.h5:/data"]
    assert expand_inputs([str(tmp_path / "x.h5") + ":data"], Path("/elsewhere")) == [
        f"{tmp_path / 'x.h5'}:/data"
    ]
    with pytest.raises(InputError, match=r"scans/\*\.nii: matches no file"):
        expand_inputs(["a.nii.gz", "scans/*.nii"], tmp_path)
    with pytest.raises(InputError, match=r"nothing\.npy: no such file"):
        expand_inputs(["nothing.npy"], tmp_path)


NIBABEL_DATA = Path(nib.__file__).parent / "tests" / "data"


@pytest.mark.parametrize("name", ["minc1_4d.mnc", "minc2_4d.mnc", "minc2-4d-d.mnc"])
def test_4d_minc_with_time_first_is_filtered_over_its_spatial_axes(device, name: str) -> None:
    """nibabel's 4D MINC test files store time first: each frame is filtered over its three
    spatial axes, as scipy filters nibabel's ``get_fdata()[t]``, and time comes last."""
    file = NIBABEL_DATA / name
    if not file.is_file():
        pytest.skip(f"nibabel ships no {name} here")
    img = nib.load(file)
    frames = np.asarray(img.get_fdata())  # (t, a, b, c): the names say time is first
    vol = open_volume(file)
    assert vol.shape == (*frames.shape[1:], frames.shape[0]) and vol.n_frames == frames.shape[0]
    assert vol.voxel_size == tuple(float(z) for z in img.header.get_zooms()[1:])
    np.testing.assert_array_equal(vol.affine, img.affine)  # nibabel's: the spatial axes
    rows = np.array([3, 1, 2, 0, 4])
    for t in range(vol.n_frames):
        np.testing.assert_array_equal(vol.read_rows(rows, frame=t), frames[t][rows])
    data = np.stack([vol.read_rows(np.arange(vol.shape[0]), t) for t in range(vol.n_frames)], -1)
    kernels = np.random.default_rng(3).standard_normal((2, 3, 5, 3))
    out = convolve_bank(data, kernels, "nearest", device=device)
    for t in range(vol.n_frames):
        frame = frames[t]
        assert_spec_close(out[..., t], frame, kernels, reference(frame, kernels, "nearest"))


def test_3d_minc_keeps_its_axes() -> None:
    file = NIBABEL_DATA / "small.mnc"
    if not file.is_file():
        pytest.skip("nibabel ships no small.mnc here")
    vol = open_volume(file)
    data = np.asarray(nib.load(file).dataobj)
    assert vol.shape == data.shape
    np.testing.assert_array_equal(vol.read_rows(np.arange(vol.shape[0])), data)


def test_a_file_named_like_a_glob_is_that_file(tmp_path: Path) -> None:
    for name in ("[x].npy", "scan*.npy", "a?.npy"):
        np.save(tmp_path / name, np.zeros((2, 2, 2), np.uint8))
    np.save(tmp_path / "x.npy", np.ones((2, 2, 2), np.uint8))  # what "[x].npy" globs to
    assert expand_inputs(["[x].npy"], tmp_path) == [str(tmp_path / "[x].npy")]
    assert expand_inputs(["scan*.npy"], tmp_path) == [str(tmp_path / "scan*.npy")]
    assert len(expand_inputs(["*.npy"], tmp_path)) == 4  # a glob is still a glob
    with pytest.raises(InputError, match=r"\[y\]\.npy: matches no file"):
        expand_inputs(["[y].npy"], tmp_path)


# -- HDF5 inputs that read other files (VDS, external storage, external links) ------------
def _hdf5_reading_others(folder: Path, kind: str) -> tuple[str, Path, np.ndarray]:
    """An input ``folder/in/x.h5:/...`` whose data lies in ``folder/other/``: the spec, the
    other file, and the data read through it."""
    (folder / "in").mkdir()
    (folder / "other").mkdir()
    data = volume(dtype="uint8")
    source = save_h5(folder / "other" / "src.h5", "data", data)
    x = folder / "in" / "x.h5"
    with h5py.File(x, "w") as f:
        if kind == "vds":
            layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
            layout[:] = h5py.VirtualSource(str(source), "data", shape=data.shape)
            f.create_virtual_dataset("data", layout, fillvalue=0)
            return f"{x}:/data", source, data
        if kind == "external-storage":
            raw = folder / "other" / "raw.bin"
            data.tofile(raw)
            f.create_dataset("data", shape=data.shape, dtype=data.dtype,
                             external=[(str(raw), 0, data.nbytes)])  # fmt: skip
            return f"{x}:/data", raw, data
        f["g"] = h5py.ExternalLink(str(source), "/")
        if kind == "external-link":
            return f"{x}:/g/data", source, data
        f["soft"] = h5py.SoftLink("/g/data")  # a soft link whose target leaves the file
        return f"{x}:/soft", source, data


KINDS = ["vds", "external-storage", "external-link", "soft-to-external-link"]


@pytest.mark.parametrize("kind", KINDS)
def test_hdf5_reading_other_files_is_refused_unless_allowed(tmp_path, kind):
    """Refused by default, naming the input and the file it points to; allowed with
    ``external=True``, it reads that file's data."""
    spec, other, data = _hdf5_reading_others(tmp_path, kind)
    with pytest.raises(InputError) as e:
        open_volume(spec)
    assert spec in str(e.value) and str(other) in str(e.value)
    assert "input.external = true" in str(e.value)
    vol = open_volume(spec, external=True)
    np.testing.assert_array_equal(vol.read_rows(np.arange(SHAPE[0])), data)


@pytest.mark.parametrize("kind", KINDS)
def test_the_digest_of_an_input_reading_other_files_covers_their_data(tmp_path, kind):
    """A change in the other file changes the input's SHA-256, though the container's
    bytes stay the same: the rerun recomputes rather than keeping a stale output."""
    spec, other, data = _hdf5_reading_others(tmp_path, kind)
    container = Path(spec.rpartition(":")[0]).read_bytes()
    before = open_volume(spec, external=True).sha256()
    changed = data.copy()
    changed[3, 2, 1] += 1
    if other.suffix == ".bin":
        changed.tofile(other)
    else:
        with h5py.File(other, "r+") as f:
            f["data"][...] = changed
    assert Path(spec.rpartition(":")[0]).read_bytes() == container
    assert open_volume(spec, external=True).sha256() != before


def test_a_virtual_dataset_with_a_missing_source_fails_even_when_allowed(tmp_path):
    """HDF5 reads a missing source as fill values: volconv refuses it instead."""
    spec, source, _ = _hdf5_reading_others(tmp_path, "vds")
    source.unlink()
    with pytest.raises(InputError, match=f"source file {source} is missing"):
        open_volume(spec, external=True)
    save_h5(source, "other_name", volume(dtype="uint8"))  # the file, not the dataset
    with pytest.raises(InputError, match=f"{source}:data is missing"):
        open_volume(spec, external=True)
    outer = tmp_path / "outer.h5"  # a VDS over that VDS: its sources are checked too
    with h5py.File(outer, "w") as f:
        layout = h5py.VirtualLayout(shape=SHAPE, dtype="uint8")
        layout[:] = h5py.VirtualSource(spec.rpartition(":")[0], "data", shape=SHAPE)
        f.create_virtual_dataset("data", layout, fillvalue=0)
    with pytest.raises(InputError, match=f"{source}:data is missing"):
        open_volume(f"{outer}:/data", external=True)


def test_hdf5_files_volconv_cannot_read_are_named(tmp_path):
    """An HDF5 file named .mnc (MINC2 is HDF5) and a null dataspace: one message naming the
    file, not the reader's raw KeyError or TypeError."""
    mnc = save_h5(tmp_path / "a.mnc", "data", volume())
    with pytest.raises(InputError, match=r"a\.mnc: is an HDF5 file but not a MINC2 volume"):
        open_volume(mnc)
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_dataset("data", data=h5py.Empty("f4"))
    with pytest.raises(InputError, match=r"e\.h5:/data: the dataset is empty"):
        open_volume(f"{tmp_path / 'e.h5'}:/data")


def test_inputs_without_a_voxel_size_say_so(tmp_path):
    """.npy, an HDF5 dataset without an affine and a NIfTI whose pixdim is 0 (nibabel
    reads it as 1) record no voxel size; a NIfTI and an HDF5 affine do."""
    np.save(tmp_path / "a.npy", volume())
    assert "npy" in open_volume(tmp_path / "a.npy").voxel_unknown
    save_h5(tmp_path / "h.h5", "plain", volume())
    save_h5(tmp_path / "h.h5", "placed", volume(), affine=AFFINE)
    assert "affine" in open_volume(f"{tmp_path / 'h.h5'}:/plain").voxel_unknown
    assert open_volume(f"{tmp_path / 'h.h5'}:/placed").voxel_unknown == ""
    nifti = save_nifti(nib.Nifti1Image, tmp_path / "a.nii", volume())
    assert open_volume(nifti).voxel_unknown == ""
    raw = bytearray(nifti.read_bytes())
    raw[80:92] = np.array([-1.5, 2, 3], "<f4").tobytes()  # pixdim[1:4]: a sign nibabel drops
    nifti.write_bytes(bytes(raw))
    assert open_volume(nifti).voxel_unknown == ""
    raw[80:92] = np.zeros(3, "<f4").tobytes()
    raw[252:256] = bytes(4)  # qform_code, sform_code: no affine either
    nifti.write_bytes(bytes(raw))
    assert "0 x 0 x 0" in open_volume(nifti).voxel_unknown


def test_the_pipeline_refuses_other_files_and_mm_without_a_voxel_size(tmp_path):
    """Planning: an HDF5 input reading another file is the user's mistake (exit 2) unless
    ``[input] external = true``; ``units = "mm"`` on a .npy names the input and bank.units."""
    from test_pipeline import write_pipeline

    from volconv.config import PipelineError, load
    from volconv.run.jobs import USER_ERRORS, choose_device, plan_jobs

    spec, other, _ = _hdf5_reading_others(tmp_path, "external-link")
    gaussian = [{"type": "gaussian", "sigma": 1.0}]
    cfg = load(write_pipeline(tmp_path, gaussian, input={"paths": [spec]}))
    device = choose_device(cfg)
    with pytest.raises(USER_ERRORS, match=f"external link to {other}"):
        plan_jobs(cfg, device)
    cfg = load(write_pipeline(tmp_path, gaussian, input={"paths": [spec], "external": True}))
    (job,) = plan_jobs(cfg, device)
    assert job.volume.sha256() != hashlib.sha256(Path(job.volume.file).read_bytes()).hexdigest()
    np.save(tmp_path / "a.npy", volume())
    cfg = load(write_pipeline(tmp_path, gaussian, input={"paths": ["a.npy"]},
                              bank={"units": "mm"}))  # fmt: skip
    with pytest.raises(PipelineError, match=r"bank.units: \"mm\" needs .*\(for .*a\.npy\)"):
        plan_jobs(cfg, device)


def test_a_virtual_dataset_within_its_own_file_reads_nothing_else(tmp_path):
    """A VDS over datasets of its own file (".") is allowed as it is; a missing source
    dataset there, or one reached through an external link, is not."""
    data = volume(dtype="uint8")
    x = save_h5(tmp_path / "x.h5", "whole", data)
    save_h5(tmp_path / "other.h5", "data", data)
    with h5py.File(x, "a") as f:
        f["out"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/")
        for name, source in [("view", "whole"), ("gap", "nothing"), ("leak", "out/data")]:
            layout = h5py.VirtualLayout(shape=SHAPE, dtype="uint8")
            layout[:] = h5py.VirtualSource(".", source, shape=SHAPE)
            f.create_virtual_dataset(name, layout, fillvalue=0)
    vol = open_volume(f"{x}:/view")
    np.testing.assert_array_equal(vol.read_rows(np.arange(SHAPE[0])), data)
    assert vol.sha256() == hashlib.sha256(x.read_bytes()).hexdigest()  # the file says it all
    with pytest.raises(InputError, match=r"source \.:/?nothing is missing"):
        open_volume(f"{x}:/gap")
    with pytest.raises(InputError, match=f"through an external link, {tmp_path / 'other.h5'}"):
        open_volume(f"{x}:/leak")
    open_volume(f"{x}:/leak", external=True)
