"""`volconv run`: pipeline files to HDF5 outputs equal to scipy.ndimage.convolve (docs/contract.md).

Every stored response is checked against scipy.ndimage.convolve (float64) of the input with
the kernel stored beside it, at the contract's tolerance, through the CLI as users run it: every
example pipeline, 3D and 4D inputs, integer and float types, big-endian NIfTI, HDF5 and .npy
inputs, forced slab depths, float16 and uint8 outputs.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import nibabel as nib
import numpy as np
import pytest
import scipy.ndimage as ndi
from conftest import assert_spec_close, reference

from volconv import cli
from volconv.bank.features import build_features, expand
from volconv.bank.filters import build_bank
from volconv.checks import spec_tolerance
from volconv.config import dump_toml
from volconv.engines.padder import frame_bytes
from volconv.engines.tensor import TENSOR_ENGINE

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = sorted((ROOT / "pipelines").glob("*.toml"))
# The device of the tests that do not exercise it (a pipeline needs one); the others run on
# every device present (conftest's ``device_spec``).
DEVICE = os.environ.get("VOLCONV_TEST_DEVICE", "cpu")
RNG = np.random.default_rng(20261122)


# -- helpers shared with test_cli.py ------------------------------------------------------
def volconv(*args: str, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """Run the CLI in this process as ``volconv ARGS``: (exit status, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["volconv", *map(str, args)]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def random_volume(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (RNG.standard_normal(shape) * 40).astype(dt)
    info = np.iinfo(dt)
    lo, hi = max(info.min, -2000), min(info.max, 2000)
    return RNG.integers(lo, hi, shape, endpoint=True).astype(dt)


def write_pipeline(
    folder: Path, filters: list[dict], *, device: str = DEVICE, **sections: dict
) -> Path:
    """A pipeline file in ``folder`` with the given filters, run on ``device`` (a test that
    exercises the device passes conftest's ``device_spec``); sections override the rest."""
    data = {
        "input": {"paths": ["*.npy"]},
        "bank": {"size": 3, "boundary": "reflect", "filter": filters},
        "output": {"path": "out/{stem}.h5"},
        "run": {"device": device},
    }
    for name, body in sections.items():
        data[name] = {**data.get(name, {}), **body}
    path = folder / "pipeline.toml"
    path.write_text(dump_toml(data))
    return path


def load_input(path: Path) -> np.ndarray:
    """The input as the contract's oracle reads it."""
    if path.suffix == ".npy":
        return np.load(path).astype(np.float64)
    return nib.load(path).get_fdata()


def check_output(
    out_path: Path, volume: np.ndarray, boundary: str = "reflect", cval: float = 0.0
) -> h5py.File:
    """Every response of ``out_path`` equals scipy's convolution with the stored kernel."""
    f = h5py.File(out_path, "r")
    assert f.attrs["complete"]
    responses, kernels = f["responses"], f["kernels"][()].astype(np.float64)
    assert responses.shape == (len(kernels), *volume.shape)
    assert responses.attrs["boundary"] == boundary
    frames = [volume] if volume.ndim == 3 else [volume[..., t] for t in range(volume.shape[3])]
    for t, frame in enumerate(frames):
        stored = responses[()] if volume.ndim == 3 else responses[..., t]
        ref = reference(frame, kernels, boundary, cval)
        check_stored(stored, ref, frame, kernels, responses.attrs)
    return f


def check_stored(stored, ref, volume, kernels, attrs) -> None:
    """the contract's tolerance for float32; for float16 and uint8 also their own rounding."""
    if stored.dtype == np.float32:
        assert_spec_close(stored, volume, kernels, ref)
        return
    vmax = float(np.max(np.abs(volume)))
    for k, kernel in enumerate(kernels):
        tol = spec_tolerance(kernel, vmax)
        if stored.dtype == np.float16:
            err = np.abs(stored[k].astype(np.float64) - ref[k])
            assert np.all(err <= tol + np.abs(ref[k]) * 2.0**-11 + 2.0**-24), k
        else:  # uint8: value = stored * scale + offset, saturating
            scale, offset = float(attrs["scale"]), float(attrs["offset"])
            want = np.clip((ref[k] - offset) / scale, 0, 255)
            err = np.abs(stored[k].astype(np.float64) - want)
            assert np.all(err <= 0.5 + tol / scale + 1e-6), k


# -- every example pipeline ---------------------------------------------------------------
@pytest.mark.parametrize("pipeline", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_every_example_pipeline_runs(pipeline, tmp_path, capsys, device_spec):
    # small: scipy's float64 reference of 52 filters of 25^3 is the slow part
    volume = random_volume((5, 6, 7), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    sets = [
        "--set", f'input.paths=["{tmp_path / "scan.npy"}"]',
        "--set", f"output.path={tmp_path}/out/{{stem}}.h5",
    ]  # fmt: skip
    codec = tomllib.loads(pipeline.read_text()).get("output", {}).get("compression", "none")
    if (
        codec in ("blosc", "blosc2", "lz4", "zstd")
        and importlib.util.find_spec("hdf5plugin") is None
    ):
        sets += ["--set", "output.compression=gzip"]  # its HDF5 form needs hdf5plugin
    code, out, err = volconv("validate", pipeline, *sets, "--device", device_spec, capsys=capsys)
    assert code == 0, err
    assert "scan.npy" in out and "(new)" in out
    report = tmp_path / "report.json"
    code, out, err = volconv(
        "run", pipeline, *sets, "--device", device_spec, "--report", report, capsys=capsys
    )
    assert code == 0, err
    assert "of peak" in out and "kernel" in out
    cfg = tomllib.loads(pipeline.read_text())
    boundary = cfg["bank"].get("boundary", "reflect")
    bank = cfg["bank"]
    if "feature" in bank or "preset" in bank:  # test_features checks the features' values
        feats = build_features(
            bank.get("feature"),
            size=bank.get("size", 7),
            preset=bank.get("preset"),
            scales=bank.get("scales"),
        )
        filters = build_bank(bank["filter"], bank.get("size", 7)) if "filter" in bank else []
        with h5py.File(tmp_path / "out" / "scan.h5") as f:
            names = [n.decode() for n in f["filter"][()]]
            assert names == expand(filters, feats).names
            assert np.isfinite(f["responses"][()]).all()
            assert [d["name"] for d in json.loads(f.attrs["features"])] == [x.name for x in feats]
        return
    with check_output(tmp_path / "out" / "scan.h5", volume.astype(np.float64), boundary) as f:
        names = [n.decode() for n in f["filter"][()]]
        assert len(names) == len(f["kernels"]) == len(set(names))
        stored = tomllib.loads(f.attrs["pipeline"])  # the pipeline after --set, re-runnable
        assert stored["input"]["paths"] == [str(tmp_path / "scan.npy")]
        assert stored["bank"] == cfg["bank"]
        assert (
            f.attrs["source_sha256"]
            == hashlib.sha256((tmp_path / "scan.npy").read_bytes()).hexdigest()
        )
        # docs/contract.md, "The throughput record": useful work from each filter's own extent;
        # the fractions of peak from what the kernels executed (at most the bank padded to one size)
        own = [
            f.kernel.shape
            for f in build_bank(
                cfg["bank"]["filter"],
                cfg["bank"].get("size", 7),
                base_dir=pipeline.parent,
                units=cfg["bank"].get("units", "voxels"),
            )
        ]
        gflop = 2 * sum(math.prod(e) for e in own) * volume.size / 1e9
        padded = 2 * len(names) * math.prod(f["kernels"].shape[1:]) * volume.size / 1e9
        executed = f.attrs["executed_gflop"]
        assert f.attrs["gflop"] == pytest.approx(gflop)
        assert 0 < executed <= padded * (1 + 1e-9)
        # the tensor cores take direct groups of 4 filters or more where they exist (NVIDIA)
        assert set(f.attrs["engine"].split(",")) <= {"fp32", "separable", TENSOR_ENGINE}
        if "separable" in f.attrs["engine"]:  # memory-bound passes: their bandwidth
            assert f.attrs["bandwidth_gbps"] > 0
        else:
            assert math.isnan(f.attrs["bandwidth_gbps"])
        np.testing.assert_array_equal(f["kernels"].attrs["extents"], own)
        assert f.attrs["gflops"] == pytest.approx(gflop / f.attrs["kernel_seconds"])
        for peak, fraction in (("peak_gflops", "fraction_of_peak"),
                               ("measured_peak_gflops", "fraction_of_measured_peak")):  # fmt: skip
            assert math.isnan(f.attrs[peak]) or f.attrs[fraction] == pytest.approx(
                executed / f.attrs["kernel_seconds"] / f.attrs[peak]
            )
    doc = json.loads(report.read_text())
    (entry,) = doc["inputs"]
    assert entry["status"] == "done" and entry["gflop"] == pytest.approx(gflop)
    assert set(entry["stages"]) == {
        "read", "upload", "pad", "kernel", "convert", "download", "write", "wall"
    }  # fmt: skip


# -- inputs: dimensions, types, byte orders, formats, slab depths -------------------------
@pytest.mark.parametrize(
    ("shape", "dtype", "slab_depth", "boundary"),
    [
        ((11, 9, 10), "uint8", None, "reflect"),
        ((11, 9, 10), "int16", 2, "mirror"),
        ((7, 8, 9), "float32", 3, "wrap"),
        ((6, 7, 8, 3), "float64", None, "nearest"),  # 4D: T frames along the last axis
        ((6, 7, 8, 2), "uint16", 1, "constant"),
    ],
)
def test_inputs_of_every_kind(tmp_path, capsys, shape, dtype, slab_depth, boundary, device_spec):
    volume = random_volume(shape, dtype)
    np.save(tmp_path / "vol.npy", volume)
    filters = [
        {"type": "gaussian", "sigma": 1.0, "order": [0, 1, 0]},
        {"type": "custom", "path": "k.npy"},
    ]
    kernel = RNG.standard_normal((2, 3, 4))
    np.save(tmp_path / "k.npy", kernel)
    run = {"slab_depth": slab_depth} if slab_depth else {}
    pipeline = write_pipeline(
        tmp_path, filters, input={"paths": ["vol.npy"]}, bank={"boundary": boundary, "cval": -3.5},
        run=run, device=device_spec,
    )  # fmt: skip
    code, _, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    cval = -3.5 if boundary == "constant" else 0.0
    with check_output(tmp_path / "out/vol.h5", volume.astype(np.float64), boundary, cval) as f:
        np.testing.assert_array_equal(f["kernels"][1, :, :, :], _padded(kernel, (3, 3, 4)))
        assert f["responses"].dims[0].label == "filter"


def _padded(kernel: np.ndarray, extent: tuple[int, ...]) -> np.ndarray:
    """``kernel`` zero-padded to ``extent`` with its centre (k // 2) kept (stack_kernels)."""
    out = np.zeros(extent, np.float32)
    start = [e // 2 - k // 2 for e, k in zip(extent, kernel.shape, strict=True)]
    out[tuple(slice(s, s + k) for s, k in zip(start, kernel.shape, strict=True))] = kernel
    return out


def test_big_endian_scaled_nifti_and_hdf5_inputs(tmp_path, capsys, device_spec):
    data = random_volume((10, 9, 8), "int16")
    header = nib.Nifti1Header(endianness=">")
    header.set_data_dtype(np.int16)
    img = nib.Nifti1Image(data, np.diag([0.8, 0.8, 2.5, 1.0]), header)
    img.header.set_slope_inter(0.5, 10.0)  # scaled: the oracle is get_fdata()
    nib.save(img, tmp_path / "be.nii")
    assert nib.load(tmp_path / "be.nii").header.endianness == ">"
    with h5py.File(tmp_path / "vols.h5", "w") as f:
        f["group/data"] = data.astype(">f4")
        f["group/data"].attrs["affine"] = np.eye(4)  # its voxel size: 1 mm (units = "mm")
    filters = [{"name": "smooth_mm", "type": "gaussian", "sigma": 2.0, "units": "mm"}]
    pipeline = write_pipeline(
        tmp_path, filters, input={"paths": ["be.nii", "vols.h5:/group/data"]},
        bank={"size": 5}, output={"path": "out/{parent}_{stem}.h5"}, device=device_spec,
    )  # fmt: skip
    code, _, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    stem = tmp_path.name
    with check_output(tmp_path / f"out/{stem}_be.h5", load_input(tmp_path / "be.nii")) as f:
        np.testing.assert_allclose(f.attrs["affine"], np.diag([0.8, 0.8, 2.5, 1.0]))
        np.testing.assert_allclose(f.attrs["voxel_size"], [0.8, 0.8, 2.5])
        # sigma 2 mm is 2.5, 2.5 and 0.8 voxels: the kernel is built for this input's voxels
        k = f["kernels"][0]
        assert np.argmax(k[2, 2, :]) == 2 and k[2, 2, 0] < 0.1 * k[2, 0, 2]
    with check_output(tmp_path / f"out/{stem}_vols.h5", data.astype(np.float64)) as f:
        assert f.attrs["source"].endswith("vols.h5:/group/data")


def test_generated_gaussian_derivatives_equal_gaussian_filter(tmp_path, capsys, device_spec):
    """The contract: gaussian with order equals gaussian_filter(..., order, truncate), constant."""
    volume = random_volume((12, 11, 10), "float32")
    np.save(tmp_path / "v.npy", volume)
    filters = [{"type": "gaussian", "sigma": [1.0, 1.5, 0.8], "order": [0, 1, 2]}]
    pipeline = write_pipeline(
        tmp_path, filters, bank={"size": 7, "boundary": "constant"}, device=device_spec
    )
    code, _, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    ref = ndi.gaussian_filter(
        volume.astype(np.float64), [1.0, 1.5, 0.8], order=[0, 1, 2], mode="constant",
        truncate=3, radius=3,
    )  # fmt: skip
    with h5py.File(tmp_path / "out/v.h5") as f:
        kernels = f["kernels"][()].astype(np.float64)
        assert_spec_close(f["responses"][()], volume, kernels, ref[None])


@pytest.mark.parametrize(
    ("dtype", "extra"), [("float16", {}), ("uint8", {"scale": 0.5, "offset": -20.0})]
)
def test_float16_and_uint8_outputs(tmp_path, capsys, dtype, extra, device_spec):
    volume = random_volume((9, 8, 7), "int16") // 40
    np.save(tmp_path / "v.npy", volume)
    filters = [{"type": "box"}, {"type": "sobel", "axis": 0}]
    pipeline = write_pipeline(
        tmp_path,
        filters,
        output={"dtype": dtype, "compression": "gzip", **extra},
        device=device_spec,
    )
    code, _, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    with check_output(tmp_path / "out/v.h5", volume.astype(np.float64)) as f:
        assert f["responses"].dtype == np.dtype(dtype)
        if dtype == "uint8":
            assert f["responses"].attrs["scale"] == 0.5
            assert f["responses"].attrs["offset"] == -20.0


def test_xarray_opens_the_output_with_named_dims(tmp_path, capsys, device_spec):
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")  # xarray's engine="h5netcdf" needs it
    np.save(tmp_path / "v.npy", random_volume((5, 6, 7, 2), "uint8"))
    pipeline = write_pipeline(
        tmp_path, [{"name": "a", "type": "box"}, {"type": "log", "sigma": 1}], device=device_spec
    )
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    with xr.open_dataset(tmp_path / "out/v.h5", engine="h5netcdf") as ds:
        assert ds["responses"].dims == ("filter", "x", "y", "z", "t")
        assert list(ds["filter"].values) == ["a", "log_1"]
        assert ds["responses"].sel(filter="a").shape == (5, 6, 7, 2)


# -- several inputs, resuming, reports ----------------------------------------------------
def test_rerun_skips_complete_outputs_and_overwrite_recomputes(tmp_path, capsys, device_spec):
    for name in ("a", "b"):
        np.save(tmp_path / f"{name}.npy", random_volume((6, 5, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, [{"type": "box"}], device=device_spec)
    code, out, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    assert out.count("done ") == 2 and "total" in out
    (tmp_path / "out/a.h5").unlink()
    before = (tmp_path / "out/b.h5").stat().st_mtime_ns
    code, out, _ = volconv("run", pipeline, "--report", tmp_path / "r.json", capsys=capsys)
    assert code == 0
    assert "skipped" in out and "b.npy" in out and out.count("done ") == 1
    assert (tmp_path / "out/b.h5").stat().st_mtime_ns == before
    statuses = {Path(e["source"]).name: e["status"] for e in json.loads(
        (tmp_path / "r.json").read_text())["inputs"]}  # fmt: skip
    assert statuses == {"a.npy": "done", "b.npy": "skipped"}
    code, out, _ = volconv("run", pipeline, "--overwrite", capsys=capsys)
    assert code == 0 and out.count("done ") == 2
    assert (tmp_path / "out/b.h5").stat().st_mtime_ns != before
    code, out, _ = volconv("validate", pipeline, capsys=capsys)
    assert code == 0 and out.count("complete: skipped") == 2


def test_slabs_stream_unless_the_depth_is_forced(tmp_path, capsys, device_spec, monkeypatch):
    """Several slabs per frame, so reading, computing and writing overlap, where the frame
    holds enough voxels (MIN_STREAM_VOXELS; a smaller one is one slab); run.slab_depth wins."""
    from volconv.plan import direct

    np.save(tmp_path / "v.npy", random_volume((70, 4, 5), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX_FILTERS, device=device_spec)
    code, out, _ = volconv("validate", pipeline, capsys=capsys)
    assert code == 0 and "slab depth 70 (1 slabs)" in out
    monkeypatch.setattr(direct, "MIN_STREAM_VOXELS", 4 * 5)
    code, out, _ = volconv("validate", pipeline, capsys=capsys)
    assert code == 0 and "slab depth 32 (3 slabs)" in out
    code, out, _ = volconv("validate", pipeline, "--set", "run.slab_depth=70", capsys=capsys)
    assert code == 0 and "slab depth 70 (1 slabs)" in out


BOX_FILTERS = [{"type": "box"}]


# -- host memory (docs/contract.md, "Memory") ------------------------------------------------------
RSS_SCRIPT = """
import resource, sys
from volconv.config import load
from volconv.run.pipeline import run
small, big = sys.argv[1:3]
run(load(small))  # warm: imports, the OpenCL context, every program built
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result = run(load(big))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(after - before, result.reports[0].status)
"""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_volume_larger_than_host_memory_runs_within_it(tmp_path, dtype, device_spec):
    """16 MiB of float32 input and 128 MiB of responses through a 32 MiB bound (float16:
    made on the device, pinned buffers of float16: deeper slabs in the same bound). A float
    input's bound keeps room for the NaN/Inf override (`memory.nonfinite_bytes`)."""
    bound = 32 * 2**20
    np.save(tmp_path / "big.npy", RNG.standard_normal((128, 128, 256)).astype(np.float32))
    np.save(tmp_path / "small.npy", RNG.standard_normal((128, 128, 256))[:4].astype(np.float32))
    filters = [{"type": "box", "size": 3}, {"type": "gaussian", "sigma": 1.0, "size": 5}]
    runs = {}
    for name in ("small", "big"):
        (tmp_path / name).mkdir()
        runs[name] = write_pipeline(
            tmp_path / name, filters, input={"paths": [str(tmp_path / f"{name}.npy")]},
            run={"host_memory": bound}, output={"dtype": dtype}, device=device_spec,
        )  # fmt: skip
    validate = subprocess_run(["validate", runs["big"]])
    assert "host memory" in validate and f"of {bound / 2**20:.0f} MiB" in validate
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, runs["small"], runs["big"]],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    grown, status = done.stdout.split()
    assert status == "done"
    assert int(grown) <= bound, f"max RSS grew by {int(grown) / 2**20:.1f} MiB"
    with h5py.File(tmp_path / "big" / "out" / "big.h5") as f:
        assert f.attrs["complete"] and f["responses"].shape == (2, 128, 128, 256)


def test_pinned_slab_buffers_are_bounded_unless_the_depth_is_given(
    tmp_path, monkeypatch, device_spec
):
    """A slab's pinned buffer holds at most MAX_PINNED_BYTES (page-locking costs at start and
    in RSS); an expert's slab_depth is taken as given; the result is the same either way."""
    from volconv.config import load
    from volconv.run import jobs, memory, pipeline

    volume = random_volume((40, 12, 10), "uint8")
    np.save(tmp_path / "a.npy", volume)
    filters = [{"type": "box", "size": 3}, {"type": "gaussian", "sigma": 1.0, "size": 5}]
    row = len(filters) * 12 * 10 * 4  # float32 responses, one row of slab
    monkeypatch.setattr(memory, "MAX_PINNED_BYTES", 3 * row)
    capped = write_pipeline(tmp_path, filters, device=device_spec)
    cfg = load(capped)
    (job,) = jobs.plan_jobs(cfg, jobs.choose_device(cfg))
    assert job.plan.slab_depth == 3
    given = load(capped, ("run.slab_depth=20",))
    (job,) = jobs.plan_jobs(given, jobs.choose_device(given))
    assert job.plan.slab_depth == 20
    (record,) = pipeline.run(cfg).reports
    assert record.slab_depth == 3 and record.n_slabs == 14
    with check_output(tmp_path / "out" / "a.h5", volume.astype(float)):
        pass


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_device_memory_counts_a_frame_kept_on_the_device(tmp_path, dtype, device_spec):
    """An integer frame read whole is kept on a GPU (up to `engine.frame_bytes`) beside the
    plan's buffers: validate's device memory counts it; a float frame goes as rows."""
    from volconv.config import load
    from volconv.run import jobs, memory

    volume = random_volume((20, 12, 10), dtype)
    np.save(tmp_path / "a.npy", volume)
    cfg = load(write_pipeline(tmp_path, [{"type": "box", "size": 3}], device=device_spec))
    device = jobs.choose_device(cfg)
    (job,) = jobs.plan_jobs(cfg, device)
    assert job.whole_frames  # a .npy maps
    kept = volume.nbytes if dtype == "uint8" else 0
    # a float source's NaN/Inf counting convolvers: the data may hold them
    plan = job.plan.device_bytes + memory.nonfinite_bytes(job, job.plan.slab_depth, device)[1]
    assert (plan > job.plan.device_bytes) == (dtype == "float32")
    assert memory.device_bytes(job, device, volume.nbytes) == plan + kept
    assert memory.device_bytes(job, device, volume.nbytes - 1) == plan
    assert job.device_bytes == memory.device_bytes(job, device, frame_bytes(device))


def subprocess_run(args: list) -> str:
    done = subprocess.run([sys.executable, "-m", "volconv", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_input_values_beyond_float32_are_an_error_naming_the_input(tmp_path, capsys):
    big = np.full((6, 5, 4), 1.0)
    big[3, 2, 1] = 1e300  # finite in float64; inf in float32, which volconv computes in
    np.save(tmp_path / "big.npy", big)
    data = np.ones((6, 5, 4), np.int16)
    data[0, 0, 0] = 4
    image = nib.Nifti1Image(data, np.eye(4))
    image.header.set_slope_inter(1e38, 0)  # scaled: 1e38 * 1 fits, 1e38 * 4 does not
    nib.save(image, tmp_path / "scaled.nii")
    for name in ("big.npy", "scaled.nii"):
        pipeline = write_pipeline(tmp_path, [{"type": "box"}], input={"paths": [name]})
        code, _, err = volconv("run", pipeline, capsys=capsys)
        assert code == 1, err  # found while reading, after work began (docs/contract.md)
        assert err.count("\n") == 1 and name in err and "beyond float32's range" in err, err
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_corrupt_gzip_input_fails_alone_and_leaves_no_output(tmp_path, capsys):
    data = random_volume((16, 12, 10), "int16")
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "a.nii")
    packed = bytearray(gzip.compress((tmp_path / "a.nii").read_bytes(), 1))
    packed[len(packed) // 2 : len(packed) // 2 + 64] = bytes(64)  # CRC now wrong
    (tmp_path / "b.nii.gz").write_bytes(bytes(packed))
    pipeline = write_pipeline(tmp_path, [{"type": "box"}], input={"paths": ["*.nii*"]})
    report = tmp_path / "report.json"
    # found mid-read (the CRC is checked beside the work): that input fails, not the run
    code, out, err = volconv("run", pipeline, "--report", report, capsys=capsys)
    assert code == 1, err
    assert "b.nii.gz: the gzip stream is corrupt" in " ".join(out.split()), out
    records = {Path(r["source"]).name: r for r in json.loads(report.read_text())["inputs"]}
    assert records["b.nii.gz"]["status"] == "failed"
    assert "gzip stream is corrupt" in records["b.nii.gz"]["reason"]
    assert records["a.nii"]["status"] == "done"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.h5"]  # b: nothing left
    with check_output(tmp_path / "out" / "a.h5", data.astype(float)):
        pass


def test_features_are_stored_after_the_responses_and_resume_by_their_parameters(
    tmp_path, capsys, device_spec
):
    """N counts the outputs (responses, then features); the responses only features read are
    not stored; a complete output made with other feature parameters is refused."""
    volume = random_volume((14, 11, 9), "float32")
    np.save(tmp_path / "v.npy", volume)
    filters = [{"type": "gaussian", "sigma": 1.0, "order": [1, 0, 0], "size": 9, "name": "dx"}]
    bank = {"boundary": "nearest", "feature": [
        {"type": "gradient_magnitude", "sigma": 1.0, "name": "gm"},
        {"type": "hessian_eigenvalues", "sigma": 0.8, "name": "h"},
        {"type": "structure_tensor_eigenvalues", "sigma": 0.7, "rho": 1.2, "name": "st"},
    ]}  # fmt: skip
    path = write_pipeline(tmp_path, filters, bank=bank, run={"slab_depth": 4}, device=device_spec)
    code, out, err = volconv("validate", path, capsys=capsys)
    assert code == 0, err
    assert "bank     N = 8" in out
    assert "feature  h: hessian_eigenvalues(sigma=0.8, truncate=4) -> h_0, h_1, h_2" in out
    code, out, err = volconv("run", path, capsys=capsys)
    assert code == 0, err
    with h5py.File(tmp_path / "out" / "v.h5") as f:
        names = [n.decode() for n in f["filter"][()]]
        stored = f["responses"][()]
        described = json.loads(f.attrs["features"])
    assert names == ["dx", "gm", "h_0", "h_1", "h_2", "st_0", "st_1", "st_2"]
    assert [d["name"] for d in described] == ["gm", "h", "st"]
    assert described[2]["rho"] == [1.2, 1.2, 1.2]
    v = volume.astype(np.float64)
    m = float(np.abs(v).max())
    dx = ndi.gaussian_filter(v, 1.0, (1, 0, 0), mode="nearest")
    assert np.abs(stored[0] - dx).max() <= 1e-5 * m
    gm = ndi.gaussian_gradient_magnitude(v, 1.0, mode="nearest")
    assert np.abs(stored[1] - gm).max() <= 3e-5 * m
    hess = np.empty((*v.shape, 3, 3))
    for a in range(3):
        for b in range(3):
            order = [0, 0, 0]
            order[a] += 1
            order[b] += 1
            hess[..., a, b] = ndi.gaussian_filter(v, 0.8, order, mode="nearest")
    ref = np.moveaxis(np.linalg.eigvalsh(hess)[..., ::-1], -1, 0)
    assert np.abs(stored[2:5] - ref).max() <= 1e-4 * m
    g = [ndi.gaussian_filter(v, 0.7, o, mode="nearest") for o in np.eye(3, dtype=int)]
    st = np.empty((*v.shape, 3, 3))
    for a in range(3):
        for b in range(3):
            st[..., a, b] = ndi.gaussian_filter(g[a] * g[b], 1.2, mode="nearest")
    ref = np.moveaxis(np.linalg.eigvalsh(st)[..., ::-1], -1, 0)
    assert np.abs(stored[5:] - ref).max() <= 1e-4 * float(np.abs(ref).max())
    code, out, err = volconv("run", path, capsys=capsys)  # the same: skipped
    assert code == 0 and "skipped" in (out + err).lower(), out + err
    bank["feature"][1]["sigma"] = 0.9
    path = write_pipeline(tmp_path, filters, bank=bank, run={"slab_depth": 4}, device=device_spec)
    code, out, err = volconv("run", path, capsys=capsys)
    assert code == 2 and "features" in err, err
