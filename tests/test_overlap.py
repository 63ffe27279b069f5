"""Inputs overlapping in one run (`volconv.run.pipeline.run_overlapped`): input i+1 is read and
filtered while input i is still being written, every output exact, the records in order and
timed as the report documents; inputs of other shapes one after the other; a failing input
fails alone and leaves no temporary; a full disk stops the run."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from test_pipeline import ROOT, check_output, random_volume, volconv, write_pipeline

from volconv.config import load
from volconv.run.pipeline import run

FILTERS = [{"type": "gaussian", "sigma": 1.0}, {"type": "box"}]


def _temporaries(folder):
    return [p for p in folder.rglob("*") if ".partial-" in p.name]


def test_inputs_overlap_and_every_output_is_exact(tmp_path, device_spec):
    """gzip-9 makes each input's last slabs slow to write: the next input starts meanwhile."""
    volumes = {f"v{i}": random_volume((40, 48, 64), "float32") for i in range(3)}
    for name, v in volumes.items():
        np.save(tmp_path / f"{name}.npy", v)
    pipeline = write_pipeline(tmp_path, FILTERS, output={"compression": "gzip-9"},
                              run={"slab_depth": 8}, device=device_spec)  # fmt: skip
    seen: list[str] = []
    result = run(load(pipeline), on_volume=lambda r: seen.append(r.source))
    reports = result.reports
    assert [r.status for r in reports] == ["done"] * 3
    assert seen == [r.source for r in reports] and [r.source for r in reports] == sorted(seen)
    for name, v in volumes.items():
        check_output(tmp_path / "out" / f"{name}.h5", v.astype(np.float64)).close()
    pairs = list(itertools.pairwise(reports))
    # an input began before the one before it had its last slab written (any pair: on a
    # loaded 2-core machine one input's writing may end before the next one's read does)
    spans = [(r.started_at, r.wall_seconds) for r in reports]
    assert any(b.started_at < a.started_at + a.wall_seconds for a, b in pairs), spans
    assert all(before.stages["wall"] == before.wall_seconds for before, _ in pairs)
    last = reports[-1]
    assert result.seconds >= last.started_at + last.wall_seconds - reports[0].started_at
    assert not _temporaries(tmp_path)


def test_inputs_of_another_shape_wait_for_the_one_before(tmp_path, capsys, device_spec):
    """Two convolvers' pinned buffers at once could pass host_memory: no overlap then. The
    report holds the run's own seconds."""
    np.save(tmp_path / "a.npy", random_volume((20, 9, 10), "uint8"))
    np.save(tmp_path / "b.npy", random_volume((21, 9, 10), "uint8"))
    pipeline = write_pipeline(tmp_path, FILTERS, run={"slab_depth": 4}, device=device_spec)
    code, _, err = volconv("run", pipeline, "--report", tmp_path / "r.json", capsys=capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    a, b = doc["inputs"]
    assert b["started_at"] >= a["started_at"] + a["wall_seconds"]
    assert doc["run_seconds"] >= a["wall_seconds"] + b["wall_seconds"]


def test_a_failing_input_fails_alone_and_leaves_no_temporary(tmp_path, capsys, device_spec):
    """The second of three inputs is corrupt (found mid-read, while the third may be on the
    device): it fails alone, the others complete, exit 1, nothing half-written is left."""
    data = random_volume((24, 12, 10), "int16")
    for name in ("a", "c"):
        nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / f"{name}.nii")
    packed = bytearray(gzip.compress((tmp_path / "a.nii").read_bytes(), 1))
    packed[len(packed) // 2 : len(packed) // 2 + 64] = bytes(64)  # CRC now wrong
    (tmp_path / "b.nii.gz").write_bytes(bytes(packed))
    pipeline = write_pipeline(tmp_path, FILTERS, input={"paths": ["*.nii*"]},
                              run={"slab_depth": 4}, device=device_spec)  # fmt: skip
    code, out, err = volconv("run", pipeline, capsys=capsys)
    assert code == 1, err
    assert "failed" in out and "b.nii.gz: the gzip stream is corrupt" in " ".join(out.split())
    for name in ("a", "c"):
        with check_output(tmp_path / "out" / f"{name}.h5", data.astype(np.float64)):
            pass
    assert not (tmp_path / "out" / "b.h5").exists()
    assert not _temporaries(tmp_path)


@pytest.mark.parametrize("dtype", ["float16", "uint8"])
def test_overlapping_inputs_count_their_own_clipped_voxels(tmp_path, dtype, device_spec):
    """Each input's record counts its own saturated voxels, though they share a convolver."""
    quiet, loud = np.zeros((16, 8, 9), np.float32), np.full((16, 8, 9), 1e3, np.float32)
    np.save(tmp_path / "a.npy", quiet)
    np.save(tmp_path / "b.npy", loud)
    pipeline = write_pipeline(tmp_path, FILTERS, output={"dtype": dtype},
                              run={"slab_depth": 4}, device=device_spec)  # fmt: skip
    a, b = run(load(pipeline)).reports
    assert a.clipped == 0
    assert b.clipped == (2 * loud.size if dtype == "uint8" else 0)


def test_a_full_disk_mid_run_stops_the_input_after_it(tmp_path, tmpfs, device_spec):
    """b fills the disk while c may be on the device already: exit 1 in one line naming b,
    a kept complete, neither b nor c left behind, not even as a temporary."""
    disk = tmpfs("disk", "size=5m")
    for name in ("a", "b", "c"):
        np.save(tmp_path / f"{name}.npy", random_volume((64, 64, 64), "uint8"))  # 2 MiB out
    (disk / "filler").write_bytes(b"\0" * (2 * 2**20))
    pipeline = write_pipeline(tmp_path, FILTERS, output={"path": f"{disk}/out/{{stem}}.h5"},
                              run={"slab_depth": 8}, device=device_spec)  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "No space left on device" in done.stderr
    assert "b.h5" in done.stderr, done.stderr
    assert sorted(p.name for p in (disk / "out").iterdir()) == ["a.h5"]
    with check_output(disk / "out" / "a.h5", np.load(tmp_path / "a.npy").astype(np.float64)):
        pass


@pytest.mark.parametrize("host_memory", ["2GiB", "280KiB"], ids=["read-ahead", "no-room"])
def test_compressed_inputs_read_ahead_give_exact_outputs(tmp_path, host_memory, device_spec):
    """.nii.gz frames are read whole (decompressed once): the next one while this input is
    on the device where host_memory has room for both, else when its turn comes (280 KiB:
    each input holds 256 KiB at 8 rows, a frame is 30 KiB)."""
    volumes = {f"s{i}": random_volume((30, 26, 20), "int16") for i in range(3)}
    for name, v in volumes.items():
        nib.save(nib.Nifti1Image(v, np.eye(4)), tmp_path / f"{name}.nii.gz")
    pipeline = write_pipeline(tmp_path, FILTERS, input={"paths": ["*.nii.gz"]},
                              run={"slab_depth": 8,
                                   "host_memory": host_memory}, device=device_spec)  # fmt: skip
    reports = run(load(pipeline)).reports
    assert [r.status for r in reports] == ["done"] * 3
    for name, v in volumes.items():
        check_output(tmp_path / "out" / f"{name}.h5", v.astype(np.float64)).close()
