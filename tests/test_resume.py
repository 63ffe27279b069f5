"""Resume inside a volume (`volconv.run.resume`): a run stopped mid-volume by SIGKILL, SIGINT or
SIGTERM, in real processes over real files, and run again continues from its complete slabs,
giving bit for bit the file an uninterrupted run gives; what must not be resumed is not (a
changed bank or input, ``--overwrite``, a link planted in the partial's place, another user's
partial, a live run's), two reruns at once both succeed, and a partial never says complete."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_pipeline import DEVICE, ROOT, random_volume

from volconv.config import dump_toml, load
from volconv.output import ROOT_ATTRS
from volconv.run.interrupts import Interrupted
from volconv.run.pipeline import run as volconv_run

# Many slabs of one or two rows: seconds on a CPU, so a signal lands mid-volume.
FILTERS = [{"type": "gaussian", "name": f"g{i}", "sigma": 1.5, "order": [0, 0, i % 3]}
           for i in range(4)]  # fmt: skip
SHAPES = {"3d": (1200, 40, 40), "4d": (300, 24, 24, 3)}


def pipeline(folder: Path, shape: str = "3d", device: str = DEVICE) -> Path:
    """float16 outputs; the 4D one gzip-compressed (chunks compressed on the writer's pool);
    run on ``device`` (each test takes conftest's ``device_spec``)."""
    data = {
        "input": {"paths": ["b.npy"]},
        "bank": {"size": 5, "filter": FILTERS},
        "output": {"path": "out/{stem}.h5", "dtype": "float16",
                   "compression": "none" if shape == "3d" else "gzip"},
        "run": {"device": device, "slab_depth": 1 if shape == "3d" else 2},
    }  # fmt: skip
    path = folder / "p.toml"
    path.write_text(dump_toml(data))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, device_spec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per shape: the input and the responses of a run on the device that nothing stopped."""
    made = {}
    for name, shape in SHAPES.items():
        folder = tmp_path_factory.mktemp(f"whole-{name}")
        volume = random_volume(shape, "uint8" if name == "3d" else "float32")
        np.save(folder / "b.npy", volume)
        code, _, err = run(pipeline(folder, name, device_spec))
        assert code == 0, err
        with h5py.File(folder / "out" / "b.h5") as f:
            made[name] = volume, f["responses"][()]
    return made


def start(pipeline: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "volconv", "run", str(pipeline), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def run(pipeline: Path, *args: str) -> tuple[int, str, str]:
    proc = start(pipeline, *args)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def partials(out: Path) -> list[Path]:
    return sorted(out.glob(".b.h5.partial-*"))


def slabs_recorded(out: Path) -> int:
    """Slab records in the partial's progress log (a line being written may be cut)."""
    try:
        (folder,) = partials(out)
        return (folder / "progress").read_bytes().count(b"\nslab ")
    except (ValueError, OSError):
        return 0


def stop_mid_volume(
    folder: Path, how: signal.Signals, shape: str = "3d", at: int = 40, *, device: str = DEVICE
) -> int:
    """Start a run on ``device``, send ``how`` once ``at`` slabs are recorded; the slabs
    recorded then."""
    out = folder / "out"
    proc = start(pipeline(folder, shape, device))
    deadline = time.monotonic() + 300
    while slabs_recorded(out) < at:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run recorded no progress"
        time.sleep(0.01)
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    expected = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -9}[how]
    assert proc.returncode == expected, err
    assert "Traceback" not in err
    if how != signal.SIGKILL:
        assert "keeps its complete slabs" in err and "run the same command again" in err
    assert not (out / "b.h5").exists()  # nothing that looks finished
    (partial,) = partials(out)
    with h5py.File(partial / "b.h5", locking=False) as f:  # it opens, and says not complete
        assert "complete" not in f.attrs
    recorded = slabs_recorded(out)
    assert recorded >= at
    return recorded


def report_of(folder: Path, *args: str, device: str = DEVICE) -> dict:
    code, out, err = run(pipeline(folder, device=device), "--report", str(folder / "r.json"), *args)
    assert code == 0, err
    return json.loads((folder / "r.json").read_text())["inputs"][0] | {"stdout": out}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM],
                         ids=["SIGKILL", "SIGINT", "SIGTERM"])  # fmt: skip
