"""Batches on Dask distributed (docs/contract.md, "Batches"), on real
components: worker processes spawned by ``--devices cpu,cpu``, a `distributed.LocalCluster`,
and a ``dask scheduler`` with two ``dask worker`` processes on 127.0.0.1, one of them killed
with SIGKILL mid-task. Every output is compared with the one-device run's, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_cli import assert_one_line_error, says_complete
from test_pipeline import DEVICE, ROOT, check_output, random_volume, volconv, write_pipeline

from volconv.io import split_spec

distributed = pytest.importorskip("distributed")

FILTERS = [
    {"name": "smooth", "type": "gaussian", "sigma": 1.0},
    {"name": "dz", "type": "gaussian", "sigma": 1.0, "order": [0, 0, 1]},
    {"name": "mean", "type": "box"},
]
# Inputs of different sizes (the largest is submitted first); slab_depth = 1 makes each task
# last long enough on a CPU to be killed mid-way.
SHAPES = {"a": (120, 20, 18), "b": (200, 16, 16), "c": (90, 24, 20), "d": (160, 18, 16)}


def make_inputs(folder: Path, shapes: dict[str, tuple[int, ...]] = SHAPES) -> Path:
    """One .npy per shape and a pipeline over them (slab depth 1, outputs in out/)."""
    for name, shape in shapes.items():
        np.save(folder / f"{name}.npy", random_volume(shape, "uint8"))
    return write_pipeline(folder, FILTERS, run={"slab_depth": 1})


def one_device(pipeline: Path, capsys: pytest.CaptureFixture, where: str = "one") -> Path:
    """The one-device run's outputs, in a folder of their own: what every batch must equal."""
    out = pipeline.parent / where
    code, _, err = volconv("run", pipeline, "--set", f"output.path={out}/{{stem}}.h5",
                           capsys=capsys)  # fmt: skip
    assert code == 0, err
    return out


def assert_same_outputs(out: Path, reference: Path, names: list[str]) -> None:
    """Every output complete, its responses and kernels bit for bit the reference's, and no
    temporary file left."""
    for name in names:
        with h5py.File(out / f"{name}.h5") as f, h5py.File(reference / f"{name}.h5") as g:
            assert f.attrs["complete"]
            np.testing.assert_array_equal(f["responses"][()], g["responses"][()])
            np.testing.assert_array_equal(f["kernels"][()], g["kernels"][()])
            assert f.attrs["source_sha256"] == g.attrs["source_sha256"]
    assert list(out.glob(".*partial*")) == []
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.h5" for n in names)


def lines(text: str, word: str) -> int:
    """How many of the lines per input start with ``word`` (done, skipped, failed)."""
    return sum(line.startswith(f"{word} ") for line in text.splitlines())


def statuses(report: Path) -> dict[str, tuple[str, str]]:
    """Input file name -> (status, reason) from a ``--report`` file."""
    doc = json.loads(report.read_text())
    return {Path(split_spec(r["source"])[0]).name: (r["status"], r["reason"])
            for r in doc["inputs"]}  # fmt: skip


# -- every device of a node ---------------------------------------------------------------
def test_devices_cpu_cpu_equals_one_device_and_resumes(tmp_path, capsys):
    pipeline = make_inputs(tmp_path)
    reference = one_device(pipeline, capsys)
    report = tmp_path / "report.json"
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}",
                             "--report", report, capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "started 2 worker(s)" in out
    assert lines(out, "done") == len(SHAPES) and "inputs/minute" in out
    assert_same_outputs(tmp_path / "out", reference, list(SHAPES))
    doc = json.loads(report.read_text())
    assert len(doc["workers"]) == 2 and doc["batch_seconds"] > 0
    assert set(statuses(report).values()) == {("done", "")}
    with check_output(tmp_path / "out" / "c.h5", np.load(tmp_path / "c.npy").astype(float)):
        pass  # and the batch's output is scipy's convolution

    # resume: complete outputs are skipped before any worker starts; a missing one is redone
    (tmp_path / "out" / "b.h5").unlink()
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}",
                             "--report", report, capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert lines(out, "skipped") == 3 and "done " in out and "b.npy" in out
    assert statuses(report)["b.npy"] == ("done", "")
    assert_same_outputs(tmp_path / "out", reference, list(SHAPES))
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}", capsys=capsys)
    assert code == 0, err
    assert lines(out, "skipped") == len(SHAPES) and "started" not in out  # no worker


