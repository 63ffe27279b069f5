"""Output formats (docs/contract.md "Output formats"): NIfTI, OME-Zarr and HDF5 written by a
real run and opened with the readers users have (nibabel, gzip, zarr, ome-zarr, dask, xarray),
values equal across formats; skip, batch and refusals per format."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import nibabel as nib
import nibabel.testing
import numpy as np
import pytest
from test_cli import assert_one_line_error
from test_pipeline import DEVICE, ROOT, random_volume, volconv, write_pipeline

from volconv.output import ROOT_ATTRS, OutputError, ResponseWriter, read, writer_for

FILTERS = [
    {"name": "smooth", "type": "gaussian", "sigma": 1.0},
    {"name": "dz", "type": "gaussian", "sigma": 1.0, "order": [0, 0, 1]},
]
EXAMPLE4D = Path(nibabel.testing.data_path) / "example4d.nii.gz"  # TR in its header


def run(pipeline: Path, path: str, capsys: pytest.CaptureFixture, *args: str) -> str:
    code, out, err = volconv("run", pipeline, "--set", f"output.path={path}", *args,
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    return out


def scan_4d(folder: Path) -> Path:
    """nibabel's example4d (oblique affine, sform and qform codes 1, mm and s, 2 frames)."""
    shutil.copy(EXAMPLE4D, folder / "scan.nii.gz")
    return write_pipeline(folder, FILTERS, input={"paths": ["scan.nii.gz"]})


def test_nifti_keeps_the_input_space_and_holds_the_hdf5_values(tmp_path, capsys):
    pipeline = scan_4d(tmp_path)
    run(pipeline, f"{tmp_path}/h5/{{stem}}.h5", capsys)
    run(pipeline, f"{tmp_path}/nii/{{stem}}.nii.gz", capsys)
    source, out = nib.load(EXAMPLE4D), tmp_path / "nii" / "scan.nii.gz"
    img = nib.load(out)
    assert img.shape == (*source.shape, 2)  # 4D input: x, y, z, t, outputs
    np.testing.assert_allclose(img.affine, source.affine)
    for key in ("sform_code", "qform_code", "xyzt_units"):
        assert img.header[key] == source.header[key]
    np.testing.assert_allclose(img.header.get_qform(), source.header.get_qform(), atol=1e-6)
    assert img.header.get_zooms()[:4] == source.header.get_zooms()  # the repetition time
    assert img.header.get_xyzt_units() == source.header.get_xyzt_units()
    assert img.header["descrip"].tobytes().startswith(b"volconv: smooth, dz")
    sidecar = json.loads((tmp_path / "nii" / "scan.json").read_text())
    assert sidecar["VolumeNames"] == ["smooth", "dz"] and sidecar["volconv"]["complete"]
    tr = float(source.header.get_zooms()[3])  # seconds: the header's time unit is "sec"
    assert sidecar["RepetitionTime"] == pytest.approx(tr)
    with h5py.File(tmp_path / "h5" / "scan.h5") as f:
        np.testing.assert_array_equal(np.asarray(img.dataobj), np.moveaxis(f["responses"][()],
                                      0, -1))  # fmt: skip
        np.testing.assert_allclose(f["t"][()], [0, tr])
        assert f["t"].attrs["units"] == "s"
    # one file every gzip reader takes whole: independent members, one after another
    whole = subprocess.run(["gzip", "-dc", str(out)], capture_output=True, check=True).stdout
    assert whole == gzip.decompress(out.read_bytes())
    assert len(whole) == 352 + np.asarray(img.dataobj).nbytes
    stored = read(out)
    assert stored.names == ["smooth", "dz"] and stored.format == "nifti"
    np.testing.assert_array_equal(stored.outputs[1][:, 5], np.asarray(img.dataobj)[:, 5, ..., 1])