def test_a_stopped_run_resumes_and_gives_the_same_bits(tmp_path, uninterrupted, how, device_spec):
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    recorded = stop_mid_volume(tmp_path, how, device=device_spec)
    check = subprocess.run([sys.executable, "-m", "volconv", "validate", str(tmp_path / "p.toml")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert f"(new; an interrupted run's partial with {recorded} slabs resumes" in check.stdout

    r = report_of(tmp_path, device=device_spec)
    n = volume.shape[0]
    assert r["n_slabs"] == n
    # every slab recorded is kept; only the rest is computed (and counted as work)
    assert recorded <= r["resumed_slabs"] < n
    assert f"{r['resumed_slabs']}/{n} slabs resumed" in r["stdout"]
    k = r["resumed_slabs"] + 1
    assert r["stdout"].startswith(f"resuming {tmp_path / 'out' / 'b.h5'} at slab {k}/{n} (")
    full = 2 * volume.size * sum(5**3 for _ in FILTERS) / 1e9
    assert r["gflop"] == pytest.approx(full * (n - r["resumed_slabs"]) / n)
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["responses"][()], whole)  # bit for bit
    assert partials(tmp_path / "out") == []


def test_a_4d_input_resumes_per_frame_and_slab(tmp_path, uninterrupted, device_spec):
    volume, whole = uninterrupted["4d"]
    np.save(tmp_path / "b.npy", volume)
    n = SHAPES["4d"][3] * SHAPES["4d"][0] // 2
    recorded = stop_mid_volume(
        tmp_path, signal.SIGKILL, "4d", at=n // 2, device=device_spec
    )  # in frame 1
    code, out, err = run(pipeline(tmp_path, "4d", device=device_spec))
    assert code == 0, err
    kept = int(out.split(" slabs resumed")[0].rsplit(", ", 1)[1].split("/")[0])
    assert recorded <= kept < n
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


@pytest.mark.parametrize("change", ["bank", "input", "--overwrite"])
def test_what_differs_is_never_resumed(tmp_path, uninterrupted, change, device_spec):
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    args: tuple[str, ...] = ()
    if change == "bank":
        args = ("--set", "bank.boundary=wrap")
    elif change == "input":
        volume = volume.copy()
        volume[0, 0, 0] ^= 1
        np.save(tmp_path / "b.npy", volume)
    else:
        args = ("--overwrite",)
    r = report_of(tmp_path, *args, device=device_spec)
    assert r["resumed_slabs"] == 0 and "resumed" not in r["stdout"]
    assert partials(tmp_path / "out") == []  # the stale partial is gone
    if change == "--overwrite":
        with h5py.File(tmp_path / "out" / "b.h5") as f:
            np.testing.assert_array_equal(f["responses"][()], whole)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("where", ["folder", "file", "log"])
def test_a_planted_link_is_never_followed(tmp_path, uninterrupted, where, device_spec):
    """A link in the partial's place (the folder, its file, its log) pointing at a copy of a
    resumable partial: never opened through, never changed, never removed; the rerun
    starts afresh and is whole."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    (partial,) = partials(tmp_path / "out")
    victim = tmp_path / "victim"
    shutil.copytree(partial, victim)
    if where == "folder":
        shutil.rmtree(partial)
        partial.symlink_to(victim, target_is_directory=True)
        planted = partial
    else:
        name = "b.h5" if where == "file" else "progress"
        (partial / name).unlink()
        (partial / name).symlink_to(victim / name)
        planted = partial / name
    before = {p.name: digest(p) for p in victim.iterdir()}

    r = report_of(tmp_path, device=device_spec)
    assert r["resumed_slabs"] == 0
    assert {p.name: digest(p) for p in victim.iterdir()} == before
    if where == "folder":
        assert planted.is_symlink()  # a link is not removed either
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_another_users_partial_is_not_used(tmp_path, uninterrupted, device_spec):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a partial output to another user")
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    (partial,) = partials(tmp_path / "out")
    for p in (partial, *partial.iterdir()):
        os.chown(p, 65534, 65534)
    before = {p.name: digest(p) for p in partial.iterdir()}
    r = report_of(tmp_path, device=device_spec)
    assert r["resumed_slabs"] == 0
    assert {p.name: digest(p) for p in partial.iterdir()} == before  # left alone
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_two_reruns_at_once_one_resumes(tmp_path, uninterrupted, device_spec):
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    runs = [start(pipeline(tmp_path, device=device_spec)) for _ in range(2)]
    outs = []
    for proc in runs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        outs.append(out)
    assert sum("slabs resumed" in out for out in outs) == 1  # one claims the partial
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["b.h5"]
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_a_slab_whose_bytes_differ_from_its_record_is_computed_again(
    tmp_path, uninterrupted, device_spec
):
    """What the file holds counts, whatever the log says: a record whose CRC does not match
    the bytes read back (a cut write, a disk that lost them) is not kept."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    (partial,) = partials(tmp_path / "out")
    with h5py.File(partial / "b.h5", "r+", locking=False) as f:
        f["responses"][2, 0] = 7  # slab [0, 1) of filter 2: other bytes than recorded
    r = report_of(tmp_path, device=device_spec)
    assert r["resumed_slabs"] > 0  # the others are kept
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_a_live_runs_partial_is_not_taken(tmp_path, uninterrupted, device_spec):
    """Only runs that no longer run leave partials to resume: a stopped (SIGSTOP) run's
    folder is left alone, and that run finishes its own file when it goes on."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    out = tmp_path / "out"
    first = start(pipeline(tmp_path, device=device_spec))
    while slabs_recorded(out) < 40:
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)
    try:
        (partial,) = partials(out)
        assert f"-{first.pid}-" in partial.name and socket.gethostname() in partial.name
        r = report_of(tmp_path, device=device_spec)
        assert r["resumed_slabs"] == 0
        assert partial.is_dir()
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    with h5py.File(out / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_a_partial_with_every_slab_only_needs_finishing(tmp_path, uninterrupted, device_spec):
    """Stopped after its last slab was recorded, before the rename: the rerun computes
    nothing, and finishes the file."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    out, n = tmp_path / "out", volume.shape[0]
    calls = []

    def on_slab(job) -> None:  # after the last slab, once the log counts every slab: stop
        calls.append(job)
        deadline = time.monotonic() + 60
        while len(calls) == n and slabs_recorded(out) < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if len(calls) == n:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="keeps its complete slabs"):
        volconv_run(load(pipeline(tmp_path, device=device_spec)), on_slab=on_slab)
    (partial,) = partials(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    partial.rename(out / partial.name.replace(f"-{os.getpid()}-", f"-{dead}-"))

    r = report_of(tmp_path, device=device_spec)
    assert r["resumed_slabs"] == n and f"{n}/{n} slabs resumed" in r["stdout"]
    assert r["gflop"] == 0
    with h5py.File(out / "b.h5") as f:
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["responses"][()], whole)
    assert partials(out) == []


