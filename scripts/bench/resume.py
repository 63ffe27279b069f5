"""What resuming inside a volume costs (`volconv.run.resume`): the same run with its progress
recorded (a flush and the CRCs of every slab) and without (``--overwrite`` records none),
alternated and repeated, minima; and the read-back a rerun does to check the slabs it keeps.

    python scripts/bench/run.py resume --size 256 --slab-depth 32 --slab-depth 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import h5py
import numpy as np

from volconv.config import dump_toml, load
from volconv.run.pipeline import run

FILTERS = [{"type": "gaussian", "name": f"g{i}", "sigma": 1.5, "order": [0, 0, i % 3]}
           for i in range(8)]  # fmt: skip


def pipeline(folder: Path, depth: int, device: str, dtype: str) -> Path:
    data = {
        "input": {"paths": ["v.npy"]},
        "bank": {"size": 7, "filter": FILTERS},
        "output": {"path": "out/{stem}.h5", "dtype": dtype},
        "run": {"device": device, "slab_depth": depth},
    }
    path = folder / "p.toml"
    path.write_text(dump_toml(data))
    return path


def wall(cfg_path: Path, out: Path, overwrite: bool) -> float:
    """In-run wall seconds of one run (the output removed first, so neither skips)."""
    shutil.rmtree(out, ignore_errors=True)
    result = run(load(cfg_path), overwrite=overwrite)
    return result.reports[0].wall_seconds


def read_back(path: Path, depth: int) -> float:
    """Seconds to read every slab of ``path`` back and CRC it, as a resuming run does."""
    start = time.perf_counter()
    with h5py.File(path) as f:
        responses = f["responses"]
        for a in range(0, responses.shape[1], depth):
            for k in range(responses.shape[0]):
                zlib.crc32(np.ascontiguousarray(responses[k, a : a + depth]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--slab-depth", type=int, action="append")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=os.environ.get("VOLCONV_TEST_DEVICE", "cpu"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(0)
        np.save(folder / "v.npy", rng.integers(0, 256, (args.size,) * 3, dtype=np.uint8))
        for depth in args.slab_depth or [32]:
            cfg_path = pipeline(folder, depth, args.device, args.dtype)
            times: dict[str, list[float]] = {"with progress": [], "without": []}
            for _ in range(args.repeats):
                times["with progress"].append(wall(cfg_path, folder / "out", False))
                times["without"].append(wall(cfg_path, folder / "out", True))
            check = min(read_back(folder / "out" / "v.h5", depth) for _ in range(args.repeats))
            row = {
                "slab_depth": depth,
                "slabs": -(-args.size // depth),
                "wall_with_progress_s": min(times["with progress"]),
                "wall_without_s": min(times["without"]),
                "read_back_check_s": check,
                "all": times,
            }
            row["overhead"] = row["wall_with_progress_s"] / row["wall_without_s"] - 1
            rows.append(row)
            print(
                f"{args.size}^3 uint8 -> 8 {args.dtype}, slab depth {depth} ({row['slabs']} "
                f"slabs): with progress {row['wall_with_progress_s']:.3f} s, without "
                f"{row['wall_without_s']:.3f} s ({100 * row['overhead']:+.1f} %); "
                f"a rerun's read-back check of every slab {check:.3f} s",
                flush=True,
            )
    if args.json:
        doc = {"machine": platform.node(), "cores": os.cpu_count(), "device": args.device,
               "size": args.size, "dtype": args.dtype, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