def test_nifti_of_a_3d_input_is_4d_uncompressed_and_skipped_when_made_the_same(tmp_path, capsys):
    np.save(tmp_path / "a.npy", random_volume((20, 18, 16), "float32"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"path": "out/{stem}.nii"})
    run(pipeline, f"{tmp_path}/out/{{stem}}.nii", capsys)
    run(pipeline, f"{tmp_path}/ref/{{stem}}.h5", capsys)
    img = nib.load(tmp_path / "out" / "a.nii")
    assert img.shape == (20, 18, 16, 2) and img.dataobj.dtype == np.float32
    with h5py.File(tmp_path / "ref" / "a.h5") as f:
        np.testing.assert_array_equal(np.asarray(img.dataobj), np.moveaxis(f["responses"][()],
                                      0, -1))  # fmt: skip
    before = (tmp_path / "out" / "a.nii").stat().st_mtime_ns
    out = run(pipeline, f"{tmp_path}/out/{{stem}}.nii", capsys)
    assert "skipped" in out and (tmp_path / "out" / "a.nii").stat().st_mtime_ns == before
    code, out, err = volconv("run", pipeline, "--set", "bank.boundary=nearest", capsys=capsys)
    assert_one_line_error(code, out, err, "a.nii", "made with another boundary")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.json", "a.nii"]


def test_a_json_beside_that_is_not_volconv_s_is_never_replaced(tmp_path, capsys):
    np.save(tmp_path / "a.npy", random_volume((12, 10, 8), "float32"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"path": "{stem}.nii.gz"})
    (tmp_path / "a.json").write_text('{"RepetitionTime": 2}')
    for args in ([], ["--overwrite"]):
        code, out, err = volconv("run", pipeline, *args, capsys=capsys)
        assert_one_line_error(code, out, err, "a.json", "not a volconv sidecar")
    assert (tmp_path / "a.json").read_text() == '{"RepetitionTime": 2}'
    assert not (tmp_path / "a.nii.gz").exists()


