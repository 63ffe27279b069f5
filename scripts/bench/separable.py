"""Benchmark the separable path against today's direct path and scipy.ndimage, in one run.

On a synthetic n^3 uint8 volume (reflect mode), on one OpenCL device:
  1. the ilastik bank (pipelines/ilastik_features.toml, 48 filters) and the demo bank (8)
     through SeparableConvolver, against today's direct path (BankConvolver over the bank
     padded to its widest extent, 23^3 for ilastik). The direct path takes minutes on a CPU,
     so it is timed on a slab of interior rows of the same volume and scaled by the row
     count (its cost per output row is the same for every interior row; the boundary rows
     differ only in what pad.cl gathers).
  2. Gaussian-derivative banks (smoothing, gradient, Hessian, LoG at one sigma; and the whole
     ilastik bank) against scipy.ndimage's own separable filters (gaussian_filter with orders,
     gaussian_laplace, DoG as two gaussian_filter calls) on the same data, float32 output,
     each response checked against scipy's at the contract's tolerance.
  3. The cost model's terms: seconds per output of one pass by taps (fitted a + b * taps) and
     of the direct kernel per tap; where the device fuses (GPUs), the fused kernel's per term.
Times are the best of ``--repeats`` after a warm-up run (PoCL compiles each kernel at its
first launch). Kernel seconds come from OpenCL profiling events; wall seconds are the time to
all responses in host memory, slab by slab into one pinned buffer, as `volconv run` gets them.
``--banks demo --kernel-only``: the demo bank's kernel alone (the GPU session's figure).

    .venv/bin/python scripts/bench/run.py separable --json benchmarks/results/pocl-separable.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyopencl as cl
import scipy
import scipy.ndimage as ndi

from volconv.bank.filters import build_bank, stack_kernels
from volconv.bench import device_record
from volconv.checks import spec_tolerance
from volconv.device.devices import select_device
from volconv.device.peak import measured_peak, theoretical_peak
from volconv.device.programs import context_for
from volconv.engines.direct import BankConvolver
from volconv.engines.separable import SeparableConvolver
from volconv.plan.separable import describe_plan, plan_bank

ROOT = Path(__file__).resolve().parents[2]


def pipeline_specs(name: str) -> list[dict]:
    """The filters of pipelines/``name``.toml, each with its size (default: the bank's)."""
    bank = tomllib.loads((ROOT / "pipelines" / f"{name}.toml").read_text())["bank"]
    return [{"size": bank.get("size", 7), **spec} for spec in bank["filter"]]


def derivative_specs(sigma: float, size: int) -> list[dict]:
    """Smoothing, gradient, Hessian and LoG at one scale: 11 filters."""
    orders = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2, 0, 0), (0, 2, 0), (0, 0, 2),
              (1, 1, 0), (1, 0, 1), (0, 1, 1)]  # fmt: skip
    specs = [{"type": "gaussian", "sigma": sigma, "order": list(o), "size": size} for o in orders]
    return [*specs, {"type": "log", "sigma": sigma, "size": size}]


def run_convolver(conv, vol: np.ndarray, repeats: int) -> tuple[dict, np.ndarray, tuple]:
    """Best of ``repeats`` full passes over ``vol`` after a warm-up; the last slab's responses
    and its row range come back for checking."""
    buf = conv.pinned_slab()

    def once() -> tuple[float, dict]:
        before = dict(conv.timings)
        t = time.perf_counter()
        for a, b in conv.slabs():
            conv.convolve_slab(a, b, vol[conv.source_rows(a, b)], buf[:, : b - a])
        wall = time.perf_counter() - t
        return wall, {k: conv.timings[k] - before[k] for k in conv.timings}

    once()
    wall, stages = min((once() for _ in range(repeats)), key=lambda r: r[1]["kernel"])
    last = list(conv.slabs())[-1]
    return {"wall_seconds": wall, "stages": stages}, buf, last