def test_a_complete_mark_in_a_partial_is_removed_on_resuming(tmp_path, uninterrupted, device_spec):
    """A run killed between writing ``complete = True`` and the rename leaves a partial that
    says complete: the rerun that continues it copies its slabs into a new file, which says
    complete only once whole."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    out = tmp_path / "out"
    recorded = stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    (partial,) = partials(out)
    with h5py.File(partial / "b.h5", "r+", locking=False) as f:
        f.attrs["complete"] = True
        f.attrs["the killed run's"] = True
    stop_mid_volume(
        tmp_path, signal.SIGKILL, at=recorded + 40, device=device_spec
    )  # resumed, then killed
    (partial,) = partials(out)
    with h5py.File(partial / "b.h5", locking=False) as f:  # a new file, the slabs copied
        assert "the killed run's" not in f.attrs and "complete" not in f.attrs
    code, _, err = run(pipeline(tmp_path, device=device_spec))
    assert code == 0, err
    with h5py.File(out / "b.h5") as f:
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["responses"][()], whole)


def test_the_log_counts_only_whole_lines(tmp_path):
    """A line cut short by a kill, or changed, is not a record."""
    from volconv.run.resume import _line, _records

    log = _line("volconv-progress 1 k") + _line("slab 0 0 1 0000abcd")
    bad = _line("slab 0 1 2 0000abcd").replace(b"slab 0 1", b"slab 0 7")
    assert _records(log + bad + _line("slab 0 2 3 00000001")[:-3]) == [
        ["volconv-progress", "1", "k"], ["slab", "0", "0", "1", "0000abcd"],
    ]  # fmt: skip


def test_a_run_stopped_in_this_process_resumes_in_it(tmp_path, uninterrupted, device_spec):
    """Ctrl-C in a notebook (the API's `run`): the partial stays, free once its run has
    stopped, and the next run in the same process continues it."""
    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    out = tmp_path / "out"
    calls = []

    def on_slab(job) -> None:
        calls.append(job)
        if len(calls) == 100:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="keeps its complete slabs"):
        volconv_run(load(pipeline(tmp_path, device=device_spec)), on_slab=on_slab)
    (partial,) = partials(out)
    assert f"-{os.getpid()}-" in partial.name
    recorded = slabs_recorded(out)
    assert recorded >= 90  # the writer runs at most two slabs behind, and stops
    result = volconv_run(load(pipeline(tmp_path, device=device_spec)))
    assert result.reports[0].resumed_slabs == recorded
    with h5py.File(out / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)
    assert partials(out) == []


# A writer of lzf chunks (two slabs' chunks in flight on the pool), each slab's buffer coming
# back 20 ms late so that it runs behind its producer; SIGKILLed once some slabs are recorded.
WRITER_CHILD = r"""
import sys, time
from concurrent.futures import Future
import numpy as np
from volconv.run.resume import Progress
from volconv.output import ResponseWriter
path = sys.argv[1]
data = np.load(sys.argv[2])
progress = Progress("key", lambda: "0" * 64)
w = ResponseWriter(path, data.shape[1:], ["a", "b", "c"], np.zeros((3, 1, 1, 1)),
                   dtype="float16", compression="lzf", boundary="reflect", cval=0.0,
                   slab_depth=2, progress=progress)
sha = Future()
sha.set_result("0" * 64)
progress.input_known(sha)  # as the pipeline does: only a log naming its input resumes
for a in range(0, data.shape[1], 2):
    w.write_slab(a, a + 2, data[:, a : a + 2], release=lambda: time.sleep(0.02))
time.sleep(600)  # killed before it finishes
"""


def test_a_writer_with_slabs_in_flight_killed_resumes_bit_for_bit(tmp_path):
    """With two slabs' chunks compressing at once and written as each is made, a slab is
    still recorded only once all its chunks are written and flushed: a writer killed at any
    moment resumes from exactly the slabs recorded, each read back whole, and the finished
    file is bitwise what one uninterrupted writer makes."""
    from volconv.output import ResponseWriter
    from volconv.run.resume import Progress

    rng = np.random.default_rng(7)
    data = (rng.standard_normal((3, 120, 32, 24)) * 50).astype(np.float16)
    np.save(tmp_path / "d.npy", data)
    out = tmp_path / "out"
    out.mkdir()
    path = out / "b.h5"

    def writer(target: Path, progress: Progress | None) -> ResponseWriter:
        return ResponseWriter(target, data.shape[1:], ["a", "b", "c"], np.zeros((3, 1, 1, 1)),
                              dtype="float16", compression="lzf", boundary="reflect",
                              cval=0.0, slab_depth=2, progress=progress)  # fmt: skip

    command = [sys.executable, "-c", WRITER_CHILD, str(path), str(tmp_path / "d.npy")]
    child = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while slabs_recorded(out) < 12:
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the writer recorded no progress"
        time.sleep(0.005)
    child.kill()
    child.communicate()
    recorded = slabs_recorded(out)
    assert 12 <= recorded < 60

    progress = Progress("key", lambda: "0" * 64)
    with writer(path, progress) as w:
        assert len(progress.done) == recorded  # each read back, its CRCs whole
        work = progress.remaining([(0, a, a + 2) for a in range(0, 120, 2)])
        assert len(work) == 60 - recorded
        for _, a, b in work:
            w.write_slab(a, b, data[:, a:b].copy())
        w.finish(dict.fromkeys(ROOT_ATTRS, 0))
    with writer(tmp_path / "whole.h5", None) as w:
        for a in range(0, 120, 2):
            w.write_slab(a, a + 2, data[:, a : a + 2].copy())
        w.finish(dict.fromkeys(ROOT_ATTRS, 0))
    with h5py.File(path) as f, h5py.File(tmp_path / "whole.h5") as g:
        assert f.attrs["complete"]
        np.testing.assert_array_equal(f["responses"][()], g["responses"][()])
        np.testing.assert_array_equal(f["responses"][()], data)
    assert partials(out) == []


def test_a_forged_log_claiming_unwritten_slabs_computes_them(tmp_path, uninterrupted, device_spec):
    """Records for slabs the file never got, with the CRCs of what an unwritten chunk reads
    as (HDF5's fill value, zeros), are not kept: a slab counts only where its chunks are on
    disk, and the rerun computes the rest, giving the same bits."""
    from volconv.run.resume import _line

    volume, whole = uninterrupted["3d"]
    np.save(tmp_path / "b.npy", volume)
    recorded = stop_mid_volume(tmp_path, signal.SIGKILL, device=device_spec)
    (partial,) = partials(tmp_path / "out")
    zeros = np.zeros((1, *volume.shape[1:]), np.float16)  # a slab is one row here
    crc = f"{zlib.crc32(zeros):08x}"
    forged = b"".join(_line(f"slab 0 {a} {a + 1} {','.join([crc] * len(FILTERS))}")
                      for a in range(recorded + 10, volume.shape[0]))  # fmt: skip
    with open(partial / "progress", "ab") as log:
        log.write(forged)
    r = report_of(tmp_path, device=device_spec)
    assert 0 < r["resumed_slabs"] < recorded + 10
    with h5py.File(tmp_path / "out" / "b.h5") as f:
        np.testing.assert_array_equal(f["responses"][()], whole)
