"""`volconv run` and `volconv validate` as users meet them: exit statuses, one-line messages for
every mistake, and interrupted runs (SIGINT, SIGKILL) that leave nothing complete-looking and
resume (inside a volume: tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import h5py
import matplotlib.pyplot as plt
import nibabel as nib
import numpy as np
import pyopencl as cl
import pytest
from test_pipeline import DEVICE, ROOT, check_output, random_volume, volconv, write_pipeline

from volconv import convolve_bank
from volconv.checks import spec_tolerance
from volconv.cli import UserError
from volconv.config import dump_toml
from volconv.device.devices import select_device

BOX = [{"type": "box"}]
BUILDING = "volconv: building kernels"  # a first run's one line on a cold cache


def assert_one_line_error(code: int, out: str, err: str, *words: str) -> str:
    """Exit status 2, one line on stderr naming ``words``, no traceback."""
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err + out
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def scan(tmp_path) -> Path:
    np.save(tmp_path / "scan.npy", random_volume((6, 5, 4), "uint8"))
    return tmp_path / "scan.npy"


# -- every mistake a user makes: exit 2 and one line --------------------------------------
TOML_MISTAKES = {
    "bad TOML syntax": ("[input]\npaths = [scan.npy\n", ["not valid TOML", "line"]),
    "unknown section": ("[inputs]\npaths = []\n", ["[inputs]", "did you mean [input]"]),
    "no [input]": ("[bank]\n[[bank.filter]]\ntype = 'box'\n", ["missing section [input]"]),
    "no input.paths": ("[input]\n[bank]\n[[bank.filter]]\ntype = 'box'\n", ["input.paths"]),
}


@pytest.mark.parametrize("case", TOML_MISTAKES, ids=list(TOML_MISTAKES))
def test_broken_files(tmp_path, capsys, case):
    text, words = TOML_MISTAKES[case]
    (tmp_path / "p.toml").write_text(text)
    for command in ("run", "validate"):
        assert_one_line_error(
            *volconv(command, tmp_path / "p.toml", capsys=capsys), "p.toml", *words
        )


MISTAKES = {
    # name: (filters, sections, --set items, words in the message)
    "unknown key, suggested": (
        BOX,
        {"bank": {"boundry": "wrap"}},
        [],
        ["bank.boundry", "did you mean bank.boundary"],
    ),
    "unknown key in a filter": (
        [{"type": "box", "szie": 3}],
        {},
        [],
        ["bank.filter[0].szie", "size"],
    ),
    "unknown boundary": (
        BOX,
        {"bank": {"boundary": "reflective"}},
        [],
        ["bank.boundary", "'reflective'", "reflect"],
    ),
    "cval NaN": (BOX, {"bank": {"cval": float("nan")}}, [], ["bank.cval", "nan"]),
    "cval not a number": (BOX, {"bank": {"cval": "zero"}}, [], ["bank.cval", "'zero'"]),
    "empty bank": ([], {}, [], ["bank.filter", "empty"]),
    "more than 64 filters": ([{"type": "box"}] * 65, {}, [], ["65 filters", "at most 64"]),
    "duplicate names": (
        [{"name": "a", "type": "box"}, {"name": "a", "type": "log", "sigma": 1}],
        {},
        [],
        ["bank.filter[1].name", "duplicate", "'a'"],
    ),
    "negative sigma": ([{"type": "gaussian", "sigma": -1}], {}, [], ["bank.filter[0].sigma", "-1"]),
    "unknown filter type": (
        [{"type": "gauss", "sigma": 1}],
        {},
        [],
        ["bank.filter[0].type", "gaussian"],
    ),
    "even size": (BOX, {"bank": {"size": 4}}, [], ["bank.size", "odd"]),
    "missing custom kernel": (
        [{"type": "custom", "path": "nope.npy"}],
        {},
        [],
        ["bank.filter[0].path", "nope.npy"],
    ),
    "missing input": (
        BOX,
        {"input": {"paths": ["nope.nii.gz"]}},
        [],
        ["nope.nii.gz", "no such file"],
    ),
    "glob matches nothing": (
        BOX,
        {"input": {"paths": ["scans/*.nii"]}},
        [],
        ["scans/*.nii", "matches no file"],
    ),
    "not a volume": (BOX, {"input": {"paths": ["pipeline.toml"]}}, [], ["pipeline.toml", "read"]),
    "missing HDF5 dataset": (
        BOX,
        {"input": {"paths": ["v.h5:/nope"]}},
        [],
        ["v.h5", "/nope", "/data"],
    ),
    "bad output dtype": (
        BOX,
        {"output": {"dtype": "float64"}},
        [],
        ["output.dtype", "float64", "uint8"],
    ),
    "bad compression": (BOX, {"output": {"compression": "zip"}}, [], ["output.compression", "zip"]),
    "scale without uint8": (BOX, {"output": {"scale": 2.0}}, [], ["output.scale", "uint8"]),
    "zero scale": (BOX, {"output": {"dtype": "uint8", "scale": 0}}, [], ["output.scale", "0"]),
    "unknown template field": (
        BOX,
        {"output": {"path": "out/{name}.h5"}},
        [],
        ["output.path", "{name}", "{stem}"],
    ),
    "unbalanced brace": (
        BOX,
        {"output": {"path": "out/{stem.h5"}},
        [],
        ["output.path", "out/{stem.h5"],
    ),
    "one output for two inputs": (
        BOX,
        {"input": {"paths": ["*.npy"]}, "output": {"path": "out.h5"}},
        [],
        ["output.path", "out.h5", "{stem}"],
    ),
    "output is a folder": (BOX, {"output": {"path": "folder"}}, [], ["folder"]),
    "bad slab_depth": (BOX, {"run": {"slab_depth": 0}}, [], ["run.slab_depth", "0"]),
    "unknown device": (BOX, {}, ["run.device=no-such-device"], ["run.device", "no-such-device"]),
    "bad --set syntax": (BOX, {}, ["bank.boundary"], ["--set", "SECTION.KEY=VALUE"]),
    "--set without section": (BOX, {}, ["boundary=wrap"], ["--set", "SECTION.KEY=VALUE"]),
    "--set of a missing filter": (
        BOX,
        {},
        ["bank.filter[3].sigma=1"],
        ["bank.filter[3]", "1 entries"],
    ),
    "--set unknown key": (BOX, {}, ["output.pth=x.h5"], ["output.pth", "output.path"]),
}


@pytest.mark.parametrize("case", MISTAKES, ids=list(MISTAKES))
def test_every_mistake_is_exit_2_and_one_line(tmp_path, scan, capsys, case):
    filters, sections, sets, words = MISTAKES[case]
    np.save(tmp_path / "other.npy", np.zeros((3, 3, 3), np.uint8))
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f["data"] = np.zeros((3, 3, 3), np.float32)
    (tmp_path / "folder").mkdir()
    sections = {"input": {"paths": ["scan.npy"]}, **sections}
    pipeline = write_pipeline(tmp_path, filters, **sections)
    args = [a for s in sets for a in ("--set", s)]
    assert_one_line_error(*volconv("validate", pipeline, *args, capsys=capsys), *words)
    assert_one_line_error(*volconv("run", pipeline, *args, capsys=capsys), *words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_missing_pipeline_file_and_bad_device_option(tmp_path, scan, capsys):
    assert_one_line_error(
        *volconv("run", tmp_path / "nope.toml", capsys=capsys), "nope.toml", "not found"
    )
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    assert_one_line_error(
        *volconv("run", pipeline, "--device", "9:9", capsys=capsys), "--device '9:9'"
    )
    words = ("--report", "no/such/folder")
    report = tmp_path / "no/such/folder/r.json"
    assert_one_line_error(*volconv("run", pipeline, "--report", report, capsys=capsys), *words)


def test_a_file_that_is_not_a_volconv_output_is_kept(tmp_path, scan, capsys):
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    (tmp_path / "out").mkdir()
    (tmp_path / "out/scan.h5").write_text("my notes")
    for command in ("validate", "run"):
        code, out, err = volconv(command, pipeline, capsys=capsys)
        assert_one_line_error(
            code, out, err, "out/scan.h5", "not a complete volconv output", "--overwrite"
        )
    assert (tmp_path / "out/scan.h5").read_text() == "my notes"
    code, _, err = volconv("run", pipeline, "--overwrite", capsys=capsys)
    assert code == 0, err
    check_output(tmp_path / "out/scan.h5", np.load(scan).astype(np.float64)).close()


def test_debug_shows_the_traceback(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[input\n")
    with pytest.raises(UserError, match="not valid TOML"):  # main() lets it through
        volconv("--debug", "run", tmp_path / "p.toml", capsys=capsys)


def test_validate_prints_the_plan(tmp_path, scan, capsys, device_spec):
    np.save(tmp_path / "t.npy", random_volume((4, 5, 6, 3), "int16"))
    filters = [
        {"name": "s", "type": "gaussian", "sigma": 1, "size": 5},
        {"type": "sobel", "axis": 1},
    ]
    pipeline = write_pipeline(tmp_path, filters, run={"slab_depth": 2}, device=device_spec)
    code, out, err = volconv("validate", pipeline, capsys=capsys)
    assert code == 0, err
    for words in ("N = 2", "s (gaussian)     separable 5x5x5: 1 term",
                  "sobel_1 (sobel)  direct 3x3x3 (27 taps",
                  "scan.npy", "6x5x4 uint8", "t.npy", "4x5x6x3 int16",
                  "kernels 5x5x5", "slab depth 2", "(3 slabs)", "(6 slabs)", "MiB", "(new)",
                  str(tmp_path / "out/scan.h5"), str(tmp_path / "out/t.h5")):  # fmt: skip
        assert words in out, words
    assert not (tmp_path / "out").exists()  # nothing computed, nothing written


# -- interrupted runs ---------------------------------------------------------------------
def slow_pipeline(tmp_path: Path, device: str = DEVICE) -> Path:
    """Two inputs: a.npy (quick) then b.npy (1500 slabs of one row: seconds, so a signal sent
    once its temporary file shows up lands mid-run even with warm kernel caches), on
    ``device``."""
    np.save(tmp_path / "a.npy", random_volume((6, 5, 4), "uint8"))
    np.save(tmp_path / "b.npy", random_volume((1500, 48, 48), "uint8"))
    filters = [{"type": "gaussian", "sigma": 2, "order": [0, 0, i % 3]} for i in range(8)]
    for i, f in enumerate(filters):
        f["name"] = f"g{i}"
    data = {
        "input": {"paths": ["a.npy", "b.npy"]},
        "bank": {"size": 7, "filter": filters},
        "output": {"path": "out/{stem}.h5"},
        "run": {"device": device, "slab_depth": 1},
    }
    path = tmp_path / "slow.toml"
    path.write_text(dump_toml(data))
    return path


def says_complete(path: Path) -> bool:
    """Whether ``path`` opens as HDF5 with ``complete = True`` (a killed writer's file may
    not open at all, or holds half-written objects)."""
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get("complete", False))
    except (OSError, KeyError, ValueError):
        return False


def start(pipeline: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_b_in_progress(proc: subprocess.Popen, out: Path, timeout: float = 60) -> None:
    """Until a.h5 is complete and b.npy's temporary file exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (out / "a.h5").exists() and list(out.glob(".b.h5.partial-*")):
            return
        time.sleep(0.02)
    proc.kill()
    pytest.fail("the run did not reach b.npy")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_run_leaves_nothing_complete_and_resumes(tmp_path, capsys, how, device_spec):
    pipeline = slow_pipeline(tmp_path, device=device_spec)
    out = tmp_path / "out"
    proc = start(pipeline)
    wait_for_b_in_progress(proc, out)
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in err
    assert not (out / "b.h5").exists()  # nothing that looks finished
    # the partial output stays for a rerun to resume (volconv.run.resume; tests/test_resume.py),
    # in its private folder, and its file does not say complete
    (temp,) = out.glob(".b.h5.partial-*")
    assert temp.is_dir() and not says_complete(temp / "b.h5")

    code, text, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    assert "skipped" in text and "a.npy" in text and "done " in text and "b.npy" in text
    with h5py.File(out / "b.h5") as f:  # scipy is slow at this size; the paths are tested
        assert f.attrs["complete"]
        kernels = f["kernels"][()]
        whole = convolve_bank(np.load(tmp_path / "b.npy"), kernels, device=device_spec)
        for k, (stored, direct) in enumerate(zip(f["responses"][()], whole, strict=True)):
            # both within the contract's tolerance of scipy, so within twice it of each other
            assert np.max(np.abs(stored - direct)) <= 2 * spec_tolerance(kernels[k], 255), k
    assert list(out.glob(".*partial*")) == []  # the killed run's leftover is gone too
    assert sorted(p.name for p in out.iterdir()) == ["a.h5", "b.h5"]


