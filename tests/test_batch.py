"""Batches (docs/contract.md, "Batches"), on real components: the plain worker processes
``--devices cpu,cpu`` starts (one killed with SIGKILL mid-task, Ctrl-C, SIGTERM), a
`distributed.LocalCluster`, and a ``dask scheduler`` with two ``dask worker`` processes on
127.0.0.1, one of them killed with SIGKILL mid-task. Every output is compared with the
one-device run's, bit for bit.
"""

from __future__ import annotations

import contextlib
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

from volconv.device.devices import device_name, select_device
from volconv.run.inputs import split_spec

distributed = pytest.importorskip("distributed")


@pytest.fixture(autouse=True)
def workers_start_free(monkeypatch):
    """Workers assumed ready at once (`volconv.run.batch.workers_for` then always takes them, even
    for inputs this small); the tests of the small-batch rule set their own cost."""
    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "0")


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
    assert lines(out, "done") == len(SHAPES) and "inputs/minute" in out
    assert f"{len(SHAPES)} input(s): {len(SHAPES)} done in " in out
    assert_same_outputs(tmp_path / "out", reference, list(SHAPES))
    doc = json.loads(report.read_text())
    assert doc["batch_seconds"] > 0 and not doc["in_process"]
    assert set(statuses(report).values()) == {("done", "")}
    # each entry names the process or worker and the device that ran it: this process owns
    # the first device, one worker the second
    name = device_name(select_device(DEVICE))
    assert {r["device"] for r in doc["inputs"]} == {name}
    assert {r["worker"].split(" (")[0] for r in doc["inputs"]} <= {"this process", "volconv-1"}
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
    assert lines(out, "skipped") == len(SHAPES) and "started 2" not in out  # no worker
    # the last line: a total, and the workers (none started, the devices it had)
    assert out.rstrip().splitlines()[-1] == (
        f"{len(SHAPES)} input(s): {len(SHAPES)} skipped; nothing to run: no worker started "
        f"(devices: {name} x2)"
    )


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
    assert re.search(r"^4 input\(s\): 3 done, 1 failed in .* on 2 worker\(s\)", out, re.M), out


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


def kill_a_writer(run: subprocess.Popen, out: Path, wait: float, spare: int = -1) -> Path:
    """SIGKILL the first process (not ``spare``) found writing a partial output in ``out``
    (the private folder's name holds its pid) within ``wait`` seconds; that partial's path."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and run.poll() is None:
        for temp in out.glob(".*.partial-*"):
            pid = int(re.search(r"-(\d+)-[^-]*$", temp.name).group(1))
            if pid != spare:
                os.kill(pid, signal.SIGKILL)
                return temp
        time.sleep(0.01)
    raise AssertionError(f"no process but {spare} wrote in {out}: {run.communicate()}")


def test_dask_workers_one_killed_mid_task_then_resume(tmp_path, dask_cluster, capsys):
    pipeline = make_inputs(tmp_path)
    reference = one_device(pipeline, capsys)
    out = tmp_path / "out"
    run = subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--scheduler", dask_cluster],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        temp = kill_a_writer(run, out, 90)
        text, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, (text, err)
    assert lines(text, "done") == len(SHAPES)
    assert not temp.exists()  # removed when the task ran again elsewhere
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
    """Two local workers, five inputs of one shape (gzip-9: slow last slabs): on one worker
    two inputs in flight at once, outputs bit for bit the one-device run's."""
    shapes = {n: (40, 36, 33) for n in ("p", "q", "r", "s", "t")}
    for name, shape in shapes.items():
        np.save(tmp_path / f"{name}.npy", random_volume(shape, "uint8"))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"compression": "gzip-9"},
                              run={"slab_depth": 8})  # fmt: skip
    reference = one_device(pipeline, capsys)
    report = tmp_path / "report.json"
    code, _out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}", "--report",
                             report, capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert_same_outputs(tmp_path / "out", reference, list(shapes))
    inputs = json.loads(report.read_text())["inputs"]
    overlaps = []
    for worker in {r["worker"] for r in inputs}:
        spans = sorted((r["started_at"], r["started_at"] + r["wall_seconds"])
                       for r in inputs if r["worker"] == worker)  # fmt: skip
        overlaps += [b[0] < a[1] for a, b in itertools.pairwise(spans)]
    assert any(overlaps), inputs