def test_zarr_is_valid_ngff_0_5_and_opens_in_ome_zarr_and_dask(tmp_path, capsys):
    zarr = pytest.importorskip("zarr")
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.v05.image import Image

    dask_array = pytest.importorskip("dask.array")
    pipeline = scan_4d(tmp_path)
    run(pipeline, f"{tmp_path}/h5/{{stem}}.h5", capsys)
    run(pipeline, f"{tmp_path}/z/{{stem}}.zarr", capsys, "--set", "output.compression=zstd")
    path = tmp_path / "z" / "scan.zarr"
    Image.from_zarr(zarr.open_group(str(path), mode="r"))  # raises where the metadata is not
    (node,) = list(Reader(parse_url(str(path)))())
    assert node.metadata["channel_names"] == ["smooth", "dz"]
    axes = node.metadata["axes"]
    assert [a["name"] for a in axes] == ["t", "c", "z", "y", "x"]
    assert [a.get("unit") for a in axes] == ["second", None, *["millimeter"] * 3]
    (scale, translation) = node.metadata["coordinateTransformations"][0]
    source = nib.load(EXAMPLE4D)
    np.testing.assert_allclose(scale["scale"][2:], np.array(source.header.get_zooms()[2::-1]),
                               rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(translation["translation"][2:], source.affine[2::-1, 3])
    image = dask_array.from_zarr(str(path / "0"))
    with h5py.File(tmp_path / "h5" / "scan.h5") as f:
        np.testing.assert_array_equal(image.compute(), f["responses"][()].transpose(4, 0, 3, 2, 1))
    stored = read(path)
    with h5py.File(tmp_path / "h5" / "scan.h5") as f:
        np.testing.assert_array_equal(stored.outputs[0][3:9, :, 7], f["responses"][0, 3:9, :, 7])
    xr = pytest.importorskip("xarray")
    with xr.open_dataset(path, engine="zarr", consolidated=False) as ds:  # coordinates in mm
        assert list(ds["c"].values) == ["smooth", "dz"] and ds["x"].attrs["units"] == "mm"
        origin, step = source.affine[0, 3], source.header.get_zooms()[0]
        np.testing.assert_allclose(ds["x"].values, origin + step * np.arange(ds.sizes["x"]))
    out = run(pipeline, f"{tmp_path}/z/{{stem}}.zarr", capsys, "--set", "output.compression=zstd")
    assert "skipped" in out
    run(pipeline, f"{tmp_path}/z/{{stem}}.zarr", capsys, "--overwrite")
    assert sorted(p.name for p in (tmp_path / "z").iterdir()) == ["scan.zarr"]


def test_hdf5_shows_world_coordinates_in_xarray_and_axistags(tmp_path, capsys):
    xr = pytest.importorskip("xarray")
    affine = np.array([[1.5, 0, 0, -10], [0, 2, 0, 5], [0, 0, 2.5, 7], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(random_volume((14, 12, 10), "float32"), affine), tmp_path / "a.nii")
    pipeline = write_pipeline(tmp_path, FILTERS, input={"paths": ["a.nii"]})
    run(pipeline, f"{tmp_path}/out/{{stem}}.h5", capsys)
    with xr.open_dataset(tmp_path / "out" / "a.h5", engine="h5netcdf") as ds:
        for i, axis in enumerate("xyz"):
            expected = affine[i, 3] + affine[i, i] * np.arange(ds.sizes[axis])
            np.testing.assert_allclose(ds[axis].values, expected)
            assert ds[axis].attrs["units"] == "mm"
    with h5py.File(tmp_path / "out" / "a.h5") as f:
        tags = json.loads(f["responses"].attrs["axistags"])
    assert [a["key"] for a in tags["axes"]] == ["c", "x", "y", "z"]
    assert [a["typeFlags"] for a in tags["axes"]] == [1, 2, 2, 2]
    assert json.loads(tags["axes"][0]["description"]) == ["smooth", "dz"]
    assert [a["resolution"] for a in tags["axes"][1:]] == [1.5, 2.0, 2.5]


def test_a_blosc_output_names_hdf5plugin(tmp_path):
    pytest.importorskip("hdf5plugin")
    path = tmp_path / "b.h5"
    data = random_volume((2, 8, 6, 5), "float32")
    with ResponseWriter(path, (8, 6, 5), ["a", "b"], np.ones((2, 1, 1, 1)), compression="blosc",
                        boundary="reflect", cval=0.0, slab_depth=4) as w:  # fmt: skip
        w.write_slab(0, 8, data.copy())
        w.finish(dict.fromkeys(ROOT_ATTRS, 0))
    with h5py.File(path) as f:
        assert f.attrs["requires"] == "hdf5plugin"
        assert "import hdf5plugin" in f["responses"].attrs["note"]
    np.testing.assert_array_equal(np.asarray(read(path).outputs[1]), data[1])
    # a reader without hdf5plugin: volconv says what to install, not h5py's plugin error
    code = (
        "import sys; sys.modules['hdf5plugin'] = None\n"
        "from volconv.output import read\n"
        f"read({str(path)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "OutputError" in proc.stderr
    assert "import hdf5plugin" in proc.stderr and "pip install hdf5plugin" in proc.stderr


@pytest.mark.parametrize("path", ["out/{stem}.tif", "out/{stem}.nii.bz2", "out/{stem}"])
def test_a_suffix_volconv_cannot_write_is_refused(tmp_path, capsys, path):
    np.save(tmp_path / "a.npy", random_volume((8, 8, 8), "float32"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"path": path})
    for command in ("validate", "run"):
        code, out, err = volconv(command, pipeline, capsys=capsys)
        assert_one_line_error(code, out, err, "output.path", "cannot write", ".nii.gz", ".zarr")
    code, out, err = volconv("validate", pipeline, "--set", "output.path=a.h5", "--set",
                             "output.format=zarr", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "output.format", "written as hdf5")
    assert not (tmp_path / "out").exists()


def test_writer_refusals_name_the_format(tmp_path):
    options = {"boundary": "reflect", "cval": 0.0, "slab_depth": 4}
    with pytest.raises(OutputError, match="float16"):  # NIfTI-1 has no such type
        writer_for(tmp_path / "a.nii")(tmp_path / "a.nii", (4, 4, 4), ["a"], np.ones((1, 1, 1, 1)),
                                       dtype="float16", **options)  # fmt: skip
    with pytest.raises(OutputError, match=r"needs a \.nii\.gz path"):
        writer_for(tmp_path / "a.nii")(tmp_path / "a.nii", (4, 4, 4), ["a"], np.ones((1, 1, 1, 1)),
                                       compression="gzip", **options)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".nii.gz", ".zarr"])
def test_a_batch_of_two_workers_writes_each_format(tmp_path, capsys, suffix, monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "0")  # workers, not the small-batch rule
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    for name, shape in {"a": (30, 14, 12), "b": (24, 16, 10)}.items():
        np.save(tmp_path / f"{name}.npy", random_volume(shape, "uint8"))
    pipeline = write_pipeline(tmp_path, FILTERS)
    run(pipeline, f"{tmp_path}/ref/{{stem}}.h5", capsys)
    out = run(pipeline, f"{tmp_path}/out/{{stem}}{suffix}", capsys, "--devices",
              f"{DEVICE},{DEVICE}")  # fmt: skip
    assert "worker" in out  # this process and a worker share the inputs (volconv.run.batch)
    for name in ("a", "b"):
        stored = read(tmp_path / "out" / f"{name}{suffix}")
        with h5py.File(tmp_path / "ref" / f"{name}.h5") as f:
            for i in range(2):
                np.testing.assert_array_equal(np.asarray(stored.outputs[i]), f["responses"][i])
    assert list((tmp_path / "out").glob(".*partial*")) == []
    out = run(pipeline, f"{tmp_path}/out/{{stem}}{suffix}", capsys, "--devices",
              f"{DEVICE},{DEVICE}")  # fmt: skip
    assert "skipped" in out


@pytest.mark.parametrize("suffix", [".h5", ".nii", ".nii.gz", ".zarr"])
def test_an_interrupted_output_resumes_inside_the_volume(tmp_path, suffix):
    """Stopped after 5 of 12 slabs (as Ctrl-C keeps it), a rerun with the same fingerprint
    reads those slabs back, checks their CRCs, writes only the 7 others, and the output holds
    every value; nothing is left beside it."""
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    from concurrent.futures import Future

    from volconv.run.resume import Progress

    data = random_volume((2, 24, 10, 8, 2), "float32")
    path = tmp_path / f"out{suffix}"
    work = [(t, a, a + 4) for t in range(2) for a in range(0, 24, 4)]

    def writer(progress: Progress):
        w = writer_for(path)(path, data.shape[1:], ["a", "b"], np.ones((2, 1, 1, 1)),
                             boundary="reflect", cval=0.0, slab_depth=4, progress=progress,
                             compression="gzip" if suffix == ".nii.gz" else "none")  # fmt: skip
        known = Future()
        known.set_result("0" * 64)
        progress.input_known(known)
        return w

    first = Progress("key", lambda: "0" * 64)
    with pytest.raises(KeyboardInterrupt), writer(first) as w:
        for t, a, b in work[:5]:
            w.write_slab(a, b, data[:, a:b, ..., t].copy(), frame=t)
        w.drain()
        w.keep()
        raise KeyboardInterrupt
    assert not path.exists()
    again = Progress("key", lambda: "0" * 64)
    with writer(again) as w:
        left = again.remaining(work)
        assert len(again.done) == 5 and left == work[5:]
        for t, a, b in left:
            w.write_slab(a, b, data[:, a:b, ..., t].copy(), frame=t)
        w.finish({**dict.fromkeys(ROOT_ATTRS, 0), "affine": np.eye(4)})
    with read(path) as stored:
        for i in range(2):
            np.testing.assert_array_equal(np.asarray(stored.outputs[i]), data[i])
    beside = {".nii": ["out.json"], ".nii.gz": ["out.json"]}.get(suffix, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, *beside])