def test_python_m_volconv(tmp_path, scan, device_spec):
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]}, device=device_spec)
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run(
        [sys.executable, "-m", "volconv", "run", str(pipeline)],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "of peak" in run.stdout and "GFLOP/s" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--set", "bank.size=x"],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "bank.size" in bad.stderr


# -- reruns: what counts as done (contract, "Commands": same input, bank, boundary, cval, dtype) ---
def test_a_changed_pipeline_over_a_complete_output_is_exit_2(tmp_path, scan, capsys):
    pipeline = write_pipeline(tmp_path, BOX)
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    code, out, _ = volconv("run", pipeline, capsys=capsys)
    assert code == 0 and "skipped" in out  # the same pipeline: done already

    for change, words in (
        ("bank.boundary=wrap", ("boundary", "'reflect'", "'wrap'")),
        ("bank.size=5", ("bank",)),
        ("output.dtype=float16", ("output dtype",)),
    ):
        code, out, err = volconv("run", pipeline, "--set", change, capsys=capsys)
        assert_one_line_error(code, out, err, str(tmp_path / "out" / "scan.h5"), "--overwrite",
                              *words)  # fmt: skip
        code, out, err = volconv("validate", pipeline, "--set", change, capsys=capsys)
        assert_one_line_error(code, out, err, *words)

    code, _, err = volconv("run", pipeline, "--set", "bank.boundary=wrap", "--overwrite",
                           capsys=capsys)  # fmt: skip
    assert code == 0, err
    with check_output(tmp_path / "out" / "scan.h5", np.load(scan).astype(float), "wrap"):
        pass

    np.save(scan, random_volume((6, 5, 4), "uint8"))  # new voxels under the same name
    code, out, err = volconv("run", pipeline, "--set", "bank.boundary=wrap", capsys=capsys)
    assert_one_line_error(code, out, err, "input", "SHA-256")


def test_two_runs_of_one_pipeline_at_once_both_succeed(tmp_path, device_spec):
    for i in range(6):
        np.save(tmp_path / f"v{i}.npy", random_volume((24, 20, 16), "uint8"))
    pipeline = write_pipeline(
        tmp_path, [{"type": "gaussian", "sigma": 1.0}], run={"slab_depth": 4}, device=device_spec
    )
    runs = [start(pipeline) for _ in range(2)]
    for proc in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"v{i}.h5" for i in range(6)]  # no temps
    for i in range(6):
        with check_output(out / f"v{i}.h5", np.load(tmp_path / f"v{i}.npy").astype(float)):
            pass