def test_turns_give_the_device_to_one_input_and_writing_to_one_convolver():
    """`Turns`: the next input of the same convolver takes the device once the one before
    has left it (still writing); an input of another convolver waits for that writing."""
    from threading import Event, Thread

    from volconv.run.workers import Turns

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


# -- how many workers: the small-batch rule -----------------------------------------------
def test_workers_for_is_never_slower_than_one_device():
    """The model's choice never ends after one device would, and takes workers where their
    start pays: this process filters on the first device from the start, so two inputs of
    0.1 s against a 1 s start stay in this process, 48 of 0.3 s get a worker for each other
    device, 8 inputs of 0.09 s wait for no worker."""
    from volconv.run.model import workers_for

    assert workers_for([0.1, 0.1], 2, 1.0) == 0
    assert workers_for([0.3] * 48, 2, 1.0) == 1  # the second device's worker
    assert workers_for([0.3] * 48, 4, 1.0) == 3
    assert workers_for([0.09] * 8, 2, 1.0) == 0
    assert workers_for([0.09] * 8, 2, 0.1) == 1
    assert workers_for([5.0, 5.0, 5.0], 8, 1.0) == 2  # this process and 2: one per input
    assert workers_for([0.3] * 48, 1, 0.0) == 0  # one device: this process
    rng = np.random.default_rng(0)
    for _ in range(500):
        seconds = list(rng.exponential(rng.uniform(0.01, 3), rng.integers(2, 60)))
        start, devices = float(rng.uniform(0, 5)), int(rng.integers(1, 9))
        w = workers_for(seconds, devices, start)
        assert 0 <= w <= min(devices, len(seconds)) - 1
        if w:  # this process from 0 s, w workers from start: the model's end beats one device
            ends = max(max(seconds), (sum(seconds) + w * start) / (w + 1))
            assert ends < sum(seconds) and start < sum(seconds)


def test_workers_cost_this_process_too():
    """What workers cost the command's own process (``pool``) counts against them: 8 float16
    demo inputs at the H100 node's pace (0.105 s each, workers ready in 0.77 s) stay in this
    process, though the workers' share alone would end 0.05 s sooner; 48 such inputs take all
    three workers; the pool's cost never makes workers pay where they did not."""
    from volconv.run.model import workers_for

    assert workers_for([0.105] * 8, 4, 0.77) == 3
    assert workers_for([0.105] * 8, 4, 0.77, 0.15) == 0
    assert workers_for([0.105] * 48, 4, 0.77, 0.15) == 3
    rng = np.random.default_rng(2)
    for _ in range(300):
        seconds = list(rng.exponential(rng.uniform(0.01, 3), rng.integers(2, 60)))
        start, pool, devices = float(rng.uniform(0, 5)), float(rng.uniform(0, 1)), 4
        w = workers_for(seconds, devices, start, pool)
        assert w <= workers_for(seconds, devices, start) or not workers_for(seconds, 4, start)
        if w:
            ends = max(max(seconds), (sum(seconds) + w * start) / (w + 1)) + pool
            assert ends < sum(seconds)


def test_a_worker_started_with_the_command_counts_its_head_start(monkeypatch):
    """Each worker's own start: one started with the command (volconv.run.spawn) is ready
    sooner, and the model takes it where the others would not pay: 8 float16 demo inputs
    (0.1 s each) take the early worker alone; 8 float32 (0.19 s) all three; an early worker
    on a spec counts once."""
    from volconv.run.batch import starts
    from volconv.run.model import workers_for
    from volconv.run.spawn import Worker

    assert workers_for([0.1] * 8, 4, [0.2, 0.6, 0.6], 0.15) == 1
    assert workers_for([0.1] * 8, 4, 0.6, 0.15) == 0
    assert workers_for([0.19] * 8, 4, [0.2, 0.6, 0.6], 0.15) == 3
    early = Worker.__new__(Worker)
    early.spec, early.started_at = "0:1", time.time() - 0.4
    # processes (0:0, 0:1, 0:0, 0:1): the workers on 0:1, 0:0, 0:1; the early one first
    left = starts(("0:0", "0:1", "0:0", "0:1"), 0.6, [early])
    assert left[0] == pytest.approx(0.2, abs=0.05) and left[1:] == [0.6, 0.6]
    assert starts(("0:0", "0:1"), 0.3, [early]) == [0.0]  # ready already: no wait


