"""Hessian eigenvalues at sigma 1 and 3: kernels/tree_yz.cl shapes beside the fused kernel, tree.cl.

Each variant runs one feature (`hessian_eigenvalues(sigma)`; `gradient_magnitude(1)`, which
shares the fused kernel) of the volume (scripts/bench/features.py's:
the demo scan where present) as `volconv run` streams it, float32 outputs: a warm-up pass
that keeps the outputs, then ``--repeat`` timed passes; per kernel the median of the passes'
device seconds (OpenCL profiling events). Each variant's outputs are compared with the first
variant of its feature (the fused kernel at sigma 1, kernels/tree.cl at sigma 3: max |diff|,
and max |reference| for scale). Variants of kernels/tree_yz.cl set `XFIRST_SHAPE` of the device's
kind; each kernel's work-group info (private bytes: spills) is recorded. The ``noeig``
variants build the kernels with the responses picked in place of the eigenvalues (their
outputs differ: a diagnostic of what the filtering alone costs).

    python3 scripts/bench/run.py hessian_sweep --json $OUT/hess/sweep.json --budget 150
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pyopencl as cl
from features import volume_of

from volconv.bank.features import build_features, expand
from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.device.programs import binary_build, kernel_source
from volconv.engines import passes, xfirst
from volconv.engines.separable import SeparableConvolver
from volconv.plan.separable import make_separable_plan, plan_paths

BASE = dict(xfirst.XFIRST_SHAPE["gpu"])


def shape(**changes: object) -> dict:
    return {**BASE, **changes}


XF = {"fused": False, "xfirst": True}
# (name, feature, convolver options, XFIRST_SHAPE of the device's kind or None); the first of
# each feature is the reference of the others
H1, H3 = ("hessian_eigenvalues", 1.0), ("hessian_eigenvalues", 3.0)
# the eigenvalues' epilogue left out (the responses picked): what the filtering costs
NO_EIG = {"_epilogue": "PICK(0,0)PICK(1,1)PICK(2,2)"}
VARIANTS = [
    ("s3_default", H3, {}, None),
    ("s1_default", H1, {}, None),
    ("s1_fused", H1, {"fused": True}, None),
    ("g1_default", ("gradient_magnitude", 1.0), {}, None),
    ("s3_xf_ty32_mg2_ub8", H3, XF, shape(UB=8)),
    ("s1_xf_vc4_ub8", H1, XF, shape(TY=16, VC=4, MG=0, UB=8)),
    ("s1_xf_vc4_ub2", H1, XF, shape(TY=16, VC=4, MG=0, UB=2)),
    ("s1_xf_vc4_ty8", H1, XF, shape(TY=8, VC=4, MG=0)),
    ("s3_xf_ty32_mg2_pf0", H3, XF, shape(PREFETCH=0)),
    ("s1_xf_vc2", H1, XF, shape(TY=16, VC=2, MG=0)),
    ("s3_multi", H3, {"fused": False, "multi": True, "xfirst": False}, None),
]  # fmt: skip


REPORTS: list[str] = []  # the compiler's report of the last builds (NVIDIA: -cl-nv-verbose)


def verbose_build(ctx: cl.Context, name: str, defines: tuple) -> cl.Program:
    """`volconv.engines.features.build_with_features` with the compiler's report kept (not
    cached on NVIDIA: each variant is built once anyway)."""
    source = kernel_source("eigen.cl") + "\n" + kernel_source(name)
    options = [f"-D{k}={v}" for k, v in defines]
    if "NVIDIA" in ctx.devices[0].platform.name:
        options.append("-cl-nv-verbose")
    program = binary_build(ctx, source, options)
    log = program.get_build_info(ctx.devices[0], cl.program_build_info.LOG) or ""
    keep = ("entry function", "registers", "spill")
    REPORTS.extend(line.strip()[:200] for line in log.splitlines() if any(k in line for k in keep))
    return program


def kernel_info(conv: SeparableConvolver, device: cl.Device) -> dict:
    """Work-group info of the kernels the convolver's passes built."""
    passes = conv._passes
    kernels = getattr(passes, "_k", None) or {"fused": getattr(passes, "_kernel", None)}
    info = {}
    for name, k in kernels.items():
        if k is None:
            continue
        wg = cl.kernel_work_group_info
        info[name] = {
            "work_group_size": k.get_work_group_info(wg.WORK_GROUP_SIZE, device),
            "private_bytes": k.get_work_group_info(wg.PRIVATE_MEM_SIZE, device),
            "local_bytes": k.get_work_group_info(wg.LOCAL_MEM_SIZE, device),
        }
    return info


