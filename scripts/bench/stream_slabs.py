"""Feature sets in 4, 2 or 1 slabs a frame, in alternating rounds: the wall to every output in
host memory (as scripts/bench/features.py runs them, its slabs' depth given) against the count.

    .venv/bin/python scripts/bench/run.py stream_slabs --device cpu --size 128 \\
        --sets gradient_s1,structure_s3 --json benchmarks/results/pocl-stream-slabs.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import features
import numpy as np
from features import feature_sets, run_volconv, volume_of

from volconv.bank.features import expand
from volconv.device.devices import select_device
from volconv.engines.separable import SeparableConvolver
from volconv.plan.separable import plan_paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--sets", default="gradient_s1,structure_s3")
    ap.add_argument("--slabs", default="4,2,1")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5, help="timed passes a round (the median)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = select_device(args.device)
    volume = volume_of(args.size)
    counts = [int(n) for n in args.slabs.split(",")]
    depth = {"rows": volume.shape[0]}

    def convolver_for(volume: np.ndarray, feats: list, mode: str, device) -> SeparableConvolver:
        ex = expand([], feats)
        choices = plan_paths(ex.filters, device, separable=ex.separable)
        return SeparableConvolver(ex.filters, volume.shape, volume.dtype, mode, 0.0,
                                  device=device, expanded=ex, choices=choices,
                                  slab_depth=depth["rows"])  # fmt: skip

    features.convolver_for = convolver_for  # run_volconv's, with the depth given
    sets = feature_sets()
    names = args.sets.split(",")
    walls = {s: {n: [] for n in counts} for s in names}
    kernels = {s: {n: [] for n in counts} for s in names}
    for _ in range(args.rounds):
        for name in names:
            feats, mode = sets[name]
            for n in counts:
                depth["rows"] = -(-volume.shape[0] // n)
                r = run_volconv(volume, feats, mode, device, repeat=args.repeat)
                walls[name][n].append(r["wall_seconds"] * 1e3)
                kernels[name][n].append(r["device_seconds"]["kernel"] * 1e3)
    record = {"device": device.name, "size": args.size, "rounds": args.rounds, "sets": {}}
    for name in walls:
        record["sets"][name] = {}
        for n in counts:
            row = {"wall_ms": walls[name][n], "wall_ms_median": float(np.median(walls[name][n])),
                   "kernel_ms_median": float(np.median(kernels[name][n]))}  # fmt: skip
            record["sets"][name][n] = row
            print(f"{name} {n} slabs: wall {row['wall_ms_median']:.1f} ms (rounds "
                  f"{', '.join(f'{w:.1f}' for w in row['wall_ms'])}), kernel "
                  f"{row['kernel_ms_median']:.1f} ms", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