def test_the_pace_is_this_machines_measured_one(tmp_path, monkeypatch):
    """`pace`: 1 until a run of two or more inputs in one process measured this machine, then
    its seconds per input over the model's (cached); a run of one input, or a failed input,
    measures nothing; a value out of range or not a number in the cache is refused (1)."""
    from volconv.config import load
    from volconv.report import VolumeReport
    from volconv.run.model import PACE_FILE, modelled_costs, pace, remember_pace

    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    cfg = load(write_pipeline(tmp_path, FILTERS))
    assert pace() == 1.0
    shape, n, gflop, peak = (64, 64, 64), 3, 2.0, 1000.0
    done = VolumeReport(source="a", output="a.h5", shape=shape, n_filters=n, status="done",
                        gflop=gflop)  # fmt: skip
    failed = VolumeReport.failed("b", "", shape, n, "gone")
    one = sum(modelled_costs(64**3, n, np.dtype(cfg.dtype).itemsize, gflop, peak))
    remember_pace(cfg, [done, failed], 0.5 * one, peak)  # one done input: no measurement
    assert pace() == 1.0
    remember_pace(cfg, [done, done, failed], 2 * 0.4 * one, peak)
    assert pace() == pytest.approx(0.4, abs=1e-3)
    for planted in ('{"pace": -1}', '{"pace": 1e9}', "not json", '{"pace": "fast"}'):
        (tmp_path / PACE_FILE).write_text(planted)
        os.chmod(tmp_path / PACE_FILE, 0o600)
        assert pace() == 1.0, planted


def test_the_start_cost_is_the_last_measured_ready_time(tmp_path, monkeypatch):
    """`start_cost`: the default until a batch measured this machine's ready time, then that
    time (cached); a value out of range or not a number in the cache is refused (the default);
    ``VOLCONV_WORKER_START_SECONDS`` wins, and a wrong one exits 2."""
    from volconv.config import PipelineError
    from volconv.run.model import START_FILE, WORKER_START_SECONDS, remember_start, start_cost

    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VOLCONV_WORKER_START_SECONDS")
    assert start_cost() == WORKER_START_SECONDS
    remember_start(0.8123)
    assert start_cost() == 0.812
    for planted in ('{"ready_seconds": -1}', '{"ready_seconds": 1e9}', "not json", "{}"):
        (tmp_path / START_FILE).write_text(planted)
        os.chmod(tmp_path / START_FILE, 0o600)
        assert start_cost() == WORKER_START_SECONDS, planted
    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "2.5")
    assert start_cost() == 2.5
    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "soon")
    with pytest.raises(PipelineError, match="VOLCONV_WORKER_START_SECONDS"):
        start_cost()


def test_two_processes_per_device_only_where_writing_limits():
    """`processes_per_device`: one process per device where the device's work is as long as
    the writing or longer, two where the writing is longer and the host has the cores (four
    per process), never more than the host carries."""
    from volconv.run.model import CORES_PER_PROCESS, processes_per_device

    assert processes_per_device(0.05, 0.27, 2, 32) == 2  # 256^3 float32 on two H100s
    assert processes_per_device(0.05, 0.13, 2, 32) == 2  # float16
    assert processes_per_device(0.5, 0.27, 2, 32) == 1  # the device limits
    assert processes_per_device(0.05, 0.27, 2, 2) == 1  # a 2-core host
    assert processes_per_device(0.05, 0.27, 8, 32) == 1  # 8 devices, 32 cores
    rng = np.random.default_rng(1)
    for _ in range(500):
        work, write = rng.uniform(0.001, 2, 2)
        devices, cpus = int(rng.integers(1, 9)), int(rng.integers(1, 129))
        per = processes_per_device(work, write, devices, cpus)
        assert per == 1 or (write > work and per * devices * CORES_PER_PROCESS <= cpus)


