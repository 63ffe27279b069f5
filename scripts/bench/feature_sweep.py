"""Hessian and structure-tensor eigenvalues: each kernel shape (fused tile, multi-output tree's
lanes, rows and work-groups) against the pass tree, device time per kernel, on one volume.

Each variant runs the feature set as scripts/bench/features.py does (the plan's slab depth,
streamed, float32 outputs; one warm-up pass, then --passes timed ones: the median of the
kernels' device time), and its outputs are compared with the first variant's (the pass tree,
one launch per node) as the largest difference over the largest magnitude.

    python3 scripts/bench/run.py feature_sweep --size 256 --json $OUT/sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from features import feature_sets, volume_of

from volconv.bank.features import expand
from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.engines import passes as fused_passes
from volconv.engines import structure, tree, xfirst
from volconv.engines.separable import SeparableConvolver
from volconv.plan import separable, trees
from volconv.plan.separable import make_separable_plan, plan_paths

# name -> options of SeparableConvolver; "groups" sets tree.TREE_GROUPS' GPU shapes, "uy"
# tree.TREE_ROWS, "tree_shape" separable.TREE_SHAPE's GPU (V, UX) (a structure tensor's own),
# "xfirst_shape" xfirst.XFIRST_SHAPE's GPU entry
XF = xfirst.XFIRST_SHAPE["gpu"]
SHAPES = {  # kernels/tree_yz.cl's shapes (XFIRST_SHAPE's GPU entry), each from the module's
    "xf_block32": {**XF, "BLOCK": 32},
    "xf_ub2": {**XF, "UB": 2},
    "xf_vc4": {**XF, "VC": 4},
    "xf_mg_all": {**XF, "MG": 0},  # every mid of a root at once
    "xf_no_prefetch": {**XF, "PREFETCH": 0},
    "xf_tz32_ty16": {**XF, "TZ": 32, "TY": 16},
    "xf_tz128_ty16": {**XF, "TZ": 128, "TY": 16},  # less of axis 2's halo recomputed
    "xf_dense": {**XF, "FLAT": 0},  # zero tiles computed, diagonal matrices too
    "xf_mg2_vc8": {**XF, "TY": 32, "VC": 8, "MG": 2},  # the shape before h100-feature-sweep-7
}
HESSIAN = {
    "passes": {"fused": False, "multi": False},
    "default": {},
    "xfirst": {"fused": False, "xfirst": True},
    "multi_v2_u4": {"fused": False, "multi": True, "xfirst": False, "vector_width": 2, "rows": 4},
    "multi_v2_u4_nogroups": {
        "fused": False,
        "multi": True,
        "xfirst": False,
        "vector_width": 2,
        "rows": 4,
        "groups": {"tree_z": None, "tree_y": None, "tree_x": None},
    },
    **{k: {"fused": False, "xfirst": True, "xfirst_shape": v} for k, v in SHAPES.items()},
}
FUSED_TILES = [(8, 16, 32), (8, 16, 64), (8, 16, 128), (16, 16, 64), (4, 32, 64)]
STRUCTURE = {
    "passes": {"fused": False, "multi": False},
    "default": {},
    "fused": {"fused": True, "multi": False},
    "multi_v4": {"tree_shape": (4, 4)},
    "xfirst": {"multi": True, "xfirst": True},
    "st_dense": {"st_shape": {"FLAT": 0}},  # kernels/structure.cl without ZERO_SKIP, EIG_FLAT
    "fused_dense": {"fused_flat": False},  # the gradients' kernels/fused.cl without ZERO_SKIP
    "all_dense": {"st_shape": {"FLAT": 0}, "fused_flat": False},
    **{k: {"multi": True, "xfirst": True, "xfirst_shape": v} for k, v in SHAPES.items()},
}
# the variants each set runs, in order (the sweep's budget cuts the tail)
ORDER = {
    "hessian_s3": ["passes", "default", "xf_dense", "xf_mg2_vc8", "xf_block32", "xf_mg_all",
                   "xf_no_prefetch", "xf_ub2", "xf_vc4", "xf_tz32_ty16", "xf_tz128_ty16",
                   "multi_v2_u4", "multi_v2_u4_nogroups"],
    "structure_s1": ["passes", "default", "st_dense", "fused_dense", "all_dense", "multi_v4",
                     "xfirst", "fused"],
    "structure_s3": ["passes", "default", "st_dense", "fused_dense", "all_dense", "multi_v4",
                     "xfirst", "xf_mg_all"],
    "hessian_s1": ["default", "xf_dense", "xf_mg2_vc8", "fused_8x16x32", "fused_8x16x128",
                   "fused_16x16x64", "fused_4x32x64", "xfirst"],
}  # fmt: skip


def variants(name: str) -> dict[str, dict]:
    if name.endswith("_raw"):
        return {"default": {}, "xfirst": {"fused": False, "xfirst": True}}
    table = dict(HESSIAN if name.startswith("hessian") else STRUCTURE)
    table.update({f"fused_{ty}x{tz}x{cx}": {"fused": True, "tile": (ty, tz, cx)}
                  for ty, tz, cx in FUSED_TILES})  # fmt: skip
    return {label: table[label] for label in ORDER[name]}


def run_variant(volume: np.ndarray, feats: list, mode: str, device, options: dict,
                passes: int, raw: bool = False) -> tuple[dict, np.ndarray]:  # fmt: skip
    options = dict(options)
    groups, uy = options.pop("groups", None), options.pop("uy", None)
    shape = options.pop("tree_shape", None)
    xf = options.pop("xfirst_shape", None)
    st_changes = options.pop("st_shape", None)
    fused_flat = options.pop("fused_flat", None)
    saved = (dict(tree.TREE_GROUPS["gpu"]), tree.TREE_ROWS, dict(separable.TREE_SHAPE),
             dict(xfirst.XFIRST_SHAPE["gpu"]), dict(structure.ST_SHAPES["gpu"]),
             dict(fused_passes.FUSED_FLAT))  # fmt: skip
    if fused_flat is not None:
        fused_passes.FUSED_FLAT.update(gpu=fused_flat, cpu=fused_flat)
    if xf is not None:
        xfirst.XFIRST_SHAPE["gpu"].update(xf)
    if st_changes is not None:
        structure.ST_SHAPES["gpu"].update(st_changes)
    if shape is not None:
        separable.TREE_SHAPE.update(gpu=shape, cpu=shape)
    if groups is not None:
        tree.TREE_GROUPS["gpu"].update(groups)
    if uy is not None:
        tree.TREE_ROWS = uy
    try:
        ex = expand([], feats)
        sizes = ex.plan_sizes()
        if raw:  # the features' filters as a bank: every response written, no feature
            ex, sizes = None, {}
        filters = expand([], feats).filters
        t0 = time.perf_counter()
        fused = options.get("fused")
        choices = plan_paths(filters, device, separable=ex.separable if ex else (), fused=fused,
                             tile=options.get("tile"))  # fmt: skip
        plan = make_separable_plan(filters, volume.shape, volume.dtype, mode, 0.0, device,
                                   choices=choices, stream=True, **sizes, **options)  # fmt: skip
        conv = SeparableConvolver(filters, volume.shape, volume.dtype, mode, 0.0,
                                  device=device, expanded=ex, choices=choices,
                                  slab_depth=plan.slab_depth, **options)  # fmt: skip
        build = time.perf_counter() - t0
    finally:
        tree.TREE_GROUPS["gpu"].clear()
        tree.TREE_GROUPS["gpu"].update(saved[0])
        tree.TREE_ROWS = saved[1]
        separable.TREE_SHAPE.update(saved[2])
        xfirst.XFIRST_SHAPE["gpu"].update(saved[3])
        structure.ST_SHAPES["gpu"].update(saved[4])
        fused_passes.FUSED_FLAT.update(saved[5])
    out = np.empty((conv.plan.n_outputs, *volume.shape), np.float32)

    def one_pass() -> dict[str, float]:
        before = conv.kernel_seconds
        for a, b in conv.slabs():
            conv.convolve_slab(a, b, out=out[:, a:b], frame=volume)
        return {k: v - before.get(k, 0.0) for k, v in conv.kernel_seconds.items()}

    one_pass()
    runs = [one_pass() for _ in range(passes)]
    totals = [sum(r.values()) for r in runs]
    best = runs[int(np.argsort(totals)[len(totals) // 2])]
    stage = [s for s, _ in conv._tensors]
    return {
        "kernel_ms": float(np.median(totals)) * 1e3,
        "kernel_ms_by_name": {k: v * 1e3 for k, v in sorted(best.items())},
        "fused": conv.plan.fused,
        "multi": conv.plan.multi,
        "xfirst": conv.plan.xfirst,
        "block_rows": conv.plan.block_rows,
        "outer_multi": bool(stage and stage[0].multi),
        "tile": list(conv.plan.tile) if conv.plan.fused else None,
        "vector_width": conv.plan.vector_width,
        "rows": conv.plan.rows,
        "slab_depth": conv.plan.slab_depth,
        "build_seconds": build,
    }, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument(
        "--only",
        default="hessian_s3,structure_s1,structure_s3,hessian_s1",
    )
    p.add_argument("--variants", default="", help="only these labels (comma-separated)")
    p.add_argument("--device", default="gpu")
    p.add_argument("--volume", choices=("scan", "dense"), default="scan",
                   help="scan: the demo scan (a zero background); dense: features.py's "
                        "synthetic volume (noise everywhere)")  # fmt: skip
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--budget", type=float, default=150.0, help="seconds; later variants skipped")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    trees.MAX_TREE_VALUES = 256  # the sweep's wider shapes
    device = select_device(args.device)
    volume = volume_of(args.size, synthetic=args.volume == "dense")
    result: dict = {
        **volume_record(volume, device),
        "volume": args.volume,
        "sets": {},
    }
    start = time.perf_counter()
    sets = feature_sets()
    for name in args.only.split(","):
        raw = name.endswith("_raw")  # the Hessian's six responses: what the eigenvalues cost
        feats, mode = sets[name.removesuffix("_raw")]
        entry, ref = {}, None
        for label, options in variants(name).items():
            if args.variants and label not in args.variants.split(","):
                continue
            if time.perf_counter() - start > args.budget:
                entry[label] = {"skipped": "budget"}
                continue
            try:
                rec, out = run_variant(volume, feats, mode, device, options, args.passes, raw)
            except Exception as e:  # a shape that does not build or fit: recorded
                entry[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(name, label, entry[label], flush=True)
                continue
            if ref is None:
                ref = out
            with np.errstate(invalid="ignore"):
                scale = float(np.nanmax(np.abs(ref))) or 1.0
                rec["max_diff_rel"] = float(np.nanmax(np.abs(out - ref))) / scale
                rec["nan_match"] = bool(np.array_equal(np.isnan(out), np.isnan(ref)))
            entry[label] = rec
            print(name, label, f"{rec['kernel_ms']:.3f} ms", json.dumps(rec["kernel_ms_by_name"]),
                  f"diff {rec['max_diff_rel']:.2e}", flush=True)  # fmt: skip
        result["sets"][name] = entry
        if args.json:  # after each set: a cut-off run keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
