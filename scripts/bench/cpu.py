"""The CPU path (PoCL) against scipy.ndimage.convolve and the FMA probe, in one run.

The issue-12 measure: a bank of N random filters (default 8 of 7^3) over an n^3 uint8 volume
(default 96^3, reflect), the direct kernel's rate (OpenCL profiling events over the whole
volume, GFLOP as docs/contract.md counts them) over scipy.ndimage.convolve's (float32 input, one
filter at a time, one thread), both on this machine and in the same run. Beside them, in turns:
  - the FMA probe (`volconv.device.peak.probe_fma`, uncached): the kernel's rate as its fraction;
  - the plan's own knobs (what a user gets), the slab padded as uint8 (the CPU default
    before), the choice `volconv bench --tune` makes here (`volconv.plan.tune.tune_bank`, not
    cached), and CONV_UNROLL x work-group shapes, so that defaults are chosen from the data;
  - the one-call user's costs in a fresh process: import, `BankConvolver()`, the first slab,
    and `convolve_bank` of the whole volume end to end against scipy's wall time.
With ``--widths``, only what a pass of each vector width costs, for several N (the CPU's
pass efficiencies in volconv/plan/direct.py).
The machine is shared: every round times everything once, in turns, each part after waiting
(``--wait`` seconds at most) for the CPUs to be less than ``--quiet`` busy with other work, and
records the load average and how busy they were; figures are the fastest of the rounds (other
work only ever slows a run down), and each round's own ratio is kept too.

    .venv/bin/python scripts/bench/run.py cpu --json benchmarks/results/pocl-cpu-kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import numpy as np
import scipy
import scipy.ndimage as ndi

from volconv.bench import Work, device_record
from volconv.checks import spec_tolerance
from volconv.device.devices import select_device
from volconv.device.peak import measured_peak, probe_fma, theoretical_peak
from volconv.engines.direct import BankConvolver
from volconv.plan.tune import tune_bank, winner_line
from volconv.report import write_json

UNROLLS = (8, 12, 16, 24)
WIDTH_NS = (1, 2, 4, 8, 13, 16)
LOCALS = ((1, 128), (2, 32), (4, 8), (8, 16), (16, 8))

# A one-call user in a fresh process: the seconds of each step, as JSON on stdout.
STARTUP = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from volconv.engines.direct import BankConvolver, convolve_bank
from volconv.device.devices import select_device
from volconv.bench import Work
t1 = time.perf_counter()
work = Work(tuple(json.loads(sys.argv[1])), int(sys.argv[2]), tuple(json.loads(sys.argv[3])))
volume, kernels = work.volume(), work.kernels()
device = select_device(sys.argv[4])
t2 = time.perf_counter()
conv = BankConvolver(kernels, work.shape, volume.dtype, device=device)
t3 = time.perf_counter()
a, b = next(conv.slabs())
conv.convolve_slab(a, b, volume[conv.source_rows(a, b)])
t4 = time.perf_counter()
convolve_bank(volume, kernels, device=device)
t5 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "device": t2 - t1, "bank_convolver": t3 - t2,
                  "first_slab": t4 - t3, "convolve_bank": t5 - t4}))
"""


def configs(tuned: dict) -> list[tuple[str, dict]]:
    """(label, BankConvolver knobs): the plan's own, the uint8 slab, `volconv bench --tune`'s
    choice, unroll x work-group."""
    out = [("plan", {}), ("plan, slab uint8", {"pad_float": False}), ("tuned", tuned)]
    for u in UNROLLS:
        for lz, ly in LOCALS:
            out.append((f"unroll {u}, work-group {lz}x{ly}", {"unroll": u, "local_size": (lz, ly)}))
    return out


