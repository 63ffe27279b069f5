"""Autotuning cached per device (`volconv.plan.tune`, `volconv bench --tune`) and the plan
reading the cache (`volconv.plan.knobs.tuned_knobs`): round trip, use, stale and corrupt files,
atomicity."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from conftest import assert_spec_close, reference
from typer.testing import CliRunner

import volconv.device.cache
from volconv import report
from volconv.bench import Work
from volconv.commands import app
from volconv.engines.direct import BankConvolver, convolve_bank
from volconv.engines.registry import ENGINES
from volconv.engines.tensor import TENSOR_ENGINE, tensor_supported
from volconv.plan.direct import make_plan
from volconv.plan.knobs import TUNE_FILE, TUNE_FORMAT, kernel_hash, tune_keys, tuned_knobs
from volconv.plan.tune import MARGIN, Candidates, tune_bank

TINY = Work((12, 10, 14), 3, (3, 5, 3), dtype="int16")
FEW = Candidates(vector_widths=(1, 4), unrolls=(2, 4), rows=(1, 2), input_local=(False, True),
                 local_sizes=((4, 2), (2, 4)))  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The user's cache folder, empty and private to the test."""
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def tuned(device, tmp_path_factory):
    """One tuning of TINY into a fresh cache: (cache folder, record)."""
    folder = tmp_path_factory.mktemp("tune")
    return folder, tune_bank(TINY, device=device, candidates=FEW, repeats=2, rounds=2,
                             cache_dir=folder)  # fmt: skip


def entry(**knobs) -> dict:
    """A valid cache entry for the current kernel, with ``knobs`` replaced."""
    e = {"format": TUNE_FORMAT, "kernel": kernel_hash(), "engine": ENGINES[0].name,
         "vector_width": 4, "unroll": 5, "rows": 1, "local_size": [2, 4]}  # fmt: skip
    return {**e, **knobs}


def write_entry(folder, device, work: Work, value) -> None:
    dev_key, bank_key = tune_keys(device, work.extent, work.n, np.dtype(work.dtype))
    report.write_json({dev_key: {bank_key: value}}, folder / TUNE_FILE)


def untuned_plan(device, work: Work, **kw):
    return make_plan(work.shape, np.dtype(work.dtype), work.extent, work.n, work.mode,
                     work.cval, device, **kw)  # fmt: skip


# -- tuning ---------------------------------------------------------------------------------


def test_tuning_picks_one_of_the_candidates(tuned):
    _, record = tuned
    win = record["winner"]
    timed = [p for p in record["points"] if "error" not in p]
    names = ("engine", "vector_width", "unroll", "rows", "local_size")
    knobs = [tuple(p[k] for k in names) for p in timed]
    assert tuple(win[k] for k in names) in knobs
    assert win["engine"] in [e.name for e in ENGINES]
    assert win["vector_width"] in (None, *FEW.vector_widths)
    assert win["unroll"] in (*FEW.unrolls, untuned_unroll(record))
    assert win["rows"] in (*FEW.rows, record["points"][0]["rows"])
    # the fastest finalist, unless the untuned plan (which ran beside them) is within MARGIN
    fastest = max(f["gflops"] for f in record["finalists"])
    assert win["untuned_gflops"] > 0
    assert win["gflops"] == fastest or win["gflops"] == win["untuned_gflops"] > fastest / MARGIN


def test_tuning_times_the_tensor_engine_where_it_runs(tuned, device):
    """On NVIDIA cc >= 8.0 the tensor engine is a candidate (int16: two digit slabs), timed
    once, with none of the FP32 kernel's knobs to search; elsewhere the FP32 kernel alone."""
    _, record = tuned
    timed = [p for p in record["points"] if "error" not in p]
    tensor = [p for p in timed if p["engine"] == "tensor"]
    if tensor_supported(device):
        assert [p["path"] for p in tensor] == [f"{TENSOR_ENGINE}x2"]
    else:
        assert not tensor and {p["engine"] for p in record["points"]} == {"fp32"}


def untuned_unroll(record) -> int:
    return record["points"][0]["unroll"]


def test_tuning_searches_the_rows_per_work_item(tuned):
    """Every candidate of rows is timed at the best width and unroll, and each point records
    the block it ran: the rows it asked for, clamped by the plan to the volume's."""
    _, record = tuned
    fp32 = [p for p in record["points"] if p["engine"] == "fp32" and "error" not in p]
    assert {p["rows"] for p in fp32} >= set(FEW.rows)
    assert all(1 <= p["rows"] <= TINY.shape[1] for p in fp32)


def test_tuning_searches_input_tiles(tuned):
    """Input planes in local memory or not, timed at the best width, unroll and rows (or
    refused by the plan, for an unroll that is not a multiple of 4), recorded per point."""
    _, record = tuned
    fp32 = [p for p in record["points"] if p["engine"] == "fp32"]
    ran = {p["input_local"] for p in fp32 if "error" not in p}
    refused = [p for p in fp32 if "error" in p and p.get("input_local")]
    assert ran == {False, True} or (ran == {False} and refused)
    assert all("multiple of 4" in p["error"] for p in refused)


