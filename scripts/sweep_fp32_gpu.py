"""Sweep the FP32 kernel's register block (bank_conv.cl) on a GPU, in one call.

For each point on a 256^3 uint8 volume (the MNI152 scan in data/ where present and --random
not given, else random bytes) and N random normal k^3 filters (--extent, default 7), reflect:
a point is the plan's defaults (``[]`` in --points) or [unroll, rows, row_unroll, filt, roll,
width] at each work-group of --locals (row_unroll -1: the compiler's choice; filt 0: the filters
read from global memory, 1: staged in local memory; roll 1: the loop over filter rows with a
window of input rows, 0: over input rows; width: the vector width of the passes; unroll null:
the plan's block and work-group with the other knobs set); or a dict of those knobs by name,
``tile`` (bank_conv.cl's INPUT_LOCAL: 0 off, 1 or 2 tiles, true: the plan's count),
``define`` (a dict of more -D defines for that point's builds, e.g. {"BLOCK_TAPS": 100}),
``options`` (a list of more build options for them, e.g. ["-cl-nv-maxrregcount=128"]) and
``local`` [lz, ly] (absent: the plan's work-group); --options adds build options to every
point (e.g. -cl-nv-maxrregcount=168; ptxas ignores it for a kernel with a required
work-group size, as INPUT_LOCAL's). Run from another checkout's root with its volconv on
PYTHONPATH, it measures that checkout's kernel (knobs it lacks: leave them out). Kept:
  - the compiler's report of each build (``-cl-nv-verbose``: registers, spill bytes, stack
    frame, warnings) and its PTX (the binary pyopencl returns), kept in ``--ptx`` (a .tar.gz)
    for ptxas / nvdisasm; with ``--sass`` (on a node with ptxas and cuobjdump) each build's
    hot loop counted by opcode into the JSON, FFMAs taking a constant-bank or uniform-register
    operand apart (h100-fp32const-sweep7.json);
  - device seconds of the bank passes (OpenCL profiling events, `BankConvolver.time_kernel`)
    after one warm-up launch: minimum and median of ``--repeats``;
  - TFLOP/s of useful work against the FMA probe's rate measured in the same run;
  - correctness: the response buffer poisoned with NaN before the slab, every response
    written, and ``--samples`` random voxels per filter against a float64 reference
    (max |err| over SPEC.md's tolerance, <= 1 passes).
The JSON is rewritten after each point; the last lines print a table.

    PYOPENCL_NO_CACHE=1 python3 scripts/sweep_fp32_gpu.py --device nvidia \
        --json $OUT/sweep.json --ptx $OUT/ptx.tar.gz
    python3 scripts/sweep_fp32_gpu.py --ns 1,8 --extent 9 --points '{"1":[[]],"8":[[]]}' ...

The PTX in --ptx assembles with ptxas -arch=sm_90a (strip its trailing NUL bytes) and
disassembles with nvdisasm: benchmarks/results/h100-fp32-sass.txt.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
import time
from dataclasses import astuple, replace
from pathlib import Path

import numpy as np
import pyopencl as cl
from sass_counts import sass_counts  # scripts/ (this script's folder)

import volconv.engine as engine
from volconv.checks import spec_tolerance
from volconv.device import select_device
from volconv.engine import BankConvolver
from volconv.peak import probe_fma, theoretical_peak
from volconv.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
BUILDS: dict[tuple, dict] = {}
OPTIONS: list[str] = []  # build options of every bank_conv build (--options)


def verbose_build(ctx, name, defines, options=()):
    """engine.build with the compiler's report kept for bank_conv.cl."""
    nvidia = "NVIDIA" in ctx.devices[0].platform.name
    extra = ("-cl-nv-verbose",) if nvidia else ()
    if name == "bank_conv.cl":
        extra = (*extra, *OPTIONS)
    program = build(ctx, name, defines, (*options, *extra))
    if name == "bank_conv.cl":
        defines = (*defines, *((o, "") for o in OPTIONS))
    if name == "bank_conv.cl" and defines not in BUILDS:
        dev = ctx.devices[0]
        text = program.get_build_info(dev, cl.program_build_info.LOG)
        BUILDS[defines] = {"log": text, "binary": program.get_info(cl.program_info.BINARIES)[0]}
    return program