def test_the_process_count_is_the_users_where_set(tmp_path, capsys, monkeypatch):
    """``VOLCONV_PROCESSES_PER_DEVICE=2`` on one device: two processes on it, each within
    half of host_memory (`process_specs`), and the batch's outputs the one-device run's;
    a wrong count exits 2."""
    from volconv.config import load
    from volconv.run.batch import process_specs
    from volconv.run.workers import plan_one

    monkeypatch.setenv("VOLCONV_PROCESSES_PER_DEVICE", "2")
    pipeline = make_inputs(tmp_path, {k: (600, 24, 24) for k in "abcd"})
    cfg, device = load(pipeline), select_device(DEVICE)
    job = plan_one(cfg, str(tmp_path / "a.npy"), device)
    shared, specs = process_specs(cfg, (DEVICE,), job, device, None)
    assert specs == (DEVICE, DEVICE) and shared.host_memory == cfg.host_memory // 2
    monkeypatch.setenv("VOLCONV_PROCESSES_PER_DEVICE", "1")
    assert process_specs(cfg, (DEVICE,), job, device, None) == (cfg, (DEVICE,))
    monkeypatch.setenv("VOLCONV_PROCESSES_PER_DEVICE", "2")

    reference = one_device(pipeline, capsys)
    report = tmp_path / "report.json"
    code, out, err = volconv("run", pipeline, "--devices", DEVICE, "--report", report,
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert_same_outputs(tmp_path / "out", reference, list("abcd"))
    doc = json.loads(report.read_text())
    assert {r["worker"].split(" (")[0] for r in doc["inputs"]} <= {"this process", "volconv-1"}
    assert not doc["in_process"], out  # a worker started (it may find the queue empty)
    monkeypatch.setenv("VOLCONV_PROCESSES_PER_DEVICE", "two")
    code, out, err = volconv("run", pipeline, "--devices", DEVICE, capsys=capsys)
    assert_one_line_error(code, out, err, "VOLCONV_PROCESSES_PER_DEVICE")


def test_a_failed_task_names_its_worker_and_device(tmp_path, monkeypatch):
    """`process` never raises for an input's sake: an input gone since the client planned
    comes back failed, naming the local worker and its device, as a done one does."""
    from volconv.config import load
    from volconv.run import workers

    monkeypatch.setenv("VOLCONV_WORKER_NAME", "volconv-3")
    np.save(tmp_path / "w.npy", random_volume((24, 16, 16), "uint8"))
    cfg = load(write_pipeline(tmp_path, FILTERS))
    record = workers.process(cfg, str(tmp_path / "gone.npy"), DEVICE)
    assert record.status == "failed" and "gone.npy" in record.reason, record
    assert record.worker == f"volconv-3 (pid {os.getpid()})"
    assert record.device == device_name(select_device(DEVICE))


def test_a_small_batch_runs_in_this_process(tmp_path, capsys, monkeypatch):
    """Two small inputs, workers costing 30 s to start: no worker starts, the batch runs in
    this process on the first device, as one device would, and says why; the one-device run
    and the batch each keep this machine's pace for the next batch's model, and the programs
    they took for the next run's start."""
    from volconv.run.model import PACE_FILE, pace

    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "30")
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path / "cache"))
    pipeline = make_inputs(tmp_path, {k: SHAPES[k] for k in "ab"})
    reference = one_device(pipeline, capsys)
    assert (tmp_path / "cache" / PACE_FILE).is_file() and pace() != 1.0
    (tmp_path / "cache" / PACE_FILE).unlink()
    for record in (tmp_path / "cache" / "programs").glob("start-*.json"):
        record.unlink()
    report = tmp_path / "report.json"
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}",
                             "--report", report, capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "started" not in out and lines(out, "done") == 2
    name = device_name(select_device(DEVICE))
    assert re.search(rf"^2 input\(s\): 2 done in .* on this process: {re.escape(name)}: .* "
                     r"less than workers ready in 30\.0 s would save", out, re.M), out  # fmt: skip
    assert_same_outputs(tmp_path / "out", reference, list("ab"))
    doc = json.loads(report.read_text())
    assert doc["in_process"] and doc["workers"] == [name]
    assert (tmp_path / "cache" / PACE_FILE).is_file()
    # its programs recorded for the next run's start, as a one-device run records them
    assert list((tmp_path / "cache" / "programs").glob("start-*.json"))
    assert {(r["worker"].split(" (")[0], r["device"]) for r in doc["inputs"]} == {
        ("this process", name)
    }