def test_tuning_writes_the_cache_and_the_plan_reads_it(tuned, device):
    folder, record = tuned
    doc = json.loads((folder / TUNE_FILE).read_text())
    dev_key, bank_key = record["key"]
    assert doc[dev_key][bank_key] == record["winner"]
    assert [p.name for p in folder.iterdir()] == [TUNE_FILE]  # no temporary file left
    knobs = tuned_knobs(device, TINY.extent, TINY.n, np.dtype(TINY.dtype), cache_dir=folder)
    win = record["winner"]
    assert knobs == {"unroll": win["unroll"], "rows": win["rows"],
                     "input_local": win["input_local"], "local_size": tuple(win["local_size"]),
                     "vector_width": win["vector_width"], "engine": win["engine"]}  # fmt: skip


def test_cache_round_trip_keeps_other_entries(device, cache):
    other = {"another device | driver 1": {"7x7x7 N=8 uint8": entry(unroll=16)}}
    report.write_json(other, cache / TUNE_FILE)
    record = tune_bank(TINY, device=device, candidates=FEW, repeats=1, rounds=1)
    doc = json.loads((cache / TUNE_FILE).read_text())
    assert doc["another device | driver 1"] == other["another device | driver 1"]
    dev_key, bank_key = record["key"]
    assert doc[dev_key][bank_key]["unroll"] == record["winner"]["unroll"]


def test_cache_is_written_atomically(device, cache, monkeypatch):
    """The cache goes through a private temporary file renamed over it; a failed write leaves
    the old file whole and no temporary file behind, and the tuning says it failed."""
    old = {"another device | driver 1": {}}
    report.write_json(old, cache / TUNE_FILE)
    renames = []

    def failing(src, dst, **kw):
        renames.append((src, dst))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(volconv.device.cache.os, "replace", failing)
    with pytest.raises(OSError, match="No space"):
        tune_bank(TINY, device=device, candidates=FEW, repeats=1, rounds=1)
    # programs built on the way cache their binaries under cache/programs the same way (and
    # go on without them): only the tune file's rename is this test's
    ((name, _),) = [r for r in renames if r[1] == TUNE_FILE]
    assert name.startswith(f".{TUNE_FILE}.")
    monkeypatch.undo()
    assert json.loads((cache / TUNE_FILE).read_text()) == old
    assert sorted(p.name for p in cache.iterdir() if p.name != "programs") == [TUNE_FILE]
    assert not [p for p in cache.rglob(".*") if p.is_file()]  # no temporary file left


def test_write_false_caches_nothing(device, cache):
    record = tune_bank(TINY, device=device, candidates=FEW, repeats=1, rounds=1, write=False)
    assert record["cache"] is None and not (cache / TUNE_FILE).exists()


def test_an_engine_not_on_the_device_is_refused(device):
    with pytest.raises(ValueError, match="no engine"):
        tune_bank(TINY, device=device, candidates=Candidates(engines=("no-such-engine",)),
                  write=False)  # fmt: skip


# -- the plan reads the cache ---------------------------------------------------------------


def test_tuned_choice_is_used_and_still_matches_scipy(device, cache):
    work = Work((11, 13, 17), 3, (3, 5, 4), mode="mirror", dtype="int16")
    write_entry(cache, device, work, entry(unroll=5, rows=2, local_size=[2, 4], vector_width=4))
    rng = np.random.default_rng(3)
    volume = rng.integers(-300, 300, work.shape).astype(np.int16)
    kernels = rng.standard_normal((work.n, *work.extent))
    conv = BankConvolver(kernels, work.shape, volume.dtype, work.mode, device=device)
    assert conv.plan.unroll == 5 and conv.plan.local_size[:2] in ((2, 4), (2, 2), (2, 1))
    assert conv.plan.rows == 2
    assert [p.width for p in conv.plan.passes] == [4]
    assert untuned_plan(device, work, tuned=False).unroll != 5
    out = convolve_bank(volume, kernels, work.mode, device=device)
    assert_spec_close(out, volume, kernels, reference(volume, kernels, work.mode))


def test_a_tuned_input_tile_is_used_and_still_matches_scipy(device, cache):
    work = Work((9, 11, 30), 3, (3, 4, 5), mode="wrap", dtype="uint8")
    write_entry(cache, device, work, entry(unroll=8, input_local=True, local_size=[2, 4]))
    assert untuned_plan(device, work).input_local == 2
    assert untuned_plan(device, work, input_local=False).input_local == 0
    rng = np.random.default_rng(4)
    volume = rng.integers(0, 256, work.shape).astype(np.uint8)
    kernels = rng.standard_normal((work.n, *work.extent))
    out = convolve_bank(volume, kernels, work.mode, device=device)
    assert_spec_close(out, volume, kernels, reference(volume, kernels, work.mode))


def test_explicit_knobs_beat_the_cache(device, cache):
    write_entry(cache, device, TINY, entry(unroll=5))
    assert untuned_plan(device, TINY).unroll == 5
    assert untuned_plan(device, TINY, unroll=2).unroll == 2
    assert untuned_plan(device, TINY, tuned=False).unroll != 5


