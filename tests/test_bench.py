"""`volconv bench` on the test device with tiny sizes: JSON fields, plots, peers, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pyopencl as cl
import pytest
import scipy.ndimage as ndi
from typer.testing import CliRunner

from volconv import bench, bench_peers
from volconv.checks import MODES
from volconv.cli import UserError
from volconv.commands import app

POINT_FIELDS = {
    "n", "unroll", "local_size", "passes", "rows", "seconds", "seconds_min", "gflop", "gflops",
    "fraction_of_peak", "fraction_of_measured_peak",
}  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"
TINY = bench.Work((10, 9, 12), 2, (3, 3, 3))


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    """The FMA probe's cache in a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VOLCONV_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def result(device):
    return bench.run_bench(
        TINY, device=device, repeats=2, sweep_n=(1, 3), sweep_unroll=(1, 4),
        sweep_local=((4, 2), (8, 1)), peers=True, scipy_size=8,
    )  # fmt: skip


def test_gflop_counted_as_spec():
    w = bench.Work((4, 5, 6), 3, (3, 5, 7))
    assert w.gflop() == pytest.approx(2 * 3 * 105 * 120 / 1e9)
    assert w.gflop(n=1, shape=(2, 2, 2)) == pytest.approx(2 * 105 * 8 / 1e9)


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_synthetic_volume_and_bank(dtype):
    w = bench.Work((5, 6, 7), 4, (3, 2, 3), dtype=dtype)
    v = w.volume()
    assert v.shape == (5, 6, 7) and v.dtype == np.dtype(dtype)
    assert np.array_equal(v, w.volume())  # seeded: the same work every run
    k = w.kernels()
    assert k.shape == (4, 3, 2, 3) and np.all(k != 0)


def test_result_fields(result, device):
    assert result["device"]["name"] == device.name.strip()
    assert result["device"]["driver"] == device.driver_version.strip()
    peak = result["peak"]
    assert peak["theoretical_how"] and peak["measured_gflops"] > 0
    assert result["work"]["shape"] == [10, 9, 12] and result["work"]["repeats"] == 2
    default = result["default"]
    assert default.keys() >= POINT_FIELDS
    assert default["n"] == 2
    assert default["gflops"] == pytest.approx(default["gflop"] / default["seconds"])
    assert default["fraction_of_measured_peak"] == pytest.approx(
        default["gflops"] / peak["measured_gflops"]
    )
    if peak["theoretical_gflops"]:
        assert default["fraction_of_peak"] == pytest.approx(
            default["gflops"] / peak["theoretical_gflops"]
        )
    # one slab: the timed rows' share of the volume's GFLOP
    assert default["gflop"] == pytest.approx(TINY.gflop() * default["rows"] / 10)


def test_sweeps(result):
    assert [p["n"] for p in result["sweep_n"]] == [1, 3]
    assert all(p.keys() >= POINT_FIELDS for p in result["sweep_n"] + result["sweep_unroll"])
    knobs = [(p["local_size_requested"], p["unroll_requested"]) for p in result["sweep_unroll"]]
    assert knobs == [([4, 2], 1), ([4, 2], 4), ([8, 1], 1), ([8, 1], 4)]
    assert [p["local_size"] for p in result["sweep_unroll"]] == [[4, 2], [4, 2], [8, 1], [8, 1]]
    assert [p["unroll"] for p in result["sweep_unroll"]] == [1, 4, 1, 4]
    assert json.loads(json.dumps(result)) == result  # JSON as it is


def test_peers(result):
    peers = {p["name"]: p for p in result["peers"]}
    assert set(peers) == {
        "scipy.ndimage.convolve", "torch.nn.functional.conv3d", "cupyx.scipy.ndimage.convolve",
    }  # fmt: skip
    sp = peers["scipy.ndimage.convolve"]
    assert sp["shape"] == [8, 8, 8] and "timed on 8x8x8" in sp["note"]
    assert sp["ratio"] == pytest.approx(result["default"]["gflops"] / sp["gflops"])
    for p in peers.values():  # each either ran, or says why not
        assert "gflops" in p or p.get("skipped") or p.get("error")
        if "diff_vs_volconv" in p:
            assert p["diff_vs_volconv"] <= 1


def test_plots(result, tmp_path):
    paths = bench.write_plots(result, tmp_path / "sub" / "pocl")
    assert [p.name for p in paths] == ["pocl-n.png", "pocl-unroll.png"]
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_summary_names_everything(result):
    text = bench.summary(result)
    for line in ("device", "peak", "work", "plan", "best N", "best knobs", "peer"):
        assert any(ln.startswith(line) for ln in text.splitlines()), line
    assert "volconv/peer" in text


