"""Sweep the separable passes' vector width and rows per work-item on one device: the ilastik
and demo banks (forced separable) on a 256^3 uint8 volume, kernel seconds (best of 3).

    python scripts/sweep_separable_gpu.py --device nvidia --json out.json
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import numpy as np

from volconv.bank import build_bank
from volconv.device import select_device
from volconv.separable import SeparableConvolver, plan_bank

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = select_device(args.device)
    vol = np.random.default_rng(0).integers(0, 256, (args.size,) * 3).astype(np.uint8)
    result = []
    for name in ("ilastik_features", "demo"):
        data = tomllib.loads((ROOT / "pipelines" / f"{name}.toml").read_text())
        filters = build_bank(data["bank"]["filter"], data["bank"].get("size", 7))
        choices = plan_bank(filters, force="separable")
        for v in (1, 2, 4, 8, 16):
            for u in (1, 2, 4, 8):
                conv = SeparableConvolver(filters, vol.shape, vol.dtype, device=device,
                                          choices=choices, vector_width=v, rows=u)  # fmt: skip
                a, b = next(conv.slabs())
                conv.convolve_slab(a, b, vol[conv.source_rows(a, b)])
                seconds = float(np.min(conv.time_kernel(a, b, 3))) * conv.plan.n_slabs
                result.append({"bank": name, "vector_width": v, "rows": u, "kernel_s": seconds})
                print(f"{name} V={v} U={u}: {seconds * 1e3:.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