def run_variant(volume: np.ndarray, feature: tuple[str, float], options: dict, repeat: int,
                device: cl.Device) -> tuple:  # fmt: skip
    kind, sigma = feature
    feats = build_features([{"type": kind, "sigma": sigma, "name": "f"}])
    options = dict(options)
    epilogue = options.pop("_epilogue", None)
    if epilogue is not None:  # a diagnostic: the kernels built with this epilogue instead
        SeparableConvolver._epilogue = lambda self: epilogue
    ex = expand([], feats)
    REPORTS.clear()
    t0 = time.perf_counter()
    choices = plan_paths(ex.filters, device, fused=options.get("fused"), separable=ex.separable)
    plan = make_separable_plan(ex.filters, volume.shape, volume.dtype, "reflect", 0.0, device,
                               choices=choices, stream=True, **ex.plan_sizes(),
                               **options)  # fmt: skip
    conv = SeparableConvolver(ex.filters, volume.shape, volume.dtype, "reflect", 0.0,
                              device=device, expanded=ex, choices=choices,
                              slab_depth=plan.slab_depth, **options)  # fmt: skip
    build = time.perf_counter() - t0
    pinned = conv.pinned_slab()
    full = np.empty((conv.plan.n_outputs, *volume.shape), np.float32)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, out=pinned[:, : b - a], frame=volume)
        full[:, a:b] = pinned[:, : b - a]
    runs = []
    for _ in range(repeat):
        before = dict(conv.kernel_seconds)
        for a, b in conv.slabs():
            conv.convolve_slab(a, b, out=pinned[:, : b - a], frame=volume)
        runs.append({k: (v - before.get(k, 0.0)) * 1e3 for k, v in conv.kernel_seconds.items()})
    by_name = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    record = {
        "plan": "fused" if conv.plan.fused else "xfirst" if conv.plan.xfirst else "multi",
        "slab_depth": conv.plan.slab_depth,
        "build_seconds": build,
        "kernel_ms": statistics.median(sum(r.values()) for r in runs),
        "kernel_ms_by_name": by_name,
        "kernel_ms_runs": [sum(r.values()) for r in runs],
        "kernels": kernel_info(conv, device),
    }
    if conv.plan.xfirst:
        record["shape"] = {k: v for k, v in conv._passes.shape.items()}
    record["compiler"] = list(REPORTS)
    return record, full


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--device", default="gpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds: no variant starts after")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = select_device(args.device)
    xfirst.build_with_features = passes.build_with_features = verbose_build
    kind = "cpu" if device.type & cl.device_type.CPU else "gpu"
    volume = volume_of(args.size)
    result: dict = {
        **volume_record(volume, device),
        "local_mem_size": device.local_mem_size,
        "variants": {},
    }
    start = time.perf_counter()
    refs: dict[tuple[str, float], np.ndarray] = {}
    only = set(args.only.split(",")) if args.only else None
    for name, feature, options, xshape in VARIANTS:
        if only is not None and name not in only:
            continue
        if time.perf_counter() - start > args.budget:
            result["variants"][name] = {"skipped": "budget"}
            continue
        saved, saved_epilogue = xfirst.XFIRST_SHAPE[kind], SeparableConvolver._epilogue
        if xshape is not None:  # the variant's shape
            xfirst.XFIRST_SHAPE[kind] = xshape
        try:
            record, full = run_variant(volume, feature, options, args.repeat, device)
            ref = refs.setdefault(feature, full)
            record["max_abs_diff"] = float(np.nanmax(np.abs(full - ref)))
            record["max_abs_ref"] = float(np.nanmax(np.abs(ref)))
        except Exception as e:  # a variant that does not build or fit: recorded
            record = {"error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            xfirst.XFIRST_SHAPE[kind] = saved
            SeparableConvolver._epilogue = saved_epilogue
        result["variants"][name] = record
        brief = {k: record.get(k) for k in ("kernel_ms", "kernel_ms_by_name", "max_abs_diff",
                                            "error")}  # fmt: skip
        print(name, json.dumps(brief, default=float), flush=True)
        if args.json:  # after each variant: a run cut short keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
