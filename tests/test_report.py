"""volconv.report: the one work count, the throughput record and how it is shown."""

from __future__ import annotations

import json
import math

import pytest

from volconv.report import (
    VolumeReport,
    format_gflop,
    format_gflops,
    report_json,
    summary_line,
    throughput,
    work_gflop,
    write_json,
)


def test_work_counts_each_filter_at_its_own_extent():
    # log_blobs-like: small and large filters in one bank; no padding taps counted
    assert work_gflop([(3, 3, 3), (31, 31, 31)], 10**6) == pytest.approx(
        2 * 1e6 * (27 + 31**3) / 1e9
    )
    assert work_gflop([(2, 3, 4)] * 5, 7) == pytest.approx(2 * 7 * 5 * 24 / 1e9)


def test_fractions_of_peak_count_the_executed_work():
    r = throughput(2.0, 0.5, 1.0, 10.0, 20.0, executed_gflop=4.0, engine="separable")
    assert r["gflops"] == 4.0  # useful work over time: how fast the result came
    assert r["fraction_of_peak"] == pytest.approx(4.0 / 0.5 / 10.0)
    assert r["fraction_of_measured_peak"] == pytest.approx(4.0 / 0.5 / 20.0)
    assert r["engine"] == "separable" and r["executed_gflop"] == 4.0
    plain = throughput(2.0, 0.5, 1.0, None)
    assert plain["executed_gflop"] == 2.0 and math.isnan(plain["fraction_of_peak"])


def test_formats():
    assert format_gflops(66900.0) == "66.9 TFLOP/s"
    assert format_gflops(232.04) == "232.0 GFLOP/s"
    assert format_gflops(None) == format_gflops(math.nan) == "unknown"
    assert format_gflop(0.000142) == "0.000142"  # small volumes do not show 0.0
    assert format_gflop(1234.6) == "1235" and format_gflop(123.46) == "123"


def test_report_json_is_written_whole(tmp_path):
    r = VolumeReport("a.npy", "a.h5", (4, 4, 4), 1, "failed", reason="disk full")
    path = tmp_path / "r.json"
    doc = report_json([r], {"pipeline": "p.toml"}, path)
    assert json.loads(path.read_text()) == doc
    assert doc["inputs"][0]["reason"] == "disk full" and doc["total"] is None
    assert summary_line(r) == "failed a.npy: disk full"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left


def test_write_json_replaces_atomically(tmp_path):
    path = tmp_path / "x.json"
    write_json({"a": 1}, path)
    write_json({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 2}
    assert len(list(tmp_path.iterdir())) == 1


def test_memory_bound_passes_record_their_bandwidth():
    r = throughput(2.0, 0.5, 1.0, 10.0, executed_gflop=0.4, engine="separable",
                   kernel_bytes=4e9, measured_bandwidth_gbps=16.0)  # fmt: skip
    assert r["bandwidth_gbps"] == pytest.approx(8.0)
    assert r["fraction_of_bandwidth"] == pytest.approx(0.5)
    plain = throughput(2.0, 0.5, 1.0, 10.0)  # the direct kernel alone: compute-bound
    assert math.isnan(plain["bandwidth_gbps"]) and math.isnan(plain["fraction_of_bandwidth"])


def test_summary_line_labels_the_work_and_escapes_names():
    record = throughput(1000.0, 1.0, 2.0, 333.0, executed_gflop=10.0)
    r = VolumeReport("scans/a\nb.nii.gz", "out/a\nb.h5", (4, 4, 4), 2, "done", dtype="uint8",
                     extents=(3, 3, 3), **record)  # fmt: skip
    line = summary_line(r)
    assert "\n" not in line and "scans/a\\nb.nii.gz" in line and "out/a\\nb.h5" in line
    # 1.0 TFLOP/s of useful work beside 3.0 % of peak: which work each counts, said
    assert "1.0 TFLOP/s useful, 3.0 % of peak executed" in line
    failed = VolumeReport.failed("x\r\x1b[2Jy.npy", "x.h5", (1, 1, 1), 1, "bad\nreason")
    assert summary_line(failed) == "failed x\\r\\x1b[2Jy.npy: bad\\nreason"


def test_one_line_escapes_control_characters_only():
    from volconv.errors import one_line

    assert one_line("plain name, ünïcode ok.nii") == "plain name, ünïcode ok.nii"
    assert one_line("a\nb\tc\x00d\x7fe\u2028f") == "a\\nb\\tc\\x00d\\x7fe\\u2028f"
