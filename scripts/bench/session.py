"""The three figures that show a change is no slower, in one command: tensor N = 8 at 7^3, the
demo bank's separable kernel, the demo end to end (float32).

    python scripts/bench/run.py session --device nvidia --json $OUT/session.json

Each figure comes from its own benchmark, run in a fresh process with a time limit (one that
fails leaves the others and says why): ``tensor`` (the tensor-core engine as shipped, 8 random
normal 7^3 filters over the MNI152 scan as 256^3 uint8, kernel seconds, best of ``--repeats``;
the FP32 kernel beside it), ``separable --banks demo --kernel-only`` (the demo bank's kernel
seconds on random 256^3 uint8) and ``e2e --dtypes float32`` (pipelines/demo.toml on
data/mni152_t1_256.nii as `volconv run` runs it: the best in-run wall of ``--repeats``). Their
own JSON files go beside ``--json`` (``session-tensor.json``, ...); ``--json`` holds the three
figures, the commit and the device. ``--size`` (a smaller synthetic volume) checks the
command on a CPU; its figures are not the session's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def bench(name: str, args: list[str], limit: float, json_path: Path) -> dict:
    """Run benchmark ``name`` in a fresh process; its JSON, or why there is none."""
    command = [sys.executable, str(HERE / "run.py"), name, *args, "--json", str(json_path)]
    print(f"== {name}: {' '.join(command[2:])}", flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=limit, stdout=sys.stdout)
        error = None if done.returncode == 0 else f"exit status {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"over its limit of {limit:.0f} s"
    seconds = time.perf_counter() - t0
    if json_path.exists():
        return {"doc": json.loads(json_path.read_text()), "error": error, "seconds": seconds}
    return {"doc": None, "error": error or "no JSON written", "seconds": seconds}


def pick(run: dict, *keys: str | int) -> float | None:
    value = run["doc"]
    for key in keys:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="nvidia")
    p.add_argument("--repeats", type=int, default=20, help="kernel launches (e2e: runs 3)")
    p.add_argument("--size", type=int, default=256, help="another edge: a CPU check only")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    folder = args.json.parent
    folder.mkdir(parents=True, exist_ok=True)
    stem = args.json.stem
    size = [] if args.size == 256 else ["--size", str(args.size)]

    tensor = bench("tensor", ["--device", args.device, "--extents", "7:8", "--no-sweep",
                              "--no-peers", "--mixed", "", "--repeats", str(args.repeats),
                              *size], 240, folder / f"{stem}-tensor.json")  # fmt: skip
    separable = bench("separable", ["--device", args.device, "--banks", "demo", "--kernel-only",
                                    "--repeats", str(args.repeats), *size], 180,
                      folder / f"{stem}-separable.json")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="volconv-session-") as scratch:
        e2e = bench("e2e", ["--device", args.device, "--dtypes", "float32", "--repeats", "3",
                            "--out", scratch, *size], 180, folder / f"{stem}-e2e.json")  # fmt: skip

    figures = {
        "tensor_n8_7_seconds": pick(tensor, "results", 0, "tensor_seconds"),
        "tensor_n8_7_fp32_seconds": pick(tensor, "results", 0, "fp32_seconds"),
        "tensor_n8_7_error": pick(tensor, "results", 0, "tensor_error"),
        "demo_separable_kernel_seconds": pick(
            separable, "banks", "demo", "separable", "kernel_seconds"
        ),
        "demo_separable_paths": pick(separable, "banks", "demo", "separable", "paths"),
        "demo_e2e_float32_in_run_seconds": pick(e2e, "runs", "float32", "report", "stages", "wall"),
        "demo_e2e_float32_process_seconds": pick(e2e, "runs", "float32", "process_seconds"),
    }
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "commit": commit(),
        "device": pick(tensor, "device") or pick(separable, "device", "name"),
        "size": args.size,
        "figures": figures,
        "errors": {name: run["error"] for name, run in
                   (("tensor", tensor), ("separable", separable), ("e2e", e2e)) if run["error"]},
        "files": [f"{stem}-{name}.json" for name in ("tensor", "separable", "e2e")],
    }  # fmt: skip
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    for name, why in doc["errors"].items():
        print(f"{name}: {why}", file=sys.stderr)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