def test_failing_point_is_recorded(device, monkeypatch):
    real = bench.time_volconv

    def sometimes(*args, unroll=None, **kw):
        if unroll == 2:
            raise cl.RuntimeError("clEnqueueNDRangeKernel failed: OUT_OF_RESOURCES")
        return real(*args, unroll=unroll, **kw)

    monkeypatch.setattr(bench, "time_volconv", sometimes)
    seen = []
    out = bench.run_bench(
        TINY, device=device, repeats=1, sweep_n=(), sweep_unroll=(1, 2),
        sweep_local=((4, 2),), progress=lambda section, r: seen.append(section),
    )  # fmt: skip
    ok, failed = out["sweep_unroll"]
    assert ok["gflops"] > 0
    assert failed == {
        "unroll_requested": 2, "local_size_requested": [4, 2],
        "error": "RuntimeError: clEnqueueNDRangeKernel failed: OUT_OF_RESOURCES",
    }  # fmt: skip
    assert seen == ["default", "sweep_unroll", "sweep_unroll"]
    assert "OUT_OF_RESOURCES" in bench.point_line(failed)


def _valid_correlation(padded: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape)
    return np.einsum("xyzijk,ijk->xyz", windows, kernel)


@pytest.mark.parametrize("mode", MODES)
def test_padded_volume_makes_conv3d_scipy(mode):
    """What the torch peer computes (valid correlation, flipped kernel) is scipy's convolve."""
    rng = np.random.default_rng(3)
    v = rng.integers(0, 255, (5, 6, 4)).astype(np.uint8)
    k = rng.standard_normal((3, 4, 2))  # even extents: scipy's origin shift
    padded = bench_peers.padded_volume(v, k.shape, mode, cval=2.5)
    assert padded.dtype == np.float32
    got = _valid_correlation(padded.astype(np.float64), k[::-1, ::-1, ::-1])
    want = ndi.convolve(v.astype(np.float64), k, mode=mode, cval=2.5)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize(
    ("text", "parsed"), [("1,2, 4", (1, 2, 4)), ("", ()), ("7", (7,)), ("3x4x5", (3, 4, 5))]
)
def test_parse_ints(text, parsed):
    assert bench.parse_ints(text, "--x") == parsed


def test_parse_errors_name_the_option():
    with pytest.raises(ValueError, match="--sweep-n: expected integers"):
        bench.parse_ints("1,two", "--sweep-n")
    with pytest.raises(ValueError, match=r"--sweep-unroll: 40 is outside 1\.\.32"):
        bench.parse_ints("8,40", "--sweep-unroll", hi=32)
    with pytest.raises(ValueError, match="--extent: expected one integer or three"):
        bench.parse_shape("3,3", "--extent")
    with pytest.raises(ValueError, match="--sweep-local: expected sizes like 16x8"):
        bench.parse_local_sizes("16x8,4", "--sweep-local")
    assert bench.parse_shape("7", "--extent") == (7, 7, 7)
    assert bench.parse_local_sizes("16x8, 32x4,", "--sweep-local") == ((16, 8), (32, 4))


# -- the command line -----------------------------------------------------------------------


def test_cli_bench_writes_json_and_plots(device, tmp_path):
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    args = [
        "bench", "--device", spec, "--size", "8,9,10", "--n", "2", "--extent", "3",
        "--repeats", "2", "--sweep-n", "1", "--sweep-unroll", "2", "--sweep-local", "4x2",
        "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b"),
    ]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["work"]["shape"] == [8, 9, 10] and data["work"]["extent"] == [3, 3, 3]
    assert data["device"]["name"] == device.name.strip()
    assert len(data["sweep_n"]) == 1 and len(data["sweep_unroll"]) == 1
    assert data["peers"] == []
    for name in ("b-n.png", "b-unroll.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
    assert "FMA probe" in out.output and "plan" in out.output


def test_cli_peak_only(device, tmp_path):
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    args = ["bench", "--device", spec, "--peak-only", "--json", str(tmp_path / "p.json")]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads((tmp_path / "p.json").read_text())
    assert set(data) == {"device", "peak"} and data["peak"]["measured_gflops"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep-unroll", "4,64"], "--sweep-unroll: 64 is outside"),
        (["--mode", "reflekt"], "--mode must be one of"),
        (["--dtype", "float64"], "--dtype: 'float64'"),
        (["--n", "0"], "--n: 0 is outside"),
        (["--extent", "3,3"], "--extent: expected one integer or three"),
        (["--size", "100000"], "--size 100000: the volume alone takes 931322.6 GiB"),
    ],
)
def test_cli_bad_options_are_user_errors(args, message):
    out = CliRunner().invoke(app, ["bench", *args])
    assert isinstance(out.exception, UserError)
    assert message in str(out.exception)
