"""Kernel throughput on a synthetic volume, as a fraction of the device's peak: `volconv bench`.

Every figure is the median of ``repeats`` timings of the bank passes alone
(`BankConvolver.time_kernel`, OpenCL profiling events) after a warm-up, over the first slab
of the plan, and counts GFLOP as docs/contract.md does: ``2 * N * prod(extent) * voxels``.
Sweeps vary N (with the plan's own choices) and the kernel's tuning knobs (CONV_UNROLL and
work-group shape at the given N), as seed 003's figures did. Peers time the same work
(`volconv.bench_peers`).

`run_bench` returns a JSON-ready dict; `write_plots` draws it with matplotlib.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv import __version__
from volconv.bench_peers import run_peers
from volconv.device.devices import select_device
from volconv.device.peak import fp32_peak, measured_peak
from volconv.engines.direct import BankConvolver
from volconv.report import format_gflops, work_gflop

DEFAULT_SWEEP_N = (1, 2, 4, 8, 13, 16, 32)
DEFAULT_SWEEP_UNROLL = (1, 2, 4, 8, 16, 24, 32)
DEFAULT_SWEEP_LOCAL = ((8, 8), (16, 8), (16, 16), (32, 4))

Progress = Callable[[str, dict], None]


@dataclass(frozen=True)
class Work:
    """The synthetic job: a random volume of ``shape`` and a random bank of ``n`` filters."""

    shape: tuple[int, int, int]
    n: int
    extent: tuple[int, int, int]
    mode: str = "reflect"
    dtype: str = "uint8"
    cval: float = 0.0

    def volume(self, shape: tuple[int, int, int] | None = None, seed: int = 0) -> np.ndarray:
        """Random voxels over the dtype's range (integers) or [0, 1) (floats)."""
        rng = np.random.default_rng(seed)
        shape = shape or self.shape
        dt = np.dtype(self.dtype)
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
        return rng.random(shape, dtype=np.float32).astype(dt)

    def kernels(self, n: int | None = None, seed: int = 1) -> np.ndarray:
        """A random (n, *extent) bank: every tap non-zero, so no work can be skipped."""
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n or self.n, *self.extent))

    def __str__(self) -> str:
        shape, ext = ("x".join(map(str, t)) for t in (self.shape, self.extent))
        return f"{shape} {self.dtype}, N={self.n}, {ext} filters, {self.mode}"

    def gflop(self, n: int | None = None, shape: Sequence[int] | None = None) -> float:
        """The work of ``n`` filters over ``shape`` (`volconv.report.work_gflop`)."""
        return work_gflop([self.extent] * (n or self.n), int(np.prod(shape or self.shape)))


@dataclass(frozen=True)
class Peaks:
    """Theoretical and measured FP32 peak of the device, GFLOP/s (None: unknown)."""

    theoretical: float | None
    how: str
    measured: float | None

    def fractions(self, gflops: float) -> dict[str, float | None]:
        return {
            "fraction_of_peak": gflops / self.theoretical if self.theoretical else None,
            "fraction_of_measured_peak": gflops / self.measured if self.measured else None,
        }


def device_record(device: cl.Device) -> dict[str, object]:
    """The device and driver, named as a reader of the JSON needs them."""
    return {
        "name": device.name.strip(),
        "platform": device.platform.name.strip(),
        "platform_version": device.platform.version.strip(),
        "driver": device.driver_version.strip(),
        "vendor": device.vendor.strip(),
        "compute_units": device.max_compute_units,
        "clock_mhz": device.max_clock_frequency,
    }


def volume_record(volume: np.ndarray, device: cl.Device) -> dict[str, object]:
    """A benchmark's head: when, the volume's shape and type, the device."""
    from datetime import UTC, datetime

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shape": list(volume.shape),
        "dtype": str(volume.dtype),
        "device": device_record(device),
    }


