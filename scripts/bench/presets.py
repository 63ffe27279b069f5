"""The presets' kernels at other work-group shapes and outputs per work-item, for tuning.

Runs the "skimage" and "ilastik" feature sets of scripts/bench/features.py (same volume, same
slab by slab run) once per variant of the module constants that shape their launches:
volconv.engines.smoothing's OUT_PER_ITEM and ROW_PER_ITEM (outputs per work-item of the
Gaussians' passes), LINE_GROUP, BLOCKS, ROW_GROUP and ROW_LINES (their work-groups), UNROLL
(their tap loops; rolled: one output per work-item), volconv.engines.scales' TILE (stage 2's
work-groups), SKIMAGE_ROWS (skimage_scale's rows per work-item), XYZ_GROUP (ilastik_xyz's
work-groups) and SUB_ROWS (stage 2's rows at a time); records each one's kernel milliseconds
by name and device bytes. JSON to --json.

    python3 scripts/bench/run.py presets --json $OUT/presets/variants.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from features import feature_sets, run_volconv, volume_of

from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.engines import scales, smoothing

# the constants as the modules hold them
BASE = {
    **{k: getattr(smoothing, k) for k in ("OUT_PER_ITEM", "ROW_PER_ITEM", "LINE_GROUP", "BLOCKS",
                                          "UNROLL", "ROW_GROUP", "ROW_LINES")},
    **{k: getattr(scales, k) for k in ("TILE", "SUB_ROWS", "XYZ_GROUP", "SKIMAGE_ROWS")},
}  # fmt: skip
# the constants only one preset's kernels read
ONLY = {"OUT_PER_ITEM": "skimage", "ROW_PER_ITEM": "skimage", "LINE_GROUP": "skimage",
        "BLOCKS": "skimage", "UNROLL": "skimage", "XYZ_GROUP": "ilastik",
        "SKIMAGE_ROWS": "skimage", "ROW_GROUP": "skimage", "ROW_LINES": "skimage"}  # fmt: skip
VARIANTS = [
    BASE,
    {**BASE, "ROW_LINES": 1},
    {**BASE, "ROW_LINES": 4},
    {**BASE, "ROW_GROUP": 64, "ROW_PER_ITEM": 4},
    {**BASE, "TILE": (32, 8, 1)},
    {**BASE, "TILE": (64, 2, 2)},
    {**BASE, "SKIMAGE_ROWS": BASE["SKIMAGE_ROWS"] // 2},
    {**BASE, "SUB_ROWS": 64},
    {**BASE, "OUT_PER_ITEM": 8},
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--device", default="gpu")
    p.add_argument("--only", default="skimage,ilastik")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = select_device(args.device)
    volume = volume_of(args.size)
    sets = {k: v for k, v in feature_sets().items() if k in args.only.split(",")}
    result: dict = {
        **volume_record(volume, device),
        "runs": [],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:
        for key, value in variant.items():  # the module constants the launches read
            setattr(smoothing if hasattr(smoothing, key) else scales, key, value)
        changed = {k for k, v in variant.items() if BASE[k] != v}
        for name, (feats, mode) in sets.items():
            if changed and changed <= set(ONLY) and ONLY[min(changed)] != name:
                continue  # a variant of the other preset's kernels
            got = run_volconv(volume, feats, mode, device)
            keep = ("kernel_ms", "kernel_ms_by_name", "device_bytes", "slab_depth")
            entry = {"set": name, **variant, **{k: got[k] for k in keep}}
            result["runs"].append(entry)
            print(json.dumps(entry, default=float), flush=True)
            if args.json:  # after each run: what a time limit cuts short is kept
                args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