def test_workers_started_with_the_command_are_taken_or_closed(tmp_path, capsys, monkeypatch):
    """Workers started as the command starts (`volconv.run.spawn.spawn_early`, as
    ``volconv run --devices`` starts them on a host with the cores): a batch whose model wants
    workers takes them (outputs bit for bit the one-device run's); one that runs in this
    process closes them, and they end."""
    from volconv.run import pool as pool_module
    from volconv.run import spawn

    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path / "cache"))
    pipeline = make_inputs(tmp_path)
    reference = one_device(pipeline, capsys)
    adopted = []

    def adopt(spec: str) -> spawn.Worker | None:
        adopted.append(w := spawn.adopt(spec))
        return w

    monkeypatch.setattr(pool_module, "adopt", adopt)
    spawn.spawn_early([DEVICE])
    [early] = spawn.early_workers()
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}", "--overwrite",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert adopted == [early] and spawn.early_workers() == []
    assert_same_outputs(tmp_path / "out", reference, list(SHAPES))
    early.proc.wait(30)  # its pipe closed with the batch: it ended on its own

    monkeypatch.setenv("VOLCONV_WORKER_START_SECONDS", "3000")  # workers do not pay
    spawn.spawn_early([DEVICE])
    [early] = spawn.early_workers()
    code, out, err = volconv("run", pipeline, "--devices", f"{DEVICE},{DEVICE}", "--overwrite",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "started 1 worker" not in out and spawn.early_workers() == []
    assert early.proc.wait(30) == 0  # closed unused: it ended on its own
    assert_same_outputs(tmp_path / "out", reference, list(SHAPES))


def test_the_devices_a_command_line_asks_for_before_any_import(tmp_path, monkeypatch):
    """`early_specs`: ``--devices`` (a list, or ``all``: every GPU, else every device, as
    `local_devices` finds them), else the pipeline's ``[run] devices``; nothing for another
    command, one device, a scheduler, or fewer than three inputs (the pipeline's, or those of
    ``--set input.paths``)."""
    from volconv.config import load
    from volconv.run.batch import local_devices
    from volconv.run.spawn import device_specs, early_specs

    for name in "abc":
        np.save(tmp_path / f"{name}.npy", np.zeros((4, 4, 4), np.uint8))
    pipeline = write_pipeline(tmp_path, FILTERS, run={"devices": ["0:0", "cpu"]})
    assert early_specs(["run", str(pipeline)]) == ["0:0", "cpu"]
    assert early_specs(["run", str(pipeline), "--devices", "a,b,c"]) == ["a", "b", "c"]
    assert early_specs(["run", str(pipeline), "--devices=x,y"]) == ["x", "y"]
    # all: the second device's worker at once, the others once the driver has found them
    assert early_specs(["run", str(pipeline), "--devices", "all"]) == ["all#0", "all#1"]
    assert device_specs() == list(local_devices(load(pipeline, devices="all")))
    assert early_specs(["run", str(pipeline), "--devices", "one"]) is None
    assert early_specs(["run", str(pipeline), "--scheduler", "tcp://h:8786"]) is None
    assert early_specs(["validate", str(pipeline)]) is None
    assert early_specs(["run", str(tmp_path / "missing.toml")]) is None
    two = ["run", str(pipeline), "--set", f'input.paths=["{tmp_path}/[ab].npy"]']
    assert early_specs(two) is None
    monkeypatch.chdir(tmp_path)
    assert early_specs([*two[:3], "input.paths=*.npy"]) == ["0:0", "cpu"]
    (tmp_path / "c.npy").unlink()
    assert early_specs(["run", str(pipeline)]) is None
    one = write_pipeline(tmp_path, FILTERS)
    assert early_specs(["run", str(one)]) is None


def test_an_early_worker_finds_its_device_itself(monkeypatch):
    """``all#k``: a worker started before the command knew the devices takes the k-th of
    them as `device_specs` finds them; where there is none it ends at once."""
    from volconv.run.spawn import DEVICE_ENV, device_specs, resolve_device

    monkeypatch.setenv(DEVICE_ENV, "all#0")
    resolve_device()
    assert os.environ[DEVICE_ENV] == device_specs()[0]
    code = "from volconv.run.spawn import resolve_device; resolve_device(); print('alive')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, DEVICE_ENV: "all#99"}, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "alive" not in done.stdout, done.stderr


def test_a_worker_is_warm_before_its_first_task(tmp_path):
    """`warm_up` makes the worker's convolver for the input (programs and pinned buffers),
    and the task then runs on that very convolver, building nothing again."""
    from volconv.config import load
    from volconv.run import workers

    np.save(tmp_path / "w.npy", random_volume((24, 16, 16), "uint8"))
    cfg = load(write_pipeline(tmp_path, FILTERS))
    workers._RUNNER.clear()
    workers.warm_up(cfg, str(tmp_path / "w.npy"))
    [(convolvers, _)] = workers._RUNNER.values()
    [(conv, slabs)] = convolvers._cache.values()
    assert not slabs._free.empty()  # the first page-locked buffer is made
    record = workers.process(cfg, str(tmp_path / "w.npy"))
    assert record.status == "done", record.reason
    assert list(workers._RUNNER.values()) == [(convolvers, _)]
    assert list(convolvers._cache.values()) == [(conv, slabs)]
    with check_output(tmp_path / "out" / "w.h5", np.load(tmp_path / "w.npy").astype(float)):
        pass
    workers._RUNNER.clear()


# -- a wrong scheduler address; SIGTERM ----------------------------------------------------
@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 that accepts connections and never answers."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in [*accepted, server]:
        conn.close()


def test_a_scheduler_address_that_never_answers_fails_in_seconds(scan_pipeline, silent_port,
                                                                   capsys):  # fmt: skip
    import dask.config

    from volconv.run.cluster import CONNECT_SECONDS, connect_seconds

    assert connect_seconds() == CONNECT_SECONDS  # Dask's default, 30 s, bounded by ours
    address = f"tcp://127.0.0.1:{silent_port}"
    t0 = time.monotonic()
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):  # a test's patience
        code, out, err = volconv("run", scan_pipeline, "--scheduler", address, capsys=capsys)
    assert time.monotonic() - t0 < 2 + 5
    assert_one_line_error(code, out, err, address, "no Dask scheduler answered within 2 s")
    # nothing listening at all: the scheduler may be down, not the user's mistake: exit 1
    with socket_closed_port() as port:
        t0 = time.monotonic()
        code, out, err = volconv("run", scan_pipeline, "--scheduler", f"tcp://127.0.0.1:{port}",
                                 capsys=capsys)  # fmt: skip
    assert time.monotonic() - t0 < 5
    assert code == 1 and f"cannot reach the scheduler tcp://127.0.0.1:{port}" in err, (out, err)
    assert len(err.strip().splitlines()) == 1