def separable_record(filters, vol, device, repeats, peak) -> tuple[dict, np.ndarray, tuple]:
    conv = SeparableConvolver(filters, vol.shape, vol.dtype, "reflect", device=device)
    rec, buf, last = run_convolver(conv, vol, repeats)
    k = rec["stages"]["kernel"]
    names = [f.name for f in filters]
    rec.update(
        kernel_seconds=k,
        gflop=conv.gflop,
        executed_gflop=conv.executed_gflop,
        gflops=conv.gflop / k,
        executed_gflops=conv.executed_gflop / k,
        fraction_of_peak=conv.executed_gflop / k / peak if peak else None,
        kernel_bytes=conv.kernel_bytes,
        bandwidth_gbps=conv.kernel_bytes / k / 1e9,
        pass_counts=conv.pass_counts,
        engines=conv.engines,
        fused=conv.plan.fused,
        tile=conv.plan.tile if conv.plan.fused else None,
        slab_depth=conv.plan.slab_depth,
        paths=describe_plan(conv.plan.choices, names, conv.plan.fused).splitlines()[0],
    )
    return rec, buf, last


def direct_record(filters, vol, device, rows: int) -> dict:
    """Today's direct path (the bank padded to its widest extent) on ``rows`` interior rows,
    scaled to the whole volume."""
    kernels = stack_kernels(filters)
    conv = BankConvolver(kernels, vol.shape, vol.dtype, "reflect", device=device, slab_depth=rows)
    a = (vol.shape[0] - rows) // 2
    b = a + rows
    src = vol[conv.source_rows(a, b)]
    conv.convolve_slab(a, b, src)  # warm-up: compiles
    before = dict(conv.timings)
    t = time.perf_counter()
    conv.convolve_slab(a, b, src)
    wall = time.perf_counter() - t
    kernel = conv.timings["kernel"] - before["kernel"]
    scale = vol.shape[0] / rows
    return {
        "extent": list(kernels.shape[1:]),
        "rows_timed": rows,
        "scale": scale,
        "kernel_seconds_timed": kernel,
        "wall_seconds_timed": wall,
        "kernel_seconds": kernel * scale,
        "wall_seconds": wall * scale,
        "executed_gflop": conv.executed_gflop,  # padded to the widest extent: what it computes
        "gflops_executed": conv.executed_gflop / (kernel * scale),
        "how": f"timed on rows [{a}, {b}) of the same volume, scaled by {scale:g}",
    }


