"""The skimage preset's kernels per scale and per variant of their build options, for tuning.

Runs the "skimage" feature set of scripts/bench/features.py (same volume, same slab by slab
run) once per variant: module constants of volconv.engines.smoothing and .scales (work-group
shapes, outputs per work-item), extra -D defines of kernels/stencils.cl (SK_*) and of
kernels/smoothing.cl, and extra compiler options of stencils.cl (e.g. NVIDIA's
-cl-nv-maxrregcount). Each Gaussian pass is timed per scale (smooth_z_s0 .. smooth_x_s5).
With --report, NVIDIA's compiler report (-cl-nv-verbose: registers, spills) of each variant's
skimage_scale and of smoothing.cl at the widest and narrowest radius. JSON to --json.

    python3 scripts/bench/run.py skimage_variants --json $OUT/skp/variants.json --report
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyopencl as cl
from features import feature_sets, run_volconv, volume_of

from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.device.programs import kernel_source
from volconv.engines import clock, features, scales, smoothing

BASE = {"OUT_PER_ITEM": 16, "X_PER_ITEM": 17, "ROW_PER_ITEM": 8, "LINE_GROUP": 32,
        "BLOCKS": 8, "ROW_GROUP": 32, "ROW_LINES": 8, "TILE": (32, 4, 2), "SUB_ROWS": 32,
        "SKIMAGE_ROWS": 16, "SKIMAGE_TILE": (32, 8), "TAP_CHUNK": 16, "CHUNK_FROM": 64}  # fmt: skip
OLD = {"SKIMAGE_TILE": None, "SKIMAGE_ROWS": 4}  # stage 2 by skimage_scale
VARIANTS = [
    {},
    {"SKIMAGE_ROWS": 8},
    OLD,
    {**OLD, "X_PER_ITEM": 16, "TAP_CHUNK": 0},  # before skimage_tile and the smoothing's shapes
    {"defines": [("SK_NO_EIGEN", 1)]},  # timing only: no eigenvalues
]


class ScaleClock(clock.KernelClock):
    """A `KernelClock` naming each Gaussian pass by its scale (smooth_x closes a scale)."""

    scales = 6

    def __init__(self) -> None:
        super().__init__()
        self._k = 0

    def add(self, name: str, event: cl.Event) -> cl.Event:
        if name.startswith("smooth_"):
            s = self._k % self.scales
            if name == "smooth_x":
                self._k += 1
            name = f"{name}_s{s}"
        return super().add(name, event)


def compiler_report(ctx: cl.Context, name: str, flags: list[str]) -> list[str]:
    """NVIDIA's -cl-nv-verbose lines (registers, spills) of kernels/``name`` (stencils.cl:
    behind eigen.cl) built with ``flags``."""
    source = kernel_source(name)
    if name == "stencils.cl":
        source = kernel_source("eigen.cl") + "\n" + source
    try:
        prog = cl.Program(ctx, source).build(options=[*flags, "-cl-nv-verbose"])
        log = prog.get_build_info(ctx.devices[0], cl.program_build_info.LOG)
    except cl.Error as e:
        return [f"error: {e}"]
    return [ln.strip() for ln in log.splitlines() if "ptxas" in ln or "spill" in ln]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--device", default="gpu")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--report", action="store_true", help="the compiler's report per variant")
    p.add_argument("--variants", default="", help="comma-separated indices (default: all)")
    p.add_argument("--budget", type=float, default=170.0, help="seconds: later variants skipped")
    args = p.parse_args()
    t_start = time.perf_counter()
    device = select_device(args.device)
    volume = volume_of(args.size)
    feats, mode = feature_sets()["skimage"]
    result: dict = {
        **volume_record(volume, device),
        "runs": [],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    stencil_build, smooth_build = features.binary_build, smoothing.build
    scales.KernelClock = ScaleClock
    chosen = [int(i) for i in args.variants.split(",") if i] or range(len(VARIANTS))
    reported: set[tuple[str, ...]] = set()
    for i in chosen:
        if time.perf_counter() - t_start > args.budget:
            result["runs"].append({"variant": i, "skipped": "time budget"})
            continue
        variant = VARIANTS[i]
        consts = {**BASE, **{k: v for k, v in variant.items() if k.isupper()}}
        for key, value in consts.items():
            setattr(smoothing if hasattr(smoothing, key) else scales, key, value)
        defines = [f"-D{k}={v}" for k, v in variant.get("defines", [])]
        options = list(variant.get("options", []))
        sdefines = tuple(variant.get("smooth_defines", []))

        def patched(ctx, source, opts, make=None, cache_dir=None, _x=defines + options):
            return stencil_build(ctx, source, [*opts, *_x], make, cache_dir)

        def spatched(ctx, name, defs, opts=(), _x=sdefines):
            return smooth_build(ctx, name, tuple(defs) + _x, opts)

        features.binary_build, smoothing.build = patched, spatched
        features.build_with_features.cache_clear()  # its programs: this variant's options
        entry: dict = {"variant": i, **consts, "defines": defines, "options": options,
                       "smooth_defines": [f"{k}={v}" for k, v in sdefines]}  # fmt: skip
        try:
            got = run_volconv(volume, feats, mode, device)
            keep = ("kernel_ms", "kernel_ms_by_name", "device_bytes", "slab_depth")
            entry.update({k: got[k] for k in keep})
            by = got["kernel_ms_by_name"]
            for kind in ("smooth_z", "smooth_y", "smooth_x"):
                entry[kind] = sum(v for k, v in by.items() if k.startswith(kind))
        except Exception as e:  # a variant that fails to build or run is recorded
            entry["error"] = f"{type(e).__name__}: {e}"
        if args.report and device.platform.name.startswith("NVIDIA"):
            ctx = cl.Context([device])
            flags = ["-DR=2", "-DRD=1", "-DRO=1", f"-DLY={scales.XYZ_GROUP[1]}",
                     f"-DVX={scales.SKIMAGE_ROWS}", *defines, *options]  # fmt: skip
            if tuple(flags) not in reported:  # once per set of flags
                reported.add(tuple(flags))
                entry["report_stencils"] = [
                    ln for ln in compiler_report(ctx, "stencils.cl", flags)
                    if "skimage" in ln or "Used" in ln or "spill" in ln
                ]  # fmt: skip
            if i == chosen[0]:
                for r in (2, 64):
                    w = ",".join(["1.0f"] * (2 * r + 1))
                    sflags = [f"-DR={r}", f"-DWEIGHTS={w}", f"-DM={smoothing.OUT_PER_ITEM}",
                              f"-DMX={smoothing.X_PER_ITEM}", f"-DMZ={smoothing.ROW_PER_ITEM}",
                              f"-DWG={smoothing.ROW_GROUP}", f"-DLINES={smoothing.ROW_LINES}",
                              "-DIN_T=uchar", "-DUNROLL_TAPS=1",
                              *[f"-D{k}={v}" for k, v in sdefines]]  # fmt: skip
                    entry[f"report_smoothing_r{r}"] = compiler_report(ctx, "smoothing.cl", sflags)
        result["runs"].append(entry)
        print(json.dumps(entry, default=float), flush=True)
        if args.json:  # after each run: what a time limit cuts short is kept
            args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
    features.binary_build, smoothing.build = stencil_build, smooth_build
    result["seconds"] = time.perf_counter() - t_start
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