@contextlib.contextmanager
def socket_closed_port():
    """A port of 127.0.0.1 nobody listens on (bound, never listening)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_sigterm_to_a_batch_exits_143_keeps_partials_and_a_rerun_resumes(tmp_path, capsys):
    """SIGTERM to the client alone (as a job scheduler sends it): its workers stop at their
    next slab, keep their complete slabs and are gone; exit 143, as a one-device run."""
    pipeline = make_inputs(tmp_path, {k: (600, 24, 24) for k in "abcd"})
    out = tmp_path / "out"
    reference = one_device(pipeline, capsys)
    run = subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--devices", f"{DEVICE},{DEVICE}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not recorded_slabs(out) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()
            time.sleep(0.01)
        os.kill(run.pid, signal.SIGTERM)
        text, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 143, (text, err)
    assert "interrupted" in err and len(err.strip().splitlines()) == 1, err
    partials = list(out.glob(".*.partial-*"))
    assert partials
    pids = {int(re.search(r"-(\d+)-[^-]*$", p.name).group(1)) for p in partials}
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)  # no worker left behind
    report = tmp_path / "report.json"
    code, text, err = volconv("run", pipeline, "--report", report, capsys=capsys)
    assert code == 0, err
    inputs = json.loads(report.read_text())["inputs"]
    assert any(r.get("resumed_slabs", 0) > 0 for r in inputs), inputs
    assert_same_outputs(out, reference, list("abcd"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is gone, whatever its parent does
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    return False


def test_workers_warming_at_once_build_in_turn(tmp_path, monkeypatch):
    """`_one_builder`: a second builder waits while the first holds the cache's build lock
    (then loads what it built), and builds anyway after its wait; a link planted at the
    lock's path is neither followed nor written."""
    import threading

    from volconv.run.workers import _one_builder

    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    held, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with _one_builder():
            held.set()
            release.wait(10)
            order.append("first built")

    thread = threading.Thread(target=first)
    thread.start()
    assert held.wait(10)
    t0 = time.monotonic()
    with _one_builder(wait=0.3):
        order.append("second after its wait")
    assert time.monotonic() - t0 >= 0.3
    release.set()
    thread.join(10)
    with _one_builder(wait=10):  # free again
        order.append("third at once")
    assert order == ["second after its wait", "first built", "third at once"]

    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "batch-build.lock").unlink()
    (tmp_path / "batch-build.lock").symlink_to(target)
    with _one_builder(wait=0.1):
        pass
    assert target.read_text() == "keep"