def busy(seconds: float = 0.5) -> float:
    """The fraction of this machine's CPU time spent busy over ``seconds`` (/proc/stat): the
    other users' load, when nothing of ours runs."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:8]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def quiet(threshold: float, wait: float) -> float:
    """Wait up to ``wait`` seconds for the machine to be under ``threshold`` busy; the
    fraction busy it last saw."""
    end = time.monotonic() + wait
    while (b := busy()) >= threshold and time.monotonic() < end:
        pass
    return b


def scipy_seconds(volume: np.ndarray, kernels: np.ndarray, mode: str) -> float:
    """scipy.ndimage.convolve of the float32 volume, one filter after another."""
    t0 = time.perf_counter()
    for k in kernels:
        ndi.convolve(volume, k, mode=mode)
    return time.perf_counter() - t0


def startup(work: Work, device: str) -> dict[str, float]:
    args = [json.dumps(list(work.shape)), str(work.n), json.dumps(list(work.extent)), device]
    out = subprocess.run([sys.executable, "-c", STARTUP, *args], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def width_sweep(args: argparse.Namespace, device) -> dict:
    """Seconds of the bank for N in `WIDTH_NS` at each vector width (one pass or several) and
    at the plan's own split, in turns: what a pass of each width costs on this CPU."""
    points = []
    for n in WIDTH_NS:
        work = Work((args.size,) * 3, n, (args.extent,) * 3, args.mode)
        volume, kernels = work.volume(), work.kernels()
        for width in (None, 1, 4, 8, 16):
            conv = BankConvolver(kernels, work.shape, volume.dtype, work.mode, device=device,
                                 tuned=False, vector_width=width)  # fmt: skip
            conv.convolve_slab(0, work.shape[0], volume)
            conv.time_kernel(0, work.shape[0], 1)
            passes = [p.width for p in conv.plan.passes]
            points.append({"n": n, "vector_width": width, "gflop": work.gflop(), "seconds": [],
                           "passes": passes, "conv": conv})  # fmt: skip
    for _ in range(args.rounds):
        quiet(args.quiet, args.wait)
        for p in points:
            p["seconds"].append(float(np.min(p["conv"].time_kernel(0, args.size, args.launches))))
    for p in points:
        del p["conv"]
        best = min(p["seconds"])
        p.update(seconds_min=best, gflops=p["gflop"] / best)
        print(f"N={p['n']:<3} width={p['vector_width'] or 'plan':<5} passes={p['passes']}: "
              f"{best * 1e3:7.2f} ms {p['gflops']:6.1f} GFLOP/s", flush=True)  # fmt: skip
    return {"what": "the cost of a pass by vector width on this CPU (scripts/bench/cpu.py "
                    "--widths)", "command": " ".join(sys.argv),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": device_record(device), "shape": [args.size] * 3,
            "extent": [args.extent] * 3, "points": points}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--extent", type=int, default=7)
    ap.add_argument("--mode", default="reflect")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--launches", type=int, default=3, help="kernel launches per round")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.2,
        help="before each measurement, wait for the machine to be less busy",
    )
    ap.add_argument("--wait", type=float, default=120, help="... for at most this long (s)")
    ap.add_argument(
        "--widths", action="store_true", help="only the sweep of vector widths for several N"
    )
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()

    device = select_device(args.device)
    if args.widths:
        record = width_sweep(args, device)
        if args.json:
            write_json(record, args.json)
        return
    work = Work((args.size,) * 3, args.n, (args.extent,) * 3, args.mode)
    volume, kernels = work.volume(), work.kernels()
    v32, k32 = volume.astype(np.float32), kernels.astype(np.float32)
    gflop = work.gflop()
    print(f"{device.name.strip()}: {work}, {gflop:.3g} GFLOP", flush=True)

    tune = tune_bank(work, device=device, repeats=args.launches, write=False)
    tuned = {k: tune["winner"][k] for k in ("vector_width", "unroll", "local_size")}
    print(f"tuned: {winner_line(tune)}", flush=True)
    convs = []
    for label, knobs in configs(tuned):
        conv = BankConvolver(kernels, work.shape, volume.dtype, work.mode, device=device,
                             tuned=False, **{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in knobs.items()})  # fmt: skip
        a, b = next(conv.slabs())
        assert (a, b) == (0, work.shape[0]), "the whole volume in one slab"
        out = conv.convolve_slab(a, b, volume)
        conv.time_kernel(a, b, 1)  # warm-up: PoCL builds the work-group function here
        plan = conv.plan
        convs.append({"label": label, "conv": conv, "seconds": [],
                      "knobs": {"unroll": plan.unroll, "local_size": list(plan.local_size[:2]),
                                "passes": [p.width for p in plan.passes],
                                "slab": plan.pad_dtype.name}})  # fmt: skip
        if label == "plan":  # the plan's responses against float64 scipy, once
            ref = [ndi.convolve(volume.astype(np.float64), k, mode=work.mode) for k in kernels]
            err = max(float(np.max(np.abs(out[f] - ref[f]))) / spec_tolerance(k, 255.0)
                      for f, k in enumerate(kernels))  # fmt: skip
    print(f"plan's error: {err:.3g} of the contract's tolerance", flush=True)

    rounds = []
    for r in range(args.rounds):
        load = os.getloadavg()
        seen = [quiet(args.quiet, args.wait)]
        probe = probe_fma(device)
        seen.append(quiet(args.quiet, args.wait))
        sp = scipy_seconds(v32, k32, work.mode)
        seen.append(quiet(args.quiet, args.wait))
        for c in convs:
            c["seconds"].append(float(np.min(c["conv"].time_kernel(0, work.shape[0],
                                                                   args.launches))))  # fmt: skip
        seen.append(quiet(args.quiet, args.wait))
        st = startup(work, args.device)
        plan = convs[0]["seconds"][-1]
        rounds.append({"loadavg_1_5_15": list(load),
                       "busy_before_probe_scipy_kernels_startup": seen,
                       "probe_gflops": probe["gflops"],
                       "probe_variant": probe["variant"], "scipy_seconds": sp,
                       "plan_seconds": plan, "ratio": sp / plan, "startup": st,
                       "end_to_end_ratio": sp / st["convolve_bank"]})  # fmt: skip
        print(f"round {r}: load {load[0]:.2f}, busy {max(seen):.0%}, probe "
              f"{probe['gflops']:.1f} GFLOP/s, scipy {gflop / sp:.2f} GFLOP/s, plan "
              f"{gflop / plan:.1f} GFLOP/s = {sp / plan:.1f}x, "
              f"convolve_bank {st['convolve_bank']:.3f} s = {sp / st['convolve_bank']:.1f}x, "
              f"BankConvolver() {st['bank_convolver']:.3f} s, first slab "
              f"{st['first_slab']:.3f} s", flush=True)  # fmt: skip

    probe = max(r["probe_gflops"] for r in rounds)
    cached = measured_peak(device, probe=False)  # the probe on a quiet machine, when cached
    sp = min(r["scipy_seconds"] for r in rounds)
    points = []
    for c in convs:
        s = min(c["seconds"])
        points.append({"label": c["label"], **c["knobs"], "seconds": s, "gflops": gflop / s,
                       "fraction_of_probe": gflop / s / probe, "ratio_to_scipy": sp / s,
                       "seconds_per_round": c["seconds"]})  # fmt: skip
    for p in sorted(points, key=lambda p: p["seconds"]):
        print(
            f"{p['label']:<32} {p['seconds'] * 1e3:7.2f} ms {p['gflops']:6.1f} GFLOP/s "
            f"{100 * p['fraction_of_probe']:5.1f} % of probe {p['ratio_to_scipy']:5.1f}x scipy"
        )
    plan = points[0]
    best_startup = {k: min(r["startup"][k] for r in rounds) for k in rounds[0]["startup"]}
    summary = {
        "plan_gflops": plan["gflops"],
        "plan_fraction_of_probe": plan["fraction_of_probe"],
        "ratio_to_scipy": plan["ratio_to_scipy"],
        "ratio_to_scipy_per_round": [r["ratio"] for r in rounds],
        "end_to_end_ratio": sp / best_startup["convolve_bank"],
        "best_point": min(points, key=lambda p: p["seconds"])["label"],
        "probe_gflops": probe,
        "cached_probe_gflops": cached,
        "plan_fraction_of_cached_probe": plan["gflops"] / cached if cached else None,
        "scipy_gflops": gflop / sp,
        "startup_seconds": best_startup,
        "error_over_tolerance": err,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        peak = theoretical_peak(device)
        write_json({
            "what": "issue 12 item 3: the direct kernel on PoCL against scipy.ndimage.convolve "
                    "and the FMA probe, in one run (scripts/bench/cpu.py)",
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": device_record(device),
            "theoretical_peak_gflops": peak.gflops,
            "theoretical_peak_how": peak.how,
            "machine": {"cpus": os.cpu_count(), "scipy": scipy.__version__},
            "work": {"shape": list(work.shape), "n": work.n, "extent": list(work.extent),
                     "dtype": work.dtype, "mode": work.mode, "gflop": gflop},
            "summary": summary,
            "rounds": rounds,
            "points": points,
            "tune": tune,
        }, args.json)  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