# -- Ctrl-C: at once, saying what was kept -----------------------------------------------
def on_a_cpu(spec: str = DEVICE) -> bool:
    return bool(select_device(spec).type & cl.device_type.CPU)


def test_ctrl_c_stops_within_two_seconds_during_a_long_kernel(tmp_path, device_spec):
    # One slab whose single launch takes seconds on a CPU device: the run must not wait for it.
    if not on_a_cpu(device_spec):
        pytest.skip("device-specific: needs a kernel launch of seconds, which a CPU device runs "
                    "and a GPU (an H100) finishes before Ctrl-C lands")  # fmt: skip
    np.save(tmp_path / "a.npy", random_volume((8, 8, 8), "uint8"))
    np.save(tmp_path / "b.npy", random_volume((96, 96, 96), "uint8"))
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(tmp_path / f"k{i}.npy", rng.random((31, 31, 31)))
    filters = [{"type": "custom", "name": f"k{i}", "path": f"k{i}.npy"} for i in range(8)]
    data = {
        "input": {"paths": ["a.npy", "b.npy"]},
        "bank": {"filter": filters},
        "output": {"path": "out/{stem}.h5"},
        "run": {"device": device_spec},
    }
    pipeline = tmp_path / "long.toml"
    pipeline.write_text(dump_toml(data))
    proc = start(pipeline)
    wait_for_b_in_progress(proc, tmp_path / "out", timeout=120)
    time.sleep(0.5)  # the kernel is running now
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert took < 2.0, f"stopped {took:.1f} s after Ctrl-C"
    assert "1 output(s) complete and kept" in err and "run the same command again" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    kept = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert kept[1:] == ["a.h5"] and kept[0].startswith(".b.h5.partial-")  # b.npy: to resume