def apply_spec(nd, xp, vol, spec: dict, out, tmp) -> None:
    """``spec``'s filter by ``nd``'s own separable filters (scipy.ndimage or
    cupyx.scipy.ndimage, arrays of ``xp``) into ``out``, reflect mode, scipy's truncation."""
    size = int(spec["size"])
    sigma = float(spec.get("sigma", 1))
    kw = {"mode": "reflect", "truncate": (size // 2) / sigma}
    if spec["type"] == "box":
        nd.uniform_filter(vol, size, output=out, mode="reflect")
    elif spec["type"] == "gaussian":
        nd.gaussian_filter(vol, sigma, order=spec.get("order", 0), output=out, **kw)
    elif spec["type"] == "log":
        nd.gaussian_laplace(vol, sigma, output=out, **kw)
    else:  # dog: two Gaussians, subtracted
        sigma2 = float(spec["sigma2"])
        nd.gaussian_filter(vol, sigma, output=out, **kw)
        nd.gaussian_filter(vol, sigma2, output=tmp, mode="reflect",
                           truncate=(size // 2) / sigma2)  # fmt: skip
        xp.subtract(out, tmp, out=out)


def scipy_record(specs, filters, vol, buf, last) -> dict:
    """scipy.ndimage's separable filters for each spec (uint8 in, float32 out), timed, and the
    largest error of our last slab against them in units of the contract's tolerance."""
    out = np.empty(vol.shape, np.float32)
    tmp = np.empty(vol.shape, np.float32)
    a, b = last
    seconds, worst = 0.0, 0.0
    vmax = float(np.abs(vol).max())
    for f, (spec, flt) in enumerate(zip(specs, filters, strict=True)):
        t = time.perf_counter()
        apply_spec(ndi, np, vol, spec, out, tmp)
        seconds += time.perf_counter() - t
        tol = spec_tolerance(flt.kernel, vmax)
        err = float(np.abs(buf[f, : b - a].astype(np.float64) - out[a:b]).max())
        worst = max(worst, err / tol)
    return {"seconds": seconds, "worst_error_over_tolerance": worst,
            "how": "gaussian_filter(order=...), gaussian_laplace, DoG as two gaussian_filter, "
                   "uint8 in, float32 out, one thread"}  # fmt: skip


def cupyx_record(specs, vol, repeats: int) -> dict | None:
    """cupyx.scipy.ndimage's separable filters for each spec on the GPU (float32 in and out,
    as cupyx computes), timed with CUDA events, best of ``repeats``; None without CuPy."""
    try:
        import cupy as cp
        import cupyx.scipy.ndimage as cndi
    except ImportError:
        return None
    v = cp.asarray(vol, dtype=cp.float32)
    out, tmp = cp.empty_like(v), cp.empty_like(v)

    def bank() -> None:
        for spec in specs:
            apply_spec(cndi, cp, v, spec, out, tmp)

    bank()  # warm-up: compiles
    best = math.inf
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        bank()
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return {"seconds": best, "how": "cupyx.scipy.ndimage separable filters, float32, on the GPU "
            "(device time, CUDA events, best of repeats)"}  # fmt: skip


def cost_terms(device, repeats: int) -> dict:
    """Seconds per output of a single pass by taps, and of the direct kernel per tap, on a
    128^3 uint8 volume: the cost model's constants."""
    rng = np.random.default_rng(1)
    vol = rng.integers(0, 256, (128, 128, 128)).astype(np.uint8)
    per_output = {}
    for k in (3, 7, 11, 15, 23, 31):
        f = build_bank([{"type": "gaussian", "sigma": k / 6, "size": k}])
        conv = SeparableConvolver(f, vol.shape, vol.dtype, device=device, fused=False,
                                  choices=plan_bank(f, force="separable"))  # fmt: skip
        run_convolver(conv, vol, 1)
        a, b = next(conv.slabs())
        seconds = float(np.min(conv.time_kernel(a, b, repeats)))
        per_output[k] = seconds / (3 * vol.size)  # three passes of k taps per output
    ks = np.array(list(per_output))
    fit_b, fit_a = np.polyfit(ks, np.array(list(per_output.values())), 1)
    kernels = np.random.default_rng(2).standard_normal((8, 7, 7, 7))
    conv = BankConvolver(kernels, vol.shape, vol.dtype, device=device)
    run_convolver(conv, vol, 1)
    a, b = next(conv.slabs())
    direct = float(np.min(conv.time_kernel(a, b, repeats))) / (vol.size * 8 * 343)
    result = {
        "pass_seconds_per_output": {str(k): v for k, v in per_output.items()},
        "pass_fixed_seconds": fit_a,
        "pass_per_tap_seconds": fit_b,
        "direct_per_tap_seconds": direct,
        "model_in_direct_taps": {"PASS_FIXED": fit_a / direct, "PASS_PER_TAP": fit_b / direct},
    }
    if SeparableConvolver(f, vol.shape, vol.dtype, device=device).plan.fused:
        result.update(fused_terms(device, vol, repeats, direct))
    return result


def fused_terms(device, vol: np.ndarray, repeats: int, direct: float) -> dict:
    """The fused kernel's cost per output and filter (a bank of 4 distinct Gaussians of k^3 in
    one kernel), fitted a + b * k: the model's FIXED (the response's write) + PER_TAP * 3k."""
    per_term = {}
    for k in (3, 7, 11):
        f = build_bank([{"type": "gaussian", "sigma": k / 6 * (1 + i / 10), "size": k}
                        for i in range(4)])  # fmt: skip
        conv = SeparableConvolver(f, vol.shape, vol.dtype, device=device, fused=True,
                                  choices=plan_bank(f, force="separable"))  # fmt: skip
        run_convolver(conv, vol, 1)
        a, b = next(conv.slabs())
        per_term[k] = float(np.min(conv.time_kernel(a, b, repeats))) / (4 * vol.size)
    fit_b, fit_a = np.polyfit(np.array(list(per_term)), np.array(list(per_term.values())), 1)
    return {
        "fused_seconds_per_output_and_filter": {str(k): v for k, v in per_term.items()},
        "fused_model_in_direct_taps": {"FIXED": fit_a / direct, "PER_TAP": fit_b / 3 / direct},
    }  # fmt: skip


def copy_bandwidth(device) -> float:
    """GB/s of a device-to-device copy of 256 MiB (read + write counted), best of 3."""
    ctx, queue = context_for(device)
    n = 256 << 20
    src = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n)
    dst = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n)
    cl.enqueue_fill_buffer(queue, src, np.uint8(1), 0, n).wait()
    best = math.inf
    for _ in range(3):
        e = cl.enqueue_copy(queue, dst, src)
        e.wait()
        best = min(best, (e.profile.end - e.profile.start) * 1e-9)
    return 2 * n / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="edge of the n^3 uint8 volume")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--direct-rows", type=int, default=8, help="rows the direct path is timed on")
    p.add_argument(
        "--banks",
        default="ilastik_features,demo,derivatives,cost_model",
        help="what to measure, of ilastik_features, demo, derivatives, cost_model",
    )
    p.add_argument(
        "--kernel-only",
        action="store_true",
        help="the separable path alone: no scipy, direct path or cupyx beside it",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    banks = args.banks.split(",")

    device = select_device(args.device)
    peak = theoretical_peak(device).gflops
    n = args.size
    vol = np.random.default_rng(0).integers(0, 256, (n, n, n)).astype(np.uint8)
    result = {
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_record(device),
        "peak_gflops": peak,
        "measured_peak_gflops": measured_peak(device),
        "copy_bandwidth_gbps": copy_bandwidth(device),
        "scipy": scipy.__version__,
        "volume": {"shape": [n, n, n], "dtype": "uint8", "mode": "reflect"},
        "banks": {},
    }
    print(f"device {result['device']['name']}, peak {peak} GFLOP/s", flush=True)

    for name in [b for b in ("ilastik_features", "demo") if b in banks]:
        specs = pipeline_specs(name)
        filters = build_bank(specs)
        sep, buf, last = separable_record(filters, vol, device, args.repeats, peak)
        print(f"{name} separable: kernel {sep['kernel_seconds']:.4f} s, "
              f"wall {sep['wall_seconds']:.3f} s", flush=True)  # fmt: skip
        if args.kernel_only:
            result["banks"][name] = {"n_filters": len(filters), "separable": sep}
            continue
        ref = scipy_record(specs, filters, vol, buf, last)
        del buf
        print(f"{name} scipy: {ref['seconds']:.2f} s", flush=True)
        direct = direct_record(filters, vol, device, args.direct_rows)
        print(f"{name} direct (scaled): kernel {direct['kernel_seconds']:.4f} s", flush=True)
        peer = cupyx_record(specs, vol, max(args.repeats, 3))
        if peer:
            print(f"{name} cupyx: {peer['seconds'] * 1e3:.2f} ms", flush=True)
        result["banks"][name] = {
            "n_filters": len(filters), "separable": sep, "direct_today": direct, "scipy": ref,
            "cupyx": peer,
            "speedup_kernel_vs_direct": direct["kernel_seconds"] / sep["kernel_seconds"],
            "speedup_wall_vs_direct": direct["wall_seconds"] / sep["wall_seconds"],
            "speedup_wall_vs_scipy": ref["seconds"] / sep["wall_seconds"],
            "speedup_kernel_vs_scipy": ref["seconds"] / sep["kernel_seconds"],
        }  # fmt: skip

    derivatives = ((1.0, 7), (1.6, 11), (3.5, 23)) if "derivatives" in banks else ()
    for sigma, size in derivatives:
        specs = derivative_specs(sigma, size)
        filters = build_bank(specs)
        sep, buf, last = separable_record(filters, vol, device, args.repeats, peak)
        ref = scipy_record(specs, filters, vol, buf, last)
        del buf
        name = f"gaussian_derivatives_s{sigma}"
        result["banks"][name] = {
            "n_filters": len(filters), "separable": sep, "scipy": ref,
            "speedup_wall_vs_scipy": ref["seconds"] / sep["wall_seconds"],
            "speedup_kernel_vs_scipy": ref["seconds"] / sep["kernel_seconds"],
        }  # fmt: skip
        print(f"{name}: volconv wall {sep['wall_seconds']:.3f} s (kernel "
              f"{sep['kernel_seconds']:.3f} s), scipy {ref['seconds']:.2f} s")  # fmt: skip

    if "cost_model" in banks:
        result["cost_model"] = cost_terms(device, 3)
        for key in ("model_in_direct_taps", "fused_model_in_direct_taps"):
            print(key, json.dumps(result["cost_model"].get(key)), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