# -- this process and the workers share the inputs ----------------------------------------
def test_this_process_and_a_worker_share_the_inputs_a_killed_worker_is_replaced(tmp_path, capsys):
    """``--devices cpu,cpu``: this process filters on the first device from the start and the
    second device's worker takes inputs from the same queue once ready (each record says
    which); the worker killed mid-task, its input runs again elsewhere; every input exactly
    once, every output the one-device run's."""
    names = [f"v{i}" for i in range(10)]  # outlast a worker's start on a loaded host
    pipeline = make_inputs(tmp_path, {n: (600, 24, 24) for n in names})
    reference = one_device(pipeline, capsys)
    out, report = tmp_path / "out", tmp_path / "report.json"
    run = subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--devices", f"{DEVICE},{DEVICE}",
         "--report", str(report)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        kill_a_writer(run, out, 120, spare=run.pid)  # a worker's, not this process's
        text, err = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, (text, err)
    assert lines(text, "done") == len(names)
    assert_same_outputs(out, reference, names)
    doc = json.loads(report.read_text())
    assert sorted(Path(split_spec(r["source"])[0]).stem for r in doc["inputs"]) == names
    assert {r["status"] for r in doc["inputs"]} == {"done"}
    who = [r["worker"].split(" (")[0] for r in doc["inputs"]]
    assert set(who) <= {"this process", "volconv-1"} and "this process" in who, who
    # the worker's loss is said, and its input ran again (done above, exactly once)
    assert re.search(r"^worker volconv-1 lost \(exit -9\); its inputs run again", text,
                     re.M), text  # fmt: skip
    # two processes on the one CPU device: the label counts both, and the device once
    assert re.search(r"^10 input\(s\): 10 done in .* on this process and 1 worker\(s\) on 1 "
                     r"device\(s\)", text, re.M), text  # fmt: skip