def test_an_entry_without_rows_leaves_the_rows_to_the_plan(device, cache):
    """Entries written before the tuner searched rows hold none: the plan's own rows."""
    write_entry(cache, device, TINY, {k: v for k, v in entry(unroll=5).items() if k != "rows"})
    assert tuned_knobs(device, TINY.extent, TINY.n, np.dtype(TINY.dtype))["rows"] is None
    p = untuned_plan(device, TINY)
    given = untuned_plan(device, TINY, unroll=5, vector_width=4, local_size=(2, 4), tuned=False)
    assert p.unroll == 5 and p.rows == given.rows  # the entry's other knobs, the plan's rows


def test_other_banks_take_the_defaults(device, cache):
    write_entry(cache, device, TINY, entry(unroll=5))
    other = Work(TINY.shape, TINY.n + 1, TINY.extent, dtype=TINY.dtype)
    assert untuned_plan(device, other) == untuned_plan(device, other, tuned=False)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not JSON"),
        (None, "stale"),  # an entry for another bank_conv.cl
        ("format", "stale"),
        ("unroll", "invalid knob"),
        ("rows", "invalid knob"),
        ("engine", "names engine 'no-such-engine', which does not run on"),
        ("local_size", "lacks a knob"),
        ("entry", "not an object"),
    ],
)
def test_corrupt_or_stale_cache_is_ignored_with_a_warning(device, cache, text, why):
    if text == "{not json":
        (cache / TUNE_FILE).write_text(text)
    else:
        bad = {
            None: entry(kernel="0123456789ab"),
            "format": entry(format=TUNE_FORMAT + 1),
            "unroll": entry(unroll=99),
            "rows": entry(rows=99),
            "engine": entry(engine="no-such-engine"),
            "local_size": entry(local_size="wide"),
            "entry": [1, 2],
        }[text]
        write_entry(cache, device, TINY, bad)
    with pytest.warns(RuntimeWarning, match=why):
        plan = untuned_plan(device, TINY)
    assert plan == untuned_plan(device, TINY, tuned=False)


def tiles_past_local_memory(device) -> tuple[tuple[int, int], int] | None:
    """A work-group the device takes whose input tiles at unroll 24, 4 rows need more local
    memory than it has, with those bytes; None where none does."""
    from volconv.plan.direct import tile_bytes

    most = device.max_work_group_size
    for lz in (64, 32, 16, 8):
        local = (lz, most // lz)
        if (need := tile_bytes(24, 4, local, (3, 5, 3))) > device.local_mem_size:
            return local, need
    return None


@pytest.mark.parametrize("misfit", ["work-group", "input tiles"])
def test_an_entry_that_does_not_fit_the_device_is_blamed_on_tune_json(device, cache, misfit):
    """A work-group of 1048576 x 1048576, or input tiles needing more local memory than the
    device has: ignored with a warning naming tune.json, the defaults taken, the run right
    (never an error naming the input)."""
    work = Work((16, 18, 20), 3, (3, 5, 3), dtype="int16")
    if misfit == "work-group":
        bad = entry(local_size=[1048576, 1048576], vector_width=4)
    else:
        found = tiles_past_local_memory(device)
        if found is None:
            pytest.skip(f"{device.name.strip()} has room for every input tile")
        bad = entry(unroll=24, rows=4, input_local=True, local_size=list(found[0]))
    write_entry(cache, device, work, bad)
    with pytest.warns(RuntimeWarning, match=TUNE_FILE) as seen:
        plan = untuned_plan(device, work)
    assert plan == untuned_plan(device, work, tuned=False)
    said = " ".join(str(w.message) for w in seen)
    assert str(cache / TUNE_FILE) in said and "N=3 int16" in said
    rng = np.random.default_rng(25)
    volume = rng.integers(-300, 300, work.shape).astype(np.int16)
    kernels = rng.standard_normal((work.n, *work.extent))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named once a run: not again
        out = convolve_bank(volume, kernels, work.mode, device=device)
    assert_spec_close(out, volume, kernels, reference(volume, kernels, work.mode))


# -- the command line -----------------------------------------------------------------------


def test_cli_bench_tune_caches_the_winner(device, cache, tmp_path):
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    args = ["bench", "--tune", "--device", spec, "--size", "8,9,10", "--n", "2", "--extent",
            "3", "--repeats", "1", "--json", str(tmp_path / "t.json")]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    record = json.loads((tmp_path / "t.json").read_text())
    dev_key, bank_key = record["key"]
    assert bank_key == "3x3x3 N=2 uint8"
    assert json.loads((cache / TUNE_FILE).read_text())[dev_key][bank_key] == record["winner"]
    assert "tuned" in out.output and str(cache / TUNE_FILE) in out.output
    plan = make_plan((8, 9, 10), np.dtype(np.uint8), (3, 3, 3), 2, "reflect", 0.0, device)
    assert plan.unroll == min(record["winner"]["unroll"], 16)
