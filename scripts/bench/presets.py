"""The presets' kernels at other work-group shapes and outputs per work-item, for tuning.

Runs the "skimage" and "ilastik" feature sets of scripts/bench/features.py (same volume, same
slab by slab run) once per variant of the module constants that shape their launches:
volconv.engines.smoothing's OUT_PER_ITEM (outputs per work-item of the Gaussians' passes) and
LINE_GROUP (their work-groups along axis 2), volconv.engines.scales' TILE (stage 2's
work-groups), XYZ_GROUP (ilastik_xyz's) and SUB_ROWS (stage 2's rows at a time); records each
one's kernel milliseconds by name and device bytes. JSON to --json.

    python3 scripts/bench/run.py presets --json $OUT/presets/variants.json
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

from features import feature_sets, run_volconv, volume_of

from volconv.bench import device_record
from volconv.device.devices import select_device
from volconv.engines import scales, smoothing

VARIANTS = [
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 16, "LINE_GROUP": 128},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 16, "LINE_GROUP": 32},
    {"OUT_PER_ITEM": 4, "TILE": (32, 4, 2), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 16, "TILE": (32, 4, 2), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 8, "TILE": (32, 8, 1), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 8, "TILE": (64, 2, 2), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 8, "TILE": (32, 2, 4), "SUB_ROWS": 16},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 32},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 64},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 16, "XYZ_GROUP": (32, 4, 1)},
    {"OUT_PER_ITEM": 8, "TILE": (32, 4, 2), "SUB_ROWS": 16, "XYZ_GROUP": (32, 16, 1)},
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
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "shape": list(volume.shape),
        "dtype": str(volume.dtype),
        "device": device_record(device),
        "runs": [],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:
        smoothing.OUT_PER_ITEM = variant["OUT_PER_ITEM"]
        smoothing.LINE_GROUP = variant.get("LINE_GROUP", 64)
        scales.TILE, scales.SUB_ROWS = variant["TILE"], variant["SUB_ROWS"]
        scales.XYZ_GROUP = variant.get("XYZ_GROUP", (32, 8, 1))
        for name, (feats, mode) in sets.items():
            got = run_volconv(volume, feats, mode, device)
            keep = ("kernel_ms", "kernel_ms_by_name", "device_bytes", "slab_depth")
            entry = {"set": name, **variant, **{k: got[k] for k in keep}}
            result["runs"].append(entry)
            print(json.dumps(entry, default=float), flush=True)
            if args.json:  # after each run: what a time limit cuts short is kept
                args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