def time_volconv(
    work: Work,
    volume: np.ndarray,
    device: cl.Device,
    peaks: Peaks,
    *,
    n: int | None = None,
    repeats: int = 10,
    unroll: int | None = None,
    local_size: tuple[int, int] | None = None,
) -> tuple[dict[str, object], tuple[int, int], np.ndarray]:
    """Time the bank passes over the plan's first slab; the point, the slab and its responses.

    ``unroll`` and ``local_size`` override the plan (the plan may clamp them to what the
    device and the kernel allow: the point records what ran).
    """
    n = n or work.n
    conv = BankConvolver(
        work.kernels(n), work.shape, volume.dtype, work.mode, work.cval, device=device,
        unroll=unroll, local_size=local_size,
    )  # fmt: skip
    a, b = next(conv.slabs())
    responses = conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
    conv.time_kernel(a, b, 1)  # warm-up: clocks up, caches and the driver's JIT settled
    seconds = conv.time_kernel(a, b, repeats)
    gflop = work.gflop(n, (b - a, *work.shape[1:]))
    median = float(np.median(seconds))
    plan = conv.plan
    point = {
        "n": n,
        "unroll": plan.unroll,
        "rows_per_item": plan.rows,
        "local_size": list(plan.local_size[:2]),
        "passes": [p.width for p in plan.passes],
        "rows": b - a,
        "seconds": median,
        "seconds_min": float(np.min(seconds)),
        "gflop": gflop,
        "gflops": gflop / median,
        **peaks.fractions(gflop / median),
    }
    return point, (a, b), responses


# -- the bench ------------------------------------------------------------------------------


def peak_record(peaks: Peaks) -> dict[str, object]:
    """The JSON record of the peaks."""
    return {
        "theoretical_gflops": peaks.theoretical,
        "theoretical_how": peaks.how,
        "measured_gflops": peaks.measured,
        "measured_how": "kernels/fma_probe.cl, best launch (volconv.device.peak.measured_peak)",
    }


def peaks_of(device: cl.Device, *, refresh: bool = False) -> Peaks:
    """The FP32 peak fractions are taken against (`volconv.device.peak.fp32_peak`: the model, or
    the probe where it measured more) and the (cached) FMA probe's rate."""
    measured = measured_peak(device, refresh=refresh)
    peak = fp32_peak(device, measured)
    return Peaks(peak.gflops, peak.how, measured)


def run_bench(
    work: Work,
    *,
    device: cl.Device | str | None = None,
    repeats: int = 10,
    sweep_n: Sequence[int] = DEFAULT_SWEEP_N,
    sweep_unroll: Sequence[int] = DEFAULT_SWEEP_UNROLL,
    sweep_local: Sequence[tuple[int, int]] = DEFAULT_SWEEP_LOCAL,
    peers: bool = False,
    scipy_size: int = 64,
    refresh_peak: bool = False,
    progress: Progress | None = None,
) -> dict[str, object]:
    """Time ``work`` on ``device``: the plan's own point, the sweeps and optionally the peers.

    Returns the JSON record (see benchmarks/README.md). ``progress(section, result)`` is called
    after each point with the record so far, so a caller can show and save partial results.
    A point the device cannot run (out of resources) is recorded with its ``error``.
    """
    device = device if isinstance(device, cl.Device) else select_device(device)
    peaks = peaks_of(device, refresh=refresh_peak)
    volume = work.volume()
    result: dict[str, object] = {
        "volconv_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_record(device),
        "peak": peak_record(peaks),
        "work": {
            **asdict(work),
            "shape": list(work.shape),
            "extent": list(work.extent),
            "gflop": work.gflop(),
            "repeats": repeats,
        },
        "default": None,
        "sweep_n": [],
        "sweep_unroll": [],
        "peers": [],
    }

    def report(section: str) -> None:
        if progress:
            progress(section, result)

    point, rows, responses = time_volconv(work, volume, device, peaks, repeats=repeats)
    result["default"] = point
    report("default")
    if peers:
        result["peers"] = run_peers(
            work, volume, rows, responses, point["gflops"], repeats=repeats,
            scipy_size=scipy_size,
        )  # fmt: skip
        report("peers")
    del responses

    def measure(section: str, **knobs: object) -> None:
        try:
            pt = time_volconv(work, volume, device, peaks, repeats=repeats, **knobs)[0]
        except cl.Error as e:  # e.g. OUT_OF_RESOURCES: registers for a wide unroll
            pt = {"error": f"{type(e).__name__}: {e}"}
        requested = {f"{k}_requested": list(v) if isinstance(v, tuple) else v
                     for k, v in knobs.items()}  # fmt: skip
        result[section].append({**requested, **pt})
        report(section)

    for n in sweep_n:
        measure("sweep_n", n=n)
    for local in sweep_local:
        for unroll in sweep_unroll:
            measure("sweep_unroll", unroll=unroll, local_size=tuple(local))
    return result