# -- smaller things users meet ------------------------------------------------------------
def test_pyopencl_ctx_naming_no_device_is_exit_2(tmp_path, scan):
    pipeline = write_pipeline(tmp_path, BOX, run={"device": "auto"})
    env = {**os.environ, "PYOPENCL_CTX": "7"}
    run = subprocess.run(
        [sys.executable, "-m", "volconv", "validate", str(pipeline)],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert_one_line_error(run.returncode, run.stdout, run.stderr, "PYOPENCL_CTX", "'7'")


def test_output_name_collision_hint_names_what_is_missing(tmp_path, capsys):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        np.save(tmp_path / sub / "scan.npy", random_volume((4, 4, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["*/scan.npy"]})
    code, out, err = volconv("validate", pipeline, capsys=capsys)
    line = assert_one_line_error(code, out, err, "{parent}")
    assert "use {stem}" not in line  # {stem} is already in output.path


def test_a_closed_stdout_does_not_stop_the_run(tmp_path, device_spec):
    for i in range(3):
        np.save(tmp_path / f"v{i}.npy", random_volume((6, 5, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX, device=device_spec)
    proc = start(pipeline)
    proc.stdout.readline()  # as `volconv run ... | head -1` does
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert all(ln.startswith(BUILDING) for ln in err.splitlines()), err  # nothing else
    for i in range(3):
        assert says_complete(tmp_path / "out" / f"v{i}.h5")


def test_the_file_and_the_report_record_the_same_wall_time(tmp_path, scan, capsys, device_spec):
    pipeline = write_pipeline(tmp_path, BOX, device=device_spec)
    report = tmp_path / "report.json"
    assert volconv("run", pipeline, "--report", report, capsys=capsys)[0] == 0
    (entry,) = json.loads(report.read_text())["inputs"]
    with h5py.File(tmp_path / "out" / "scan.h5") as f:
        assert f.attrs["wall_seconds"] == entry["wall_seconds"] == entry["stages"]["wall"]
        assert f"{entry['gflop']:.3g}" != "0"


def test_show_draws_every_response(tmp_path, scan, capsys, device_spec):
    pipeline = write_pipeline(
        tmp_path, [{"type": "box"}, {"type": "gaussian", "sigma": 1}], device=device_spec
    )
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    code, out, err = volconv("show", tmp_path / "out" / "scan.h5", capsys=capsys)
    assert code == 0, err
    png = tmp_path / "out" / "scan.png"
    assert f"wrote {png}" in out
    image = plt.imread(png)
    assert image.ndim == 3 and image.shape[0] > 300  # a row per filter, 3 columns
    assert image[..., :3].std() > 0.05  # slices drawn, not a blank page
    code, out, err = volconv("show", tmp_path / "missing.h5", capsys=capsys)
    assert_one_line_error(code, out, err, "missing.h5", "no such file")
    code, out, err = volconv("show", scan, capsys=capsys)
    assert_one_line_error(code, out, err, "scan.npy")
    code, out, err = volconv("show", tmp_path / "out", capsys=capsys)
    assert_one_line_error(code, out, err, "out: is a folder")
    os.mkfifo(tmp_path / "fifo.h5")
    code, out, err = volconv("show", tmp_path / "fifo.h5", capsys=capsys)
    assert_one_line_error(code, out, err, "fifo.h5: is a FIFO")
    (tmp_path / "pictures").mkdir()
    for where, written in (("pictures", "pictures/scan.png"), ("noext", "noext")):
        code, out, err = volconv("show", tmp_path / "out/scan.h5", "--png", tmp_path / where,
                                 capsys=capsys)  # fmt: skip
        assert code == 0 and out.strip() == f"wrote {tmp_path / written}", (out, err)
        assert plt.imread(tmp_path / written, format="png").ndim == 3


def test_devices_shows_the_probe_only_when_asked_or_cached(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    code, out, _ = volconv("devices", capsys=capsys)
    assert code == 0 and "FP32 peak" in out and "FMA probe" not in out  # no probe by itself
    code, out, _ = volconv("devices", "--probe", capsys=capsys)
    assert code == 0 and "FMA probe" in out and "measured now" in out and "GB/s" in out
    code, out, _ = volconv("devices", capsys=capsys)
    assert code == 0 and "(cached; --probe measures again)" in out


# -- disk full, read-only folders and truncated inputs, as `run` and `validate` meet them ---
def test_disk_full_is_exit_1_in_one_line_and_a_rerun_finishes(tmp_path, tmpfs):
    disk = tmpfs("disk", "size=3m")
    np.save(tmp_path / "a.npy", random_volume((8, 8, 8), "uint8"))  # 2 KiB out: fits
    np.save(tmp_path / "b.npy", random_volume((64, 64, 64), "uint8"))  # 1 MiB out each
    (disk / "filler").write_bytes(b"\0" * (2 * 2**20))
    filters = [{"type": "box", "name": f"b{i}"} for i in range(2)]
    pipeline = write_pipeline(tmp_path, filters, output={"path": f"{disk}/out/{{stem}}.h5"})
    run = subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 1, run.stderr
    err = "".join(ln for ln in run.stderr.splitlines(True) if not ln.startswith(BUILDING))
    assert err.count("\n") == 1, run.stderr
    assert "b.h5" in err and "No space left on device" in err
    assert sorted(p.name for p in (disk / "out").iterdir()) == ["a.h5"]  # kept; no temporary
    assert says_complete(disk / "out" / "a.h5")
    (disk / "filler").unlink()
    rerun = subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert "skipped" in rerun.stdout and "done" in rerun.stdout
    with check_output(disk / "out" / "b.h5", np.load(tmp_path / "b.npy").astype(float)):
        pass


def test_validate_finds_what_run_would_refuse(tmp_path, tmpfs, capsys):
    ro = tmpfs("ro", "size=1m,ro")
    np.save(tmp_path / "a.npy", random_volume((6, 5, 4), "uint8"))
    for out in (f"{ro}/{{stem}}.h5", f"{ro}/missing/{{stem}}.h5"):
        pipeline = write_pipeline(tmp_path, BOX, output={"path": out})
        code, text, err = volconv("validate", pipeline, capsys=capsys)
        assert_one_line_error(code, text, err, str(ro), "read-only")
    # a truncated NIfTI as the second input: found before any work, by validate as by run
    img = nib.Nifti1Image(random_volume((16, 16, 16), "uint8"), np.eye(4))
    for suffix in (".nii", ".nii.gz"):
        folder = tmp_path / suffix.replace(".", "_")
        folder.mkdir()
        nib.save(img, folder / f"a{suffix}")
        nib.save(img, folder / f"b{suffix}")
        whole = (folder / f"b{suffix}").read_bytes()
        (folder / f"b{suffix}").write_bytes(whole[: len(whole) * 2 // 3])
        pipeline = write_pipeline(folder, BOX, input={"paths": [f"a{suffix}", f"b{suffix}"]})
        for command in ("validate", "run"):
            code, text, err = volconv(command, pipeline, capsys=capsys)
            assert_one_line_error(code, text, err, f"b{suffix}")
            assert not (folder / "out").exists()  # nothing written, not even a.h5


def test_uint8_output_warns_once_about_saturation(tmp_path, capsys, device_spec):
    for i in range(2):
        np.save(tmp_path / f"v{i}.npy", random_volume((6, 5, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, [{"type": "box", "size": 3}, {"type": "sobel", "axis": 0}],
                              output={"dtype": "uint8"}, device=device_spec)  # fmt: skip
    code, out, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    assert "warning:" not in out  # warnings go to stderr, the summary lines to stdout
    assert err.count("warning:") == 1 and "voxels of" in err and "output.scale" in err


# -- files a run reads or writes are never replaced ----------------------------------------
def _kernel_pipeline(tmp_path: Path) -> Path:
    (tmp_path / "k").mkdir()
    np.save(tmp_path / "k/mine.npy", np.ones((3, 3, 3)) / 27)
    np.save(tmp_path / "oscan.npy", random_volume((6, 5, 4), "uint8"))
    return write_pipeline(tmp_path, [*BOX, {"type": "custom", "path": "k/mine.npy"}],
                          input={"paths": ["scan.npy", "oscan.npy"]})  # fmt: skip


REPORT_TARGETS = {  # --report FILE: the words of the message
    "scan.npy": ["the input", "scan.npy"],
    "out/scan.h5": ["output.path", "the --report file"],  # found by the output check
    "pipeline.toml": ["the pipeline file"],
    "k/mine.npy": ["the custom kernel of bank.filter[1]"],
    "k": ["is a folder"],
    "notes.txt": ["not a volconv report", "it holds text"],
    "oscan.h5": ["not a volconv report", "it holds a volconv output"],  # another run's
}


@pytest.mark.parametrize("target", REPORT_TARGETS, ids=list(REPORT_TARGETS))
def test_a_report_never_replaces_another_file(tmp_path, scan, capsys, target):
    pipeline = _kernel_pipeline(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes")
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    (tmp_path / "out/oscan.h5").rename(tmp_path / "oscan.h5")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = volconv("run", pipeline, "--overwrite", "--report", tmp_path / target,
                             capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "--report", target, *REPORT_TARGETS[target])
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert "scan" not in out  # refused before any work
    # a report is replaced by the next one
    report = tmp_path / "r.json"
    for _ in range(2):
        assert volconv("run", pipeline, "--report", report, capsys=capsys)[0] == 0
        assert "inputs" in json.loads(report.read_text())


OUTPUT_TARGETS = {  # output.path, --report: the words of the message
    "pipeline": ("pipeline.toml", None, ["the pipeline file"]),
    "custom kernel": ("k/mine.npy", None, ["the custom kernel of bank.filter[1]"]),
    "another input": ("o{stem}.npy", None, ["the input", "oscan.npy"]),  # scan.npy -> oscan.npy
    "the report": ("out/{stem}.json", "out/scan.json", ["the --report file"]),
}


@pytest.mark.parametrize("case", OUTPUT_TARGETS, ids=list(OUTPUT_TARGETS))
def test_overwrite_never_replaces_a_file_the_run_reads(tmp_path, scan, capsys, case):
    template, report, words = OUTPUT_TARGETS[case]
    pipeline = _kernel_pipeline(tmp_path)
    (tmp_path / "out").mkdir()
    if report:
        (tmp_path / report).write_text('{"volconv_version": "0", "inputs": []}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # a suffix volconv cannot write is refused first; the format named, the path reaches the
    # check of the files the run reads
    args = ["--set", f"output.path={tmp_path / template}", "--overwrite", "--set",
            "output.format=hdf5"]  # fmt: skip
    args += ["--report", str(tmp_path / report)] if report else []
    for command in ("validate", "run"):
        code, out, err = volconv(command, pipeline, *args[: 5 if command == "validate" else None],
                                 capsys=capsys)  # fmt: skip
        if command == "validate" and report:
            assert code == 0, err  # validate writes no report
            continue
        assert_one_line_error(code, out, err, "output.path", *words)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_fifo_or_device_at_the_output_path_is_refused_without_blocking(tmp_path, scan):
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out/scan.h5")
    nodes = [("out/scan.h5", "a FIFO")]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null.h5", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        nodes.append(("null.h5", "a character device"))
    for name, words in nodes:
        for args in (["validate"], ["run"], ["run", "--overwrite"]):
            proc = subprocess.run(
                [sys.executable, "-m", "volconv", *args, str(pipeline), "--set",
                 f"output.path={tmp_path / name}"],
                capture_output=True, text=True, timeout=120, cwd=tmp_path,
            )  # fmt: skip
            assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, name, words,
                                  "not a regular file", "output.path")  # fmt: skip
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out/scan.h5").st_mode)


def test_an_output_name_too_long_is_exit_2_naming_output_path(tmp_path, scan, capsys):
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    for name in ("x" * 300 + ".h5", "y" * 300 + "/a.h5", "z" * 240 + ".h5"):
        for command in ("validate", "run"):
            code, out, err = volconv(command, pipeline, "--set", f"output.path={tmp_path / name}",
                                     capsys=capsys)  # fmt: skip
            assert_one_line_error(code, out, err, "is too long", "output.path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.toml", "scan.npy"]


def assert_interrupted(setup: str, cwd: Path, args: list, message: str) -> None:
    """Run ``volconv ARGS`` in a process after ``setup`` (Python that arranges a real SIGINT):
    exit 130 and the one line ``error: MESSAGE``."""
    script = (
        f"{setup}import sys\n"
        "from volconv.cli import main\n"
        f"sys.argv = ['volconv', *{[str(a) for a in args]!r}]\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=cwd)  # fmt: skip
    assert proc.returncode == 130, proc
    assert proc.stderr.strip() == f"error: {message}", proc.stderr


def test_ctrl_c_during_validate_says_so_in_one_line(tmp_path, scan):
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    # a real SIGINT, delivered while validate checks the inputs
    script = (
        "import os, signal, sys, time\n"
        "import volconv.run.jobs as p\n"
        "def slow(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "p.plan_jobs = slow\n"
        "import volconv.console as c\n"
        "c.plan_jobs = slow\n"
    )
    assert_interrupted(script, tmp_path, ["validate", pipeline],
                       "interrupted; validate writes nothing")  # fmt: skip


@pytest.mark.parametrize(
    ("command", "module", "message"),
    [("validate", "volconv.config", "interrupted; validate writes nothing"),
     ("run", "volconv.device.programs", "interrupted; rerun the same command to resume")],
)  # fmt: skip
def test_ctrl_c_while_a_command_imports_says_so_in_one_line(tmp_path, scan, command, module,
                                                            message):  # fmt: skip
    """A real SIGINT while the command imports its modules (the first quarter second): one
    line and 130, not typer's silent exit."""
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    script = (
        "import os, signal, sys, time\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(30)\n"
        "from volconv.cli import main\n"
        "sys.meta_path.insert(0, Interrupt())\n"
    )
    assert_interrupted(script, tmp_path, [command, pipeline], message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.toml", "scan.npy"]


def test_bench_json_to_a_folder_is_refused_before_the_work(tmp_path, capsys):
    code, out, err = volconv("bench", "--device", DEVICE, "--size", "8", "--repeats", "1",
                             "--sweep-n", "", "--sweep-unroll", "", "--sweep-local", "",
                             "--json", tmp_path, capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "--json", str(tmp_path), "is a folder")
    assert "volconv bench on" not in out


def test_help_loads_neither_opencl_nor_numpy():
    """`volconv --help` answers without the heavy imports (a fast start, issue 10)."""
    code = (
        "import sys\nfrom volconv import cli\nsys.argv = ['volconv', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('numpy', 'pyopencl', 'h5py', 'nibabel') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_show_never_writes_over_what_is_not_a_picture(tmp_path, scan, capsys):
    pipeline = write_pipeline(tmp_path, BOX)
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    output = tmp_path / "out" / "scan.h5"
    before = {p: p.read_bytes() for p in (output, scan)}
    for target, words in ((output, ".png"), (scan, ".png"), (tmp_path / "x.txt", ".png")):
        code, out, err = volconv("show", output, "--png", target, capsys=capsys)
        assert_one_line_error(code, out, err, str(target), words)
    (tmp_path / "fake.png").write_text("not a picture")
    code, out, err = volconv("show", output, "--png", tmp_path / "fake.png", capsys=capsys)
    assert_one_line_error(code, out, err, "is not a PNG")
    assert {p: p.read_bytes() for p in (output, scan)} == before
    assert volconv("show", output, "--png", tmp_path / "a.png", capsys=capsys)[0] == 0
    assert volconv("show", output, "--png", tmp_path / "a.png", capsys=capsys)[0] == 0  # redraw


def test_the_program_leaves_at_once_with_every_line_file_and_status(tmp_path, device_spec):
    """`volconv` skips the interpreter's teardown (a fast start, issue 10): what it printed,
    its report and its outputs are whole, and the exit status is kept."""
    np.save(tmp_path / "a.npy", random_volume((8, 9, 10), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["a.npy"]}, device=device_spec)
    report = tmp_path / "report.json"
    args = [sys.executable, "-m", "volconv", "run", str(pipeline), "--device", device_spec]
    done = subprocess.run([*args, "--report", str(report)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    last = " ".join(done.stdout.split()[-12:])  # the device line ends the table, flushed
    assert "FP32 peak" in last and last.endswith(("GFLOP/s", "TFLOP/s")), done.stdout
    assert json.loads(report.read_text())["inputs"][0]["status"] == "done"
    with check_output(tmp_path / "out" / "a.h5", np.load(tmp_path / "a.npy").astype(float)):
        pass
    again = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "skipped" in again.stdout, again
    missing = subprocess.run([*args[:4], str(tmp_path / "nope.toml")], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.startswith("error: "), missing


# -- exit statuses and stderr (issue 21, 5, 13, 14) ---------------------------------------
def _limited(limit: int):
    """A preexec_fn: at most ``limit`` open file descriptors in the child."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.mark.skipif("not on_a_cpu()", reason="device-specific: a CPU device's run (a GPU driver "
                    "does not start with 6-12 descriptors)")  # fmt: skip
def test_running_out_of_file_descriptors_is_exit_1_with_the_cause(tmp_path):
    for i in range(8):
        np.save(tmp_path / f"v{i}.npy", random_volume((12, 10, 8), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX)
    # kernels built and cached first: PoCL's linker, short of descriptors, aborts the process
    warm = subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert warm.returncode == 0, warm.stderr
    hit = 0
    for limit in range(5, 41):  # each one: between the driver's start and the run's end
        # lie the few descriptors that inputs and outputs take, wherever the driver ends
        proc = subprocess.run(
            [sys.executable, "-m", "volconv", "run", str(pipeline), "--overwrite"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=_limited(limit),
        )  # fmt: skip
        assert "Traceback" not in proc.stderr, proc.stderr
        if "no OpenCL device" in proc.stderr or "No usable OpenCL platform" in proc.stderr:
            continue  # the OpenCL driver itself could not start at this limit
        if "Too many open files" in proc.stderr:
            hit += 1
            # the machine's limit, not the user's mistake: 1, with the cause on stderr
            assert proc.returncode == 1, (limit, proc.stderr)
            assert proc.stderr.startswith("error: ") and "ulimit -n" in proc.stderr
        else:
            assert proc.returncode == 0, (limit, proc.stderr)
            break  # enough descriptors: so are all higher limits
    assert hit, "no limit ran the process out of descriptors"


def _corrupt_nii_gz(path: Path) -> None:
    """A .nii.gz whose gzip CRC fails: read to its end before anyone can tell."""
    nib.save(nib.Nifti1Image(random_volume((16, 12, 10), "uint8"), np.eye(4)), path)
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # the CRC-32 of the trailer
    path.write_bytes(bytes(data))


def _corrupt_h5(path: Path) -> None:
    """An HDF5 file whose header plans but one of whose chunks no longer inflates."""
    import h5py

    with h5py.File(path, "w") as f:
        d = f.create_dataset("data", data=random_volume((6, 5, 4), "uint8"), chunks=(1, 5, 4),
                             compression="gzip")  # fmt: skip
        chunk = d.id.get_chunk_info(3)
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset : chunk.byte_offset + chunk.size] = b"\xff" * chunk.size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "spec", "corrupt", "says"),
    [("bad.nii.gz", "bad.nii.gz", _corrupt_nii_gz, "gzip stream is corrupt"),
     ("bad.h5", "bad.h5:data", _corrupt_h5, "cannot read it")],
)  # fmt: skip
def test_an_input_failing_mid_run_fails_alone(tmp_path, capsys, device_spec, name, spec,
                                              corrupt, says):  # fmt: skip
    """An input that plans but cannot be read mid-run is that input's failure, said on stderr:
    the other input completes, the table is printed, exit 1."""
    np.save(tmp_path / "good.npy", random_volume((6, 5, 4), "uint8"))
    corrupt(tmp_path / name)
    pipeline = write_pipeline(
        tmp_path, BOX, input={"paths": [spec, "good.npy"]}, device=device_spec
    )
    code, out, err = volconv("run", pipeline, capsys=capsys)
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], err
    assert says in lines[0], err
    assert "failed" in out and says_complete(tmp_path / "out/good.h5")  # the other completes
    assert not (tmp_path / "out/bad.h5").exists()


def test_a_mistake_found_mid_run_is_exit_1(tmp_path, capsys, monkeypatch):
    """SPEC keeps 2 for mistakes found before any work: one found after (an input's reader
    refusing it mid-run) is 1, the message kept."""
    from volconv.run import pipeline as p
    from volconv.run.volume import InputError

    np.save(tmp_path / "a.npy", random_volume((6, 5, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["a.npy"]})

    def refuse(cfg, job, *args, **kwargs):
        raise InputError(f"{job.spec}: changed since it was planned")

    monkeypatch.setattr(p, "run_one", refuse)
    code, _, err = volconv("run", pipeline, capsys=capsys)
    assert code == 1 and err.strip() == f"error: {tmp_path / 'a.npy'}: changed since it was planned"


def test_debug_after_the_command(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("[input\n")
    for command in ("run", "validate"):
        with pytest.raises(UserError, match="not valid TOML"):
            volconv(command, "--debug", tmp_path / "p.toml", capsys=capsys)
    # and without it, the one line again: --debug does not stick to the next command
    assert_one_line_error(*volconv("run", tmp_path / "p.toml", capsys=capsys), "not valid TOML")


def test_a_scheduler_without_the_batch_extra_names_it(tmp_path, scan, capsys, monkeypatch):
    """--scheduler needs Dask (exit 2 naming the extra, before any work); local --devices
    run on plain worker processes and need none."""
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]})
    code, out, err = volconv("run", pipeline, "--scheduler", "tcp://127.0.0.1:1", capsys=capsys)
    assert_one_line_error(code, out, err, "pip install 'volconv[batch]'", "Dask")
    assert not (tmp_path / "out").exists()
    code, out, err = volconv("run", pipeline, "--devices", "cpu,cpu", capsys=capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "scan.h5").exists()


# -- names with control characters (issue 21, 7) -------------------------------------------
def test_a_newline_in_an_input_name_never_splits_a_line(tmp_path, capsys):
    np.save(tmp_path / "a\nb.npy", random_volume((6, 5, 4), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["a\nb.npy"]},
                              output={"path": "out/{stem}.h5"})  # fmt: skip
    code, out, err = volconv("run", pipeline, capsys=capsys)
    assert code == 0, err
    (done,) = [line for line in out.splitlines() if line.startswith("done ")]
    assert "a\\nb.npy" in done and "out/a\\nb.h5" in done  # escaped, whole
    assert not any(line.startswith("b.npy") or line.startswith("b.h5") for line in out.splitlines())
    code, out, err = volconv("validate", pipeline, capsys=capsys)
    assert code == 0 and "a\\nb.npy" in out and "\nb.npy" not in out
    # a one-line error naming such a file: still one line
    (tmp_path / "a\nb.npy").unlink()
    (tmp_path / "c\x1b[31m.npy").write_bytes(b"not numpy")
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["c\x1b[31m.npy"]})
    assert_one_line_error(*volconv("run", pipeline, capsys=capsys), "c\\x1b[31m.npy")
    code, out, err = volconv("run", tmp_path / "x\ny.toml", capsys=capsys)
    assert_one_line_error(code, out, err, "x\\ny.toml")


# -- validate: what each input writes, and about how long (issue 21, 11) --------------------
def test_validate_prints_the_bytes_written_and_an_estimate(tmp_path, capsys, device_spec):
    shapes = {"a.npy": (6, 5, 4), "b.npy": (7, 6, 5, 2)}
    for name, shape in shapes.items():
        np.save(tmp_path / name, random_volume(shape, "uint8"))
    filters = [{"type": "box"}, {"type": "sobel", "axis": 0}, {"type": "log", "sigma": 1}]
    for dtype, itemsize in (("float32", 4), ("float16", 2), ("uint8", 1)):
        pipeline = write_pipeline(tmp_path, filters, output={"dtype": dtype}, device=device_spec)
        code, out, err = volconv("validate", pipeline, capsys=capsys)
        assert code == 0, err
        sizes = {n: 3 * int(np.prod(s)) * itemsize for n, s in shapes.items()}
        for n, size in sizes.items():
            line = next(line for line in out.splitlines() if f"out/{n[0]}.h5" in line)
            assert f"writes {size:,} bytes" in line, line
        assert f"writes   {sum(sizes.values()):,} bytes" in out and "for 2 output(s)" in out
        (estimate,) = [line for line in out.splitlines() if line.startswith("estimate")]
        assert "MB/s (assumed" in estimate and "FLOP/s" in estimate
    # a complete output is skipped: it writes nothing
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    code, out, _ = volconv("validate", pipeline, capsys=capsys)
    assert "writes   0 bytes in all for 0 output(s)" in out and "estimate" not in out


@pytest.mark.parametrize(
    ("bank", "n"),
    [({"filter": [{"type": "box"}], "feature": [
        {"type": "gradient_magnitude", "sigma": 1, "name": "g"},
        {"type": "hessian_eigenvalues", "sigma": 1, "name": "h"},
        {"type": "structure_tensor_eigenvalues", "sigma": 1, "rho": 1, "name": "st"}]}, 8),
     ({"filter": [], "preset": "skimage"}, 30)],
)  # fmt: skip
def test_validate_counts_the_bytes_of_every_output_features_included(tmp_path, capsys, bank, n):
    """N is the file's volumes: the responses stored and every feature's outputs (a preset's
    30 included), never the filters the device runs."""
    shape = (9, 8, 7)
    np.save(tmp_path / "a.npy", random_volume(shape, "uint8"))
    pipeline = write_pipeline(tmp_path, [], bank=bank)
    code, out, err = volconv("validate", pipeline, capsys=capsys)
    assert code == 0, err
    size = n * int(np.prod(shape)) * 4
    assert f"N = {n}," in out and f"writes {size:,} bytes" in out, out
    assert f"writes   {size:,} bytes" in out, out
