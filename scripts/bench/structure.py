"""Structure-tensor eigenvalues on the device: kernels/structure.cl's shapes against the
three-launch tree (kernels/tree.cl), device time per kernel (median over passes).

Each variant streams the volume slab by slab as `volconv run` does (the plan's slab depth,
float32 outputs) and is compared with the first variant (max |difference| relative to the
largest eigenvalue). Variants are ``name:KEY=VALUE,...`` over `volconv.engines.structure`
ST_SHAPES's keys (XG as AxBxC) and GRAD (the gradients' path: fused, multi, xfirst, passes),
or ``name:tree`` (the tree path); the sets are those of
scripts/bench/features.py (structure_s1, structure_s3).

    python scripts/bench/run.py structure --device gpu --json $OUT/st/x.json \\
        --variants tree:tree default: ua16:UA=16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from features import feature_sets, volume_of

import volconv.engines.structure as st
from volconv.bank.features import expand
from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.engines.features import StructureTensorStage
from volconv.engines.separable import SeparableConvolver
from volconv.plan.separable import make_separable_plan, plan_paths

GRAD_PATHS = {
    "fused": {"fused": True},
    "multi": {"fused": False, "multi": True, "xfirst": False},
    "xfirst": {"fused": False, "multi": True, "xfirst": True},
    "passes": {"fused": False, "multi": False, "xfirst": False},
}


def parse_variant(text: str) -> tuple[str, dict | None]:
    """``name:KEY=VALUE,...`` -> (name, overrides); ``name:tree`` -> (name, None)."""
    name, _, spec = text.partition(":")
    if spec == "tree":
        return name, None
    shape: dict = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "GRAD":  # the gradients' path: fused, multi, xfirst or passes
            shape[key] = value
            continue
        shape[key] = (None if value == "none" else tuple(int(v) for v in value.split("x"))
                      if key == "XG" else int(value))  # fmt: skip
    return name, shape


def measure(
    volume: np.ndarray, feats: list, mode: str, device, repeat: int, multi: bool | None
) -> dict:
    """Kernel ms by name (median over ``repeat`` passes after a first) and the result."""
    ex = expand([], feats)
    choices = plan_paths(ex.filters, device, separable=ex.separable)
    plan = make_separable_plan(ex.filters, volume.shape, volume.dtype, mode, 0.0, device,
                               choices=choices, stream=True, **ex.plan_sizes())  # fmt: skip
    t0 = time.perf_counter()
    conv = SeparableConvolver(ex.filters, volume.shape, volume.dtype, mode, 0.0, device=device,
                              expanded=ex, choices=choices, slab_depth=plan.slab_depth,
                              multi=multi)  # fmt: skip
    build = time.perf_counter() - t0
    out = np.empty((conv.plan.n_outputs, *volume.shape), np.float32)
    runs: list[dict] = []
    walls = []
    for i in range(repeat + 1):
        before = dict(conv.kernel_seconds)
        t = time.perf_counter()
        for a, b in conv.slabs():
            conv.convolve_slab(a, b, out=out[:, a:b], frame=volume)
        if i:
            walls.append(time.perf_counter() - t)
            runs.append({k: (v - before.get(k, 0.0)) * 1e3
                         for k, v in conv.kernel_seconds.items()})  # fmt: skip
    names = sorted(runs[0])
    by_name = {k: statistics.median(r[k] for r in runs) for k in names}
    stage = conv._tensors[0][0]
    return {
        "kernel_ms": statistics.median(sum(r.values()) for r in runs),
        "kernel_ms_by_name": by_name,
        "wall_seconds": statistics.median(walls),
        "slab_depth": conv.plan.slab_depth,
        "build_seconds": build,
        "st": stage._st.shape if stage._st is not None else None,
        "held_bytes": stage.held_bytes,
    }, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="gpu")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--only", default="structure_s1,structure_s3")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["default:"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--multi", action="store_true", help="the six products as one tree (CPUs)")
    p.add_argument("--budget", type=float, default=170.0, help="seconds; later variants skipped")
    args = p.parse_args()
    start = time.perf_counter()
    device = select_device(args.device)
    kind = "cpu" if args.device == "cpu" else "gpu"
    base_shape = dict(st.ST_SHAPES[kind])
    keep = StructureTensorStage.__dict__["outer_st"]
    volume = volume_of(args.size)
    sets = {k: v for k, v in feature_sets().items() if k in args.only.split(",")}
    result: dict = {
        **volume_record(volume, device),
        "sets": {},
    }
    first: dict[str, np.ndarray] = {}
    for text in args.variants:  # each variant over every set, so that a cut budget cuts variants
        label, shape = parse_variant(text)
        for name, (feats, mode) in sets.items():
            entries = result["sets"].setdefault(name, {})
            if time.perf_counter() - start > args.budget:
                entries[label] = "skipped: budget"
                continue
            grad = (shape or {}).get("GRAD")
            StructureTensorStage.GRAD_OPTIONS = GRAD_PATHS[grad] if grad else {}
            st.ST_SHAPES[kind] = {**base_shape, **{k: v for k, v in (shape or {}).items()
                                                   if k != "GRAD"}}  # fmt: skip
            if shape is None:
                StructureTensorStage.outer_st = staticmethod(lambda xfirst, mode: False)
            try:
                entry, out = measure(volume, feats, mode, device, args.repeat,
                                     True if args.multi else None)  # fmt: skip
            except Exception as e:  # a shape the device refuses: record it, go on
                entries[label] = {"error": f"{type(e).__name__}: {e}"[:400]}
                print(name, label, entries[label], flush=True)
                continue
            finally:
                StructureTensorStage.outer_st = keep
                StructureTensorStage.GRAD_OPTIONS = {}
                st.ST_SHAPES[kind] = base_shape
            if name not in first:
                first[name] = out
            else:
                scale = float(np.abs(first[name]).max()) or 1.0
                entry["max_diff_rel"] = float(np.abs(out - first[name]).max()) / scale
            entries[label] = entry
            print(name, label, json.dumps(entry, default=float), flush=True)
            if args.json:  # after each, so that a run cut short keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