# -- plots ----------------------------------------------------------------------------------


def _peak_lines(ax, result: dict) -> None:
    """Theoretical and measured peak as horizontal lines, and % of theoretical on the right."""
    peak = result["peak"]
    theory, measured = peak["theoretical_gflops"], peak["measured_gflops"]
    if theory:
        ax.axhline(theory, color="black", lw=1.2, label=f"theoretical peak {format_gflops(theory)}")
        ax.secondary_yaxis(
            "right", functions=(lambda g: 100 * g / theory, lambda p: p * theory / 100)
        ).set_ylabel("% of theoretical peak")
    if measured:
        ax.axhline(
            measured, color="black", lw=1.2, ls="--", label=f"FMA probe {format_gflops(measured)}"
        )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("GFLOP/s")
    ax.grid(alpha=0.3)


def _title(result: dict, what: str) -> str:
    w, d = result["work"], result["device"]
    size = "x".join(map(str, w["shape"]))
    ext = "x".join(map(str, w["extent"]))
    return f"{what}\n{d['name']} ({d['driver']}) · {size} {w['dtype']} · {ext} · {w['mode']}"


def write_plots(result: dict, prefix: str | Path) -> list[Path]:
    """``PREFIX-n.png`` (GFLOP/s against N) and ``PREFIX-unroll.png`` (against CONV_UNROLL,
    a line per work-group shape), each with the peaks as lines; the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    figures = (
        ("n", "sweep_n", "N (filters in the bank)", "Throughput against the number of filters"),
        ("unroll", "sweep_unroll", "CONV_UNROLL (outputs per work-item)",
         f"Throughput against CONV_UNROLL, N = {result['work']['n']}"),
    )  # fmt: skip
    for suffix, section, xlabel, what in figures:
        points = [p for p in result[section] if "gflops" in p]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
        x = "n" if section == "sweep_n" else "unroll"
        # a line per work-group shape asked for; the N sweep has one, the plan's
        for local in dict.fromkeys(str(p.get("local_size_requested")) for p in points):
            pts = [p for p in points if str(p.get("local_size_requested")) == local]
            label = (
                "volconv" if local == "None" else "work-group {}x{}".format(*pts[0]["local_size"])
            )
            ax.plot([p[x] for p in pts], [p["gflops"] for p in pts], "o-", label=label)
        ticks = sorted({p[x] for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        _peak_lines(ax, result)
        ax.set_xlabel(xlabel)
        ax.set_title(_title(result, what), fontsize=9)
        ax.legend(fontsize=8, loc="best")
        path = prefix.with_name(f"{prefix.name}-{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# -- options and text -----------------------------------------------------------------------


def parse_ints(text: str, option: str, *, lo: int = 1, hi: int | None = None) -> tuple[int, ...]:
    """``"1,2,4"`` as (1, 2, 4) (``""``: none); ValueError naming ``option`` otherwise."""
    items = [t for t in text.replace("x", ",").split(",") if t.strip()]
    try:
        values = tuple(int(t) for t in items)
    except ValueError:
        raise ValueError(f"{option}: expected integers separated by commas; got {text!r}") from None
    bad = [v for v in values if v < lo or (hi is not None and v > hi)]
    if bad:
        raise ValueError(f"{option}: {bad[0]} is outside {lo}..{hi if hi else 'inf'}")
    return values


def parse_shape(text: str, option: str, *, hi: int | None = None) -> tuple[int, int, int]:
    """One integer for a cube, or three (``7`` or ``7,7,5``)."""
    values = parse_ints(text, option, hi=hi)
    if len(values) == 1:
        return values * 3
    if len(values) != 3:
        raise ValueError(f"{option}: expected one integer or three; got {text!r}")
    return values


def parse_local_sizes(text: str, option: str) -> tuple[tuple[int, int], ...]:
    """``"16x8,32x4"`` as ((16, 8), (32, 4)): work-items along z (fastest) x along y."""
    sizes = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        lz, _, ly = item.partition("x")
        if not (lz.isdigit() and ly.isdigit() and int(lz) > 0 and int(ly) > 0):
            raise ValueError(
                f"{option}: expected sizes like 16x8 separated by commas; got {item!r}"
            )
        sizes.append((int(lz), int(ly)))
    return tuple(sizes)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f} %"


def _rate(gflops: float | None) -> str:
    return format_gflops(gflops)


def point_line(p: dict) -> str:
    """One point as a line of text."""
    if "error" in p:
        knobs = ", ".join(
            f"{k.removesuffix('_requested')}={v}" for k, v in p.items() if k != "error"
        )
        return f"{knobs}: {p['error']}"
    lz, ly = p["local_size"]
    return (
        f"N={p['n']:<3} unroll={p['unroll']:<3} work-group={lz}x{ly:<3} "
        f"{p['seconds'] * 1e3:9.3f} ms {_rate(p['gflops']):>15}  {_pct(p['fraction_of_peak'])} "
        f"of peak  {_pct(p['fraction_of_measured_peak'])} of probe"
    )


def peer_line(p: dict) -> str:
    """One peer as a line of text."""
    if "gflops" not in p:
        return f"{p['name']}: {p.get('skipped') or p.get('error')}"
    diff = f", diff {p['diff_vs_volconv']:.2g} x tol" if "diff_vs_volconv" in p else ""
    return (
        f"{p['name']} on {p['device']}: {_rate(p['gflops'])}, volconv/peer "
        f"{p['ratio']:.3g}x{diff} ({p['note']})"
    )


def summary(result: dict) -> str:
    """A short text summary: device, peaks, the plan's point, the best of each sweep, peers."""
    d, pk = result["device"], result["peak"]
    theory, measured = pk["theoretical_gflops"], pk["measured_gflops"]
    probe = f" = {_pct(measured / theory).strip()} of theoretical" if theory and measured else ""
    lines = [
        f"device     {d['name']} ({d['platform']}, driver {d['driver']})",
        f"peak       theoretical {_rate(theory)} ({pk['theoretical_how']})",
        f"           FMA probe {_rate(measured)}{probe}",
    ]
    if w := result.get("work"):
        lines.append(
            f"work       {'x'.join(map(str, w['shape']))} {w['dtype']}, N={w['n']}, "
            f"{'x'.join(map(str, w['extent']))}, {w['mode']}: {w['gflop']:.3g} GFLOP per volume"
        )
    if result.get("default"):
        lines.append(f"plan       {point_line(result['default'])}")
    for section, label in (("sweep_n", "best N"), ("sweep_unroll", "best knobs")):
        ok = [p for p in result.get(section, []) if "gflops" in p]
        if ok:
            lines.append(f"{label:<11}{point_line(max(ok, key=lambda p: p['gflops']))}")
    lines += [f"peer       {peer_line(p)}" for p in result.get("peers", [])]
    return "\n".join(lines)
