"""The final table of `volconv run` (volconv.report.summary_table, printed by volconv.console):
it reads right at 80 and 100 columns, names whole, numbers never cut, useful and executed work
labelled, and its seconds add up to the wall."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from test_pipeline import random_volume, write_pipeline

from volconv.report import (
    DEVICE_STAGES,
    VolumeReport,
    fmt_fraction,
    fmt_seconds,
    format_gflop,
    other_seconds,
    summary_table,
    throughput,
)

SECONDS = re.compile(r"(\d+(?:\.\d+)?) (ms|s)\b")


def report(name: str, gflop: float, executed: float, kernel: float, stages: dict) -> VolumeReport:
    record = throughput(gflop, kernel, stages["wall"], 333.0, 300.0, executed_gflop=executed)
    r = VolumeReport(name, name + ".h5", (256, 256, 256), 48, "done", dtype="uint8",
                     extents=(23, 23, 23), **record)  # fmt: skip
    r.stages = stages
    return r


def stages(read: float, kernel: float, write: float, wall: float) -> dict[str, float]:
    return {"read": read, "upload": 0.0123, "pad": 0.0045, "kernel": kernel,
            "convert": 0.0067, "download": 0.089, "write": write, "wall": wall}  # fmt: skip


@pytest.fixture
def reports() -> list[VolumeReport]:
    return [
        # useful work far above the CPU's peak, the executed a few per cent of it
        report(
            "sub-01_ses-baseline_T1w.nii.gz", 1234.5678, 10.25, 1.0, stages(0.9, 1.0, 2.5, 6.75)
        ),
        report(
            "a_scan_with_a_long_name_of_the_kind_BIDS_makes_run-02.nii.gz",
            0.000142,
            0.0003,
            0.00071,
            stages(0.0004, 0.00071, 0.002, 1234.5),
        ),
        VolumeReport.failed("broken.nii.gz", "broken.h5", (4, 4, 4), 48, "gzip stream corrupt"),
        VolumeReport.skipped("done_before.nii.gz", "done_before.h5", (4, 4, 4), 48),
    ]


def cells(line: str) -> list[str]:
    return line.split()


@pytest.mark.parametrize("width", [80, 100])
def test_the_table_fits_and_keeps_every_number_and_name_whole(reports, width):
    text = summary_table(reports, "NVIDIA H100 80GB HBM3 (NVIDIA CUDA)", 333.0, 300.0,
                         width=width, run_seconds=1240.0, start_seconds=2.5)  # fmt: skip
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [ln for ln in lines if len(ln) > width]
    assert "…" not in text and "..." not in text
    for r in reports:  # the name whole on one line, never split
        assert any(r.source in line for line in lines), r.source
    for r in reports[:2]:
        # the numbers as formatted, whole, on the name's line or the one after it
        i = next(i for i, line in enumerate(lines) if r.source in line)
        row = lines[i] if len(cells(lines[i])) > 1 else lines[i + 1]
        for value in (format_gflop(r.gflop), f"{r.gflops:.1f}", fmt_fraction(r.fraction_of_peak),
                      fmt_fraction(r.fraction_of_measured_peak)):  # fmt: skip
            assert value in row, (value, row)
        j = next(i for i, line in enumerate(lines) if r.source in line and i > lines.index(row))
        times = lines[j] if len(cells(lines[j])) > 1 else lines[j + 1]
        assert fmt_seconds(r.stages["wall"]) in times, times
    assert any(line.split()[:2] == ["broken.nii.gz", "failed"] for line in lines)
    assert any(line.split()[:2] == ["done_before.nii.gz", "skipped"] for line in lines)
    # the device and its peak close the table
    assert " ".join(text.split()[-12:]).endswith("FMA probe 300.0 GFLOP/s")


def test_useful_and_executed_work_are_labelled(reports):
    text = summary_table(reports[:1], "cpu", 333.0, width=80)
    header = text.splitlines()[:2]
    assert header[0].split() == ["GFLOP", "GFLOP/s", "GFLOP/s", "of", "peak", "of", "probe"]
    assert header[1].split() == ["input", "useful", "useful", "executed", "executed", "executed"]
    row = text.splitlines()[3].split()
    # 1.2 TFLOP/s of useful work beside 3 % of peak: the executed rate says why
    assert row[2] == "1234.6" and row[3] == "10.2" and row[4:6] == ["3.1", "%"]
    assert "useful: the bank's work as scipy.ndimage.convolve" in " ".join(text.split())


def seconds(cell: str, unit: str) -> float:
    return float(cell) / (1000 if unit == "ms" else 1)


def test_the_seconds_add_up_to_the_wall(reports):
    text = summary_table(reports, "cpu", 333.0, width=80, run_seconds=1240.0)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["input", "read"])
    rows = [line for line in lines[head + 2 :] if len(SECONDS.findall(line)) == 5]
    assert len(rows) == 3  # two inputs and the total
    for line in rows:
        read, device, write, other, wall = (seconds(*m) for m in SECONDS.findall(line))
        # to the table's rounding: 0.05 ms a cell under a second, 5 ms above
        tol = sum(5e-3 if v >= 1 else 5e-5 for v in (read, device, write, other, wall))
        if other > 0:
            assert read + device + write + other == pytest.approx(wall, abs=tol), line
        else:
            assert read + device + write >= wall - tol, line
    total = rows[-1].split()
    assert total[0] == "total" and fmt_seconds(1240.0) in rows[-1]  # the run's own wall
    r = reports[0]
    busy = r.stages["read"] + r.stages["write"] + sum(r.stages[s] for s in DEVICE_STAGES)
    assert other_seconds(r.stages, r.stages["wall"]) == pytest.approx(r.stages["wall"] - busy)
    assert other_seconds({"read": 2.0, "write": 2.0}, 3.0) == 0.0  # overlapped
    assert math.isnan(other_seconds({}, math.nan))


@pytest.mark.parametrize("columns", [80, 100])
def test_a_run_prints_the_table_within_the_terminal_width(tmp_path, columns):
    for i, shape in enumerate([(12, 10, 8), (9, 8, 7)]):
        np.save(tmp_path / f"input_{i}_with_a_rather_long_file_name.npy",
                random_volume(shape, "uint8"))  # fmt: skip
    pipeline = write_pipeline(tmp_path, [{"type": "box"}, {"type": "log", "sigma": 1}])
    env = {**os.environ, "COLUMNS": str(columns)}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "volconv", "run", str(pipeline), "--report", "r.json"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if not line.startswith("done ")) :]
    assert all(len(line) <= columns for line in table), [ln for ln in table if len(ln) > columns]
    doc = json.loads((tmp_path / "r.json").read_text())
    for r in doc["inputs"]:
        assert any(os.path.basename(r["source"]) in line for line in table)
        assert format_gflop(r["gflop"]) in done.stdout
        assert fmt_seconds(r["wall_seconds"]) in done.stdout
    assert fmt_seconds(doc["run_seconds"]) in done.stdout  # the total's wall: the run's
    # and the time before the first input is said: the table accounts for the process
    (start,) = [line for line in table if line.startswith("start: ")]
    said = seconds(*SECONDS.search(start).groups())
    assert said == pytest.approx(doc["start_seconds"], abs=0.01)
    assert doc["start_seconds"] > 0 and doc["start_seconds"] + doc["run_seconds"] < took