build = engine.build
engine.build = verbose_build


def report(text: str) -> dict[str, object]:
    """Registers, spill bytes and stack frame from a ptxas report (the last kernel's)."""
    get = lambda pat: [int(v) for v in re.findall(pat, text)]  # noqa: E731
    regs, frame = get(r"Used (\d+) registers"), get(r"(\d+) bytes stack frame")
    stores, loads = get(r"(\d+) bytes spill stores"), get(r"(\d+) bytes spill loads")
    warn = [ln for ln in text.splitlines() if "warning" in ln.lower()]
    return {"registers": regs[-1] if regs else None, "stack": frame[-1] if frame else None,
            "spill_stores": stores[-1] if stores else None,
            "spill_loads": loads[-1] if loads else None, "warnings": warn}  # fmt: skip


def load_volume(size: int, random: bool = False) -> np.ndarray:
    path = ROOT / "data" / "mni152_t1_256.nii"
    if size == 256 and path.exists() and not random:
        import nibabel

        return np.ascontiguousarray(np.asarray(nibabel.load(path).dataobj, np.uint8))
    return np.random.default_rng(1).integers(0, 256, (size,) * 3, dtype=np.uint8)


def sample_error(vol, bank, out, samples, rng) -> float:
    """Worst |out - ref| / tolerance over random voxels, reflect mode (odd extents)."""
    h = [k // 2 for k in bank.shape[1:]]
    padded = np.pad(vol.astype(np.float64), [(a, a) for a in h], mode="symmetric")
    pts = [rng.integers(0, s, samples) for s in vol.shape]
    worst = 0.0
    vmax = float(vol.max())
    kx, ky, kz = bank.shape[1:]
    for f, k in enumerate(bank):
        flipped = k[::-1, ::-1, ::-1]
        ref = np.array([np.sum(padded[x : x + kx, y : y + ky, z : z + kz] * flipped)
                        for x, y, z in zip(*pts, strict=True)])  # fmt: skip
        err = np.max(np.abs(out[f][tuple(pts)].astype(np.float64) - ref))
        worst = max(worst, float(err / spec_tolerance(k, vmax)))
    return worst


KNOBS = ("unroll", "rows", "row_unroll", "filt", "roll", "width", "tile")  # a point's, in order
POINTS = {  # N: [(unroll, rows)], each at every work-group of LOCALS[N] (sweep 1)
    8: [(8, 1), (4, 2), (8, 2), (16, 1), (4, 3), (4, 4), (6, 2), (12, 1)],
    1: [(16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4), (8, 4), (24, 4)],
    4: [(16, 1), (8, 2), (16, 2), (8, 4)],
    2: [(16, 1), (16, 2), (16, 4), (32, 2)],
    16: [(4, 1), (4, 2), (2, 2), (8, 1)],
}
LOCALS = {8: [(32, 4), (16, 8), (32, 2), (8, 16)], 1: [(32, 4), (16, 8), (32, 8), (8, 16)],
          4: [(32, 4), (16, 8)], 2: [(32, 4), (16, 8)], 16: [(32, 4)]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="nvidia")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--ns", default="8,1,4,2,16")
    ap.add_argument("--extent", type=int, default=7, help="k of the k^3 filters (odd)")
    ap.add_argument(
        "--options", default="", help="more build options, e.g. -cl-nv-maxrregcount=144"
    )
    ap.add_argument("--points", default=None, help="JSON {N: [[unroll, rows], ...]}")
    ap.add_argument("--locals", default=None, help="JSON {N: [[lz, ly], ...]}")
    ap.add_argument("--random", action="store_true", help="random bytes, not the scan")
    ap.add_argument("--float-slab", action="store_true", help="also the first point as float")
    ap.add_argument("--json", required=True)
    ap.add_argument("--ptx", default=None)
    ap.add_argument("--sass", action="store_true", help="ptxas + cuobjdump op counts per build")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    points = {int(k): [p if isinstance(p, dict) else tuple(p) for p in v]
              for k, v in json.loads(args.points).items()} \
        if args.points else POINTS  # fmt: skip
    locals_ = {int(k): [tuple(p) for p in v] for k, v in json.loads(args.locals).items()} \
        if args.locals else LOCALS  # fmt: skip

    base_options = args.options.split()
    OPTIONS[:] = base_options
    device = select_device(args.device)
    vol = load_volume(args.size, args.random)
    probe = probe_fma(device)
    peak = float(probe["gflops"])
    result = {"device": device.name.strip(), "driver": device.driver_version,
              "probe_gflops": peak, "theoretical_gflops": theoretical_peak(device).gflops,
              "shape": list(vol.shape), "random": args.random, "mode": "reflect",
              "options": args.options, "points": []}  # fmt: skip
    print(
        f"{result['device']} driver {result['driver']}: FMA probe {peak / 1e3:.1f} TFLOP/s",
        flush=True,
    )
    rng = np.random.default_rng(7)
    runs = []
    k = args.extent
    for n in (int(v) for v in args.ns.split(",")):
        bank = rng.standard_normal((n, k, k, k))
        variants = [(p, tuple(p["local"]) if "local" in p else None, False)
                    for p in points[n] if isinstance(p, dict)]  # fmt: skip
        variants += [
            (tuple(p), loc, False)
            for p in points[n]
            if p and not isinstance(p, dict)
            for loc in locals_.get(n, [(32, 4)])
        ]
        variants += [((), None, False) for p in points[n] if not p]  # the plan's defaults
        if args.float_slab and points[n][0]:
            variants.append((tuple(points[n][0]), locals_.get(n, [(32, 4)])[0], True))
        for knobs, local, float_slab in variants:
            # [] the plan's defaults; [unroll, rows, row_unroll, filt] (None: the plan's;
            # row_unroll -1: the compiler's choice; filt 0 global, 1 local)
            define = knobs.get("define", {}) if isinstance(knobs, dict) else {}
            more = knobs.get("options", []) if isinstance(knobs, dict) else []
            OPTIONS[:] = [*base_options, *(f"-D{key}={v}" for key, v in define.items()), *more]
            if isinstance(knobs, dict):
                knobs = tuple(knobs.get(key) for key in KNOBS)
            unroll, rows, row_unroll, filt, roll, width, tile = (*knobs, *[None] * 7)[:7]
            point = {"n": n, "extent": k, "unroll": unroll, "rows": rows,
                     "row_unroll": row_unroll, "filt": filt, "roll": roll, "width": width,
                     "tile": tile, "define": define, "options": more,
                     "local_size": list(local) if local else None,
                     "float_slab": float_slab}  # fmt: skip
            t0 = time.perf_counter()
            try:
                # no unroll given: the plan's block and work-group, with the other knobs set
                given = {"unroll": unroll, "rows": rows, "vector_width": width,
                         "local_size": local, "input_local": None if tile is None else bool(tile),
                         "pad_float": float_slab}  # fmt: skip
                given = {key: v for key, v in given.items() if v is not None}
                plan = make_plan(vol.shape, vol.dtype, (k, k, k), n, "reflect", 0.0, device,
                                 tuned=False, **given)  # fmt: skip
                if filt is not None:
                    plan = replace(plan, filt_local=filt == 1)
                if roll is not None:
                    plan = replace(plan, roll=bool(roll))
                if tile is not True and tile in (1, 2):  # the plan's block: this many tiles
                    plan = replace(plan, input_local=tile)
                if row_unroll is not None:
                    plan = replace(
                        plan, row_unroll=None if row_unroll < 0 else row_unroll
                    )  # -1: none
                conv = BankConvolver(bank, vol.shape, vol.dtype, "reflect", device=device,
                                     plan=plan)  # fmt: skip
                a, b = next(conv.slabs())
                nan = np.float32(np.nan)
                cl.enqueue_fill_buffer(conv.queue, conv._out, nan, 0, conv._out.size).wait()
                out = conv.convolve_slab(a, b, vol[conv.source_rows(a, b)])
                conv.time_kernel(a, b, 1)
                sec = conv.time_kernel(a, b, args.repeats)
                gflop = 2 * n * k**3 * (b - a) * vol.shape[1] * vol.shape[2] / 1e9
                defines = tuple(plan.build_options(plan.passes[0]).items())
                defines = (*defines, *((o, "") for o in OPTIONS))
                point.update({
                    "plan": {key: getattr(plan, key, None) for key in
                             ("unroll", "rows", "row_unroll", "roll", "local_size",
                              "filt_local", "input_local")},
                    "blocks": [[q.width, *astuple(plan.block(q))] for q in plan.passes],
                    "defines": dict(defines),
                    "passes": [q.width for q in plan.passes], "slab_rows": b - a,
                    "ms_min": float(sec.min()) * 1e3, "ms_median": float(np.median(sec)) * 1e3,
                    "tflops": gflop / float(sec.min()) / 1e3,
                    "of_probe": gflop / float(sec.min()) / peak,
                    "all_written": bool(np.isfinite(out).all()),
                    "err_over_tol": sample_error(vol, bank, out, args.samples, rng)
                    if b - a == vol.shape[0] else None,  # one slab: the whole volume
                    **report(build_log(defines)),
                })  # fmt: skip
                del conv, out
            except (cl.Error, ValueError, TypeError) as e:
                point["error"] = f"{type(e).__name__}: {e}"[:300]
            point["wall_s"] = time.perf_counter() - t0
            runs.append(point)
            result["points"] = runs
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
            print(line(point), flush=True)
    if args.sass:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(16) as pool:  # ptxas runs apart per build
            counts = pool.map(lambda b: sass_counts(b["binary"], args.arch), BUILDS.values())
            names = [build_name(d) for d in BUILDS]
            result["sass"] = dict(zip(names, counts, strict=True))
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        for name, c in result["sass"].items():
            print(f"SASS {name}: {c.get('ptxas', '')} loop {c.get('loop')}", flush=True)
    if args.ptx:
        with tarfile.open(args.ptx, "w:gz") as tar:
            for defines, b in BUILDS.items():
                name = build_name(defines)
                for suffix, data in ((".ptx", b["binary"]), (".log", b["log"].encode())):
                    info = tarfile.TarInfo(name + suffix)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    print("\n== best per N (min ms)")
    for n in sorted({p["n"] for p in runs}):
        ok = [p for p in runs if p["n"] == n and "ms_min" in p]
        for p in sorted(ok, key=lambda p: p["ms_min"])[:4]:
            print(line(p))


def build_name(defines: tuple) -> str:
    """A build's name from its defines."""
    return "_".join(f"{k}{v}" for k, v in defines)


def build_log(defines: tuple) -> str:
    """The compiler's report of the last build with these plan defines."""
    if defines in BUILDS:
        return BUILDS[defines]["log"]
    logs = [b["log"] for d, b in BUILDS.items() if d[: len(defines)] == defines]
    return logs[-1] if logs else ""


def line(p: dict) -> str:
    if all(p.get(key) is None for key in KNOBS):
        head = f"N={p['n']:<2} k={p['extent']} plan's {p.get('blocks', '')}"
    else:
        extra = "".join(
            f" {key}={p[key]}"
            for key in ("row_unroll", "filt", "roll", "width", "tile")
            if p.get(key) is not None
        )
        extra += "".join(f" {key}={v}" for key, v in (p.get("define") or {}).items())
        extra += "".join(f" {o}" for o in p.get("options") or [])
        wg = "x".join(map(str, p["local_size"])) if p["local_size"] else "plan's"
        head = (
            f"N={p['n']:<2} k={p['extent']} U={p['unroll']} R={p['rows']}{extra} wg={wg}"
            f"{' f32' if p['float_slab'] else ''}"
        )
    if "error" in p:
        return f"{head} ERROR {p['error']}"
    return (
        f"{head} {p['ms_min']:.3f} ms (med {p['ms_median']:.3f}) {p['tflops']:.1f} TF/s "
        f"{100 * p['of_probe']:.1f}% regs={p['registers']} spill={p['spill_stores']}/"
        f"{p['spill_loads']} stack={p['stack']} ok={p['all_written']} "
        f"err/tol={p['err_over_tol'] and round(p['err_over_tol'], 3)} "
        f"warn={len(p['warnings'])}"
    )


if __name__ == "__main__":
    main()