def test_batch_mistakes_exit_2_before_any_task(tmp_path, scan_pipeline, capsys):
    pipeline = scan_pipeline
    code, out, err = volconv("run", pipeline, "--devices", "no-such-device", capsys=capsys)
    assert_one_line_error(code, out, err, "no-such-device")
    code, out, err = volconv("run", pipeline, "--devices", ",", capsys=capsys)
    assert_one_line_error(code, out, err, "--devices")
    code, out, err = volconv("run", pipeline, "--devices", "all", "--scheduler",
                             "tcp://127.0.0.1:1", capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "scheduler", "devices")
    # a missing input is found by the client's plan: no worker starts, nothing is written
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}", "--set",
                             'input.paths=["missing.npy"]', capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "missing.npy")
    assert "worker" not in out and not (tmp_path / "out").exists()
    code, out, err = volconv("run", write_pipeline(tmp_path, FILTERS, run={"devices": 3}),
                             capsys=capsys)  # fmt: skip
    assert_one_line_error(code, out, err, "run.devices")


@pytest.fixture
def scan_pipeline(tmp_path) -> Path:
    np.save(tmp_path / "scan.npy", random_volume((6, 5, 4), "uint8"))
    return write_pipeline(tmp_path, FILTERS)


# -- an existing cluster ------------------------------------------------------------------
def corrupt_hdf5(path: Path, volume: np.ndarray) -> str:
    """An HDF5 input whose header reads but whose third chunk does not decompress: a file
    that turns out corrupt mid-read, after the client planned it."""
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=volume, chunks=(8, *volume.shape[1:]), compression="gzip")
    with h5py.File(path, "r") as f:
        chunk = f["data"].id.get_chunk_info(2)
    with open(path, "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\xa5" * chunk.size)
    return f"{path}:/data"


def test_local_cluster_and_a_failing_input(tmp_path, capsys):
    pipeline = make_inputs(tmp_path, {k: SHAPES[k] for k in "abc"})
    reference = one_device(pipeline, capsys)
    bad = corrupt_hdf5(tmp_path / "bad.h5", random_volume((40, 16, 16), "uint8"))
    report = tmp_path / "report.json"
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
            host="127.0.0.1", dashboard_address=None,
        ) as cluster,
    ):  # fmt: skip
        code, out, err = volconv("run", pipeline, "--scheduler", cluster.scheduler_address,
                                 "--set", f'input.paths=["{tmp_path}/*.npy", "{bad}"]',
                                 "--report", report, capsys=capsys)  # fmt: skip
    assert code == 1, (out, err)
    assert "scheduler tcp://127.0.0.1" in out and "2 worker(s)" in out
    assert re.search(r"failed \S*bad\.h5:/data: .+", out), out
    status, reason = statuses(report)["bad.h5"]
    assert status == "failed" and "OSError" in reason, reason
    assert {statuses(report)[f"{k}.npy"] for k in "abc"} == {("done", "")}
    assert_same_outputs(tmp_path / "out", reference, list("abc"))  # and no bad.h5