# Writes a (3, 64, 64, 64) float32 output (3 MiB) under a file size limit of 1 MiB.
FULL_SCRIPT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
import numpy as np
from volconv.output import ROOT_ATTRS, OutputWriteError, writer_for
path = sys.argv[1]
try:
    with writer_for(path)(path, (64, 64, 64), ["a", "b", "c"], np.ones((3, 1, 1, 1)),
                          boundary="reflect", cval=0.0, slab_depth=8) as w:
        for a in range(0, 64, 8):
            w.write_slab(a, a + 8, np.ones((3, 8, 64, 64), np.float32))
        w.finish(dict.fromkeys(ROOT_ATTRS, 1.0))
except OutputWriteError as e:
    print(str(e))
    sys.exit(3)
"""


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_no_room_for_a_nifti_is_a_clean_error_before_any_slab(tmp_path, suffix):
    """The file's blocks are reserved first: no room is one line naming the output and the
    cause (not a crash of the process writing to its mapping), and nothing is left."""
    path = tmp_path / f"a{suffix}"
    run = subprocess.run([sys.executable, "-c", FULL_SCRIPT, str(path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)
    assert run.stdout == f"{path}: cannot write there (File too large)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".h5", ".nii.gz", ".zarr"])
def test_open_writer_takes_outputs_responses_and_features(tmp_path, suffix):
    """The seam, in every format: outputs name the stored volumes; ``/kernels`` holds each
    response's kernel and a (1, 1, 1) zero kernel for a feature output, stacked to one extent,
    as docs/contract.md says (the run's ``features`` attribute describes the feature)."""
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    from volconv.bank.outputs import Output
    from volconv.output import made, open_writer

    kernel = np.arange(27, dtype=np.float64).reshape(3, 3, 3)
    feature = Output("eig_0", "hessian_eigenvalues", params={"sigma": 1.5, "index": 0})
    outputs = [Output("smooth", kernel=kernel), feature]
    data = random_volume((2, 12, 10, 8), "float32")
    path = tmp_path / f"o{suffix}"
    with open_writer(path, (12, 10, 8), outputs, boundary="reflect", cval=0.0,
                     slab_depth=6) as w:  # fmt: skip
        for a in (0, 6):
            w.write_slab(a, a + 6, data[:, a : a + 6].copy())
        w.finish({**dict.fromkeys(ROOT_ATTRS, 0), "affine": np.eye(4)})
    how = made(path)
    assert how["filter names"] == ["smooth", "eig_0"]
    np.testing.assert_array_equal(how["bank"], np.stack([kernel, np.zeros((3, 3, 3))]))
    with read(path) as stored:
        np.testing.assert_array_equal(np.asarray(stored.outputs[1]), data[1])
    if suffix == ".h5":
        with h5py.File(path) as f:
            assert f["kernels"].attrs["extents"].tolist() == [[3, 3, 3], [1, 1, 1]]
            assert f["kernels"].dims[0].label == "filter" and "kernel" not in f


def test_a_uint8_nifti_reads_back_as_the_values_through_scl_slope(tmp_path):
    data = (random_volume((2, 8, 6, 4), "float32") + 40).astype(np.float32)
    path = tmp_path / "u.nii"
    with writer_for(path)(path, (8, 6, 4), ["a", "b"], np.ones((2, 1, 1, 1)), dtype="uint8",
                          scale=0.5, offset=-10.0, boundary="reflect", cval=0.0,
                          slab_depth=4) as w:  # fmt: skip
        for a in (0, 4):
            w.write_slab(a, a + 4, data[:, a : a + 4].copy())
        w.finish({**dict.fromkeys(ROOT_ATTRS, 0), "affine": np.eye(4)})
    img = nib.load(path)
    assert img.get_data_dtype() == np.uint8
    expected = np.clip(data, -10.0, 255 * 0.5 - 10.0)
    np.testing.assert_allclose(np.moveaxis(img.get_fdata(), -1, 0), expected, atol=0.25 + 1e-4)


def test_zarr_missing_is_one_line_naming_what_to_install(tmp_path):
    np.save(tmp_path / "a.npy", random_volume((8, 8, 8), "float32"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"path": "out/{stem}.zarr"})
    code = (
        "import sys; sys.modules['zarr'] = None\n"
        "from volconv.cli import entry_point\n"
        f"sys.argv = ['volconv', 'validate', {str(pipeline)!r}]\n"
        "entry_point()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "output.compression",
                          "zarr >= 3", "volconv[formats]")  # fmt: skip


@pytest.mark.parametrize("suffix", [".h5", ".nii.gz", ".zarr"])
def test_an_output_s_mode_is_the_umask_s_as_any_file(tmp_path, suffix):
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    path = tmp_path / f"o{suffix}"
    old = os.umask(0o022)
    try:
        with writer_for(path)(path, (4, 4, 4), ["a"], np.ones((1, 1, 1, 1)),
                              boundary="reflect", cval=0.0, slab_depth=4) as w:  # fmt: skip
            w.write_slab(0, 4, np.ones((1, 4, 4, 4), np.float32))
            w.finish({**dict.fromkeys(ROOT_ATTRS, 0), "affine": np.eye(4)})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == (0o755 if suffix == ".zarr" else 0o644)