# -- a dask scheduler and two dask workers; one killed mid-task ---------------------------
def start_cluster(folder: Path) -> tuple[list[subprocess.Popen], str]:
    """``dask scheduler`` and two ``dask worker`` processes (device from VOLCONV_DEVICE), as
    README.md says to start them; the scheduler's address once both workers joined."""
    dask = Path(sys.executable).parent / "dask"
    file = folder / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", file], **quiet)]  # fmt: skip
    deadline = time.monotonic() + 60
    while not file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(2):
        procs.append(subprocess.Popen(
            [dask, "worker", "--scheduler-file", file, "--nworkers", "1", "--nthreads", "1",
             "--resources", "GPU=1", "--no-dashboard"],
            env={**os.environ, "VOLCONV_DEVICE": DEVICE}, **quiet,
        ))  # fmt: skip
    with distributed.Client(scheduler_file=str(file), timeout="60s") as client:
        client.wait_for_workers(2, timeout=90)
        return procs, client.scheduler.address


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group started, then SIGKILL to what is left after 10 s."""
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture
def dask_cluster(tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        procs, address = start_cluster(tmp_path)
        yield address
    finally:
        stop_cluster(procs)


def test_dask_workers_one_killed_mid_task_then_resume(tmp_path, dask_cluster, capsys):
    pipeline = make_inputs(tmp_path)
    reference = one_device(pipeline, capsys)
    out = tmp_path / "out"
    run = subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--scheduler", dask_cluster],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # The private folder's name holds the pid of the worker process writing in it.
        deadline, temps = time.monotonic() + 90, []
        while not temps and time.monotonic() < deadline and run.poll() is None:
            temps = list(out.glob(".*.partial-*"))
            time.sleep(0.01)
        assert temps, run.communicate()
        pid = int(re.search(r"-(\d+)-[^-]*$", temps[0].name).group(1))
        os.kill(pid, signal.SIGKILL)
        text, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, (text, err)
    assert lines(text, "done") == len(SHAPES)
    assert not temps[0].exists()  # removed when the task ran again elsewhere
    assert_same_outputs(out, reference, list(SHAPES))

    # resume across the cluster: complete outputs skipped, a missing one made again
    (out / "a.h5").unlink()
    report = tmp_path / "report.json"
    code, text, err = volconv("run", pipeline, "--scheduler", dask_cluster, "--report", report,
                              capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert statuses(report) == {
        "a.npy": ("done", ""),
        **{f"{k}.npy": ("skipped", "") for k in "bcd"},
    }
    assert_same_outputs(out, reference, list(SHAPES))


# -- Ctrl-C -------------------------------------------------------------------------------
def recorded_slabs(out: Path) -> int:
    """How many slabs the progress logs of the partial outputs in ``out`` record so far."""
    logs = (p.read_bytes() for p in out.glob(".*.partial-*/progress"))
    return sum(log.count(b"\nslab ") for log in logs)


def test_ctrl_c_stops_every_worker_keeps_their_slabs_and_a_rerun_resumes(tmp_path, capsys):
    pipeline = make_inputs(tmp_path, {k: (600, 24, 24) for k in "abcd"})
    write_pipeline(tmp_path, FILTERS, run={"slab_depth": 1, "devices": [DEVICE, DEVICE]})
    out = tmp_path / "out"
    reference = one_device(pipeline, capsys)
    run = subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline)],  # [run] devices: a list
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # Ctrl-C reaches the whole process group, workers included
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not recorded_slabs(out) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()
            time.sleep(0.01)
        os.killpg(run.pid, signal.SIGINT)
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 130
    partials = list(out.glob(".*.partial-*"))
    assert partials  # the inputs in progress keep their complete slabs, hidden
    for path in out.glob("[!.]*"):  # whatever finished before the signal is complete
        assert says_complete(path)
    report = tmp_path / "report.json"
    code, text, err = volconv("run", pipeline, "--report", report, capsys=capsys)
    assert code == 0, err
    assert lines(text, "done") + lines(text, "skipped") == 4
    inputs = json.loads(report.read_text())["inputs"]
    assert any(r.get("resumed_slabs", 0) > 0 for r in inputs), inputs
    assert list(out.glob(".*partial*")) == []
    assert_same_outputs(out, reference, list("abcd"))


def test_a_worker_writes_one_input_while_the_next_is_on_its_device(tmp_path, capsys):
    """One local worker, three inputs of one shape (gzip-9: slow last slabs): two inputs in
    flight at once, outputs bit for bit the one-device run's."""
    shapes = {n: (40, 36, 33) for n in ("p", "q", "r")}
    for name, shape in shapes.items():
        np.save(tmp_path / f"{name}.npy", random_volume(shape, "uint8"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"compression": "gzip-9"},
                              run={"slab_depth": 8})  # fmt: skip
    reference = one_device(pipeline, capsys)
    report = tmp_path / "report.json"
    code, _out, err = volconv("run", pipeline, "--devices", DEVICE, "--report", report,
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert_same_outputs(tmp_path / "out", reference, list(shapes))
    spans = sorted((r["started_at"], r["started_at"] + r["wall_seconds"])
                   for r in json.loads(report.read_text())["inputs"])  # fmt: skip
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), spans


def test_turns_give_the_device_to_one_input_and_writing_to_one_convolver():
    """`Turns`: the next input of the same convolver takes the device once the one before
    has left it (still writing); an input of another convolver waits for that writing."""
    from threading import Event, Thread

    from volconv.batch import Turns

    turns, log = Turns(), []
    left_device, finish_first = Event(), Event()

    def first() -> None:
        with turns.turn("k") as left:
            log.append("first on device")
            left()
            left_device.set()
            finish_first.wait(10)
            log.append("first written")

    def follower(key: str) -> None:
        with turns.turn(key):
            log.append(f"{key} on device")

    a = Thread(target=first)
    a.start()
    assert left_device.wait(10)
    same = Thread(target=follower, args=("k",))
    same.start()
    same.join(10)
    assert log == ["first on device", "k on device"]  # while the first is still writing
    other = Thread(target=follower, args=("other",))
    other.start()
    other.join(0.3)
    assert other.is_alive()  # waits: the first still writes with another convolver
    finish_first.set()
    other.join(10)
    a.join(10)
    assert log == ["first on device", "k on device", "first written", "other on device"]
