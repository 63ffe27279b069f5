"""A run's host memory against ``[run] host_memory``, for a float volume with and without NaN/Inf.

For each input, one fresh process runs `volconv.run.pipeline.run` twice: first on a warm-up
volume of the same plane and 8 rows holding NaN and Inf (imports, the OpenCL context and
every program the measured run builds, the non-finite override's counting kernels included),
then, after resetting the kernel's peak-RSS mark (``/proc/self/clear_refs``), on the measured
input. ``grown`` = the peak RSS of that run (``VmHWM``) - the RSS before it: what the run
held for data, which docs/contract.md, "Memory", bounds by ``host_memory``; beside it the
bytes the plan counted (`volconv.run.memory.host_bytes`) and its slab depth. The inputs:
  - ``finite``: float32 (or ``--dtype``), every voxel finite;
  - ``nonfinite``: the same volume with a NaN background outside a ball (a masked map: every
    slab holds NaN) and a few +-Inf voxels inside, so that the override runs on every slab
    (float types only).
Each is measured ``--repeats`` times, alternating; the least growth of each is kept.

    python scripts/bench/run.py host_memory --size 192 --host-memory 96MiB \\
        --json benchmarks/results/vm2core-host-memory-after.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

BANK = """
[bank]
size = 7
boundary = "reflect"

[[bank.filter]]
type = "gaussian"
sigma = 1.0

[[bank.filter]]
type = "gaussian"
sigma = 1.0
order = [1, 0, 0]

[[bank.filter]]
type = "gaussian"
sigma = 1.0
order = [0, 1, 0]

[[bank.filter]]
type = "gaussian"
sigma = 1.0
order = [0, 0, 1]

[[bank.filter]]
type = "log"
sigma = 1.0

[[bank.filter]]
type = "log"
sigma = 1.5

[[bank.filter]]
type = "dog"
sigma = 1.0
sigma2 = 1.6

[[bank.filter]]
type = "box"
"""

# Run in a fresh process: warm up, reset the peak mark, run the measured pipeline.
MEASURE = """
import gc, json, sys
from volconv.config import load
from volconv.run.jobs import choose_device, plan_jobs
from volconv.run.pipeline import run

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

warm, measured = sys.argv[1:3]
run(load(warm), overwrite=True)
cfg = load(measured)
job = plan_jobs(cfg, choose_device(cfg), overwrite=True)[0]
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS mark (VmHWM) starts again from the RSS now
before = status("VmRSS")
report = run(cfg, overwrite=True).reports[0]
print(json.dumps({"status": report.status, "grown_bytes": status("VmHWM") - before,
                  "wall_seconds": report.stages["wall"],
                  "rss_before_bytes": before, "slab_depth": job.plan.slab_depth,
                  "host_bytes": job.host_bytes, "host_memory": cfg.host_memory}))
"""


def volumes(n: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The warm-up volume (8 rows of the plane, holding NaN and Inf), the finite volume of
    ``n``^3 voxels and its copy with NaN outside a ball and +-Inf voxels inside; for an
    integer ``dtype``, the finite volume and its warm-up only."""
    rng = np.random.default_rng(7)
    finite = (rng.standard_normal((n, n, n)) * 100).astype(np.float32)
    if np.dtype(dtype).kind in "iu":
        finite = np.clip(finite + 128, 0, np.iinfo(dtype).max).astype(dtype)
        return {"warm": finite[n // 2 - 4 : n // 2 + 4].copy(), "finite": finite}
    x, y, z = np.indices((n, n, n), sparse=True)
    c = (n - 1) / 2
    outside = (x - c) ** 2 + (y - c) ** 2 + (z - c) ** 2 > (0.45 * n) ** 2
    nonfinite = np.where(outside, np.float32(np.nan), finite)
    points = rng.integers(n // 4, 3 * n // 4, (2, 16, 3))
    nonfinite[tuple(points[0].T)] = np.inf
    nonfinite[tuple(points[1].T)] = -np.inf
    warm = nonfinite[n // 2 - 4 : n // 2 + 4].copy()
    warm[4, n // 2, n // 2], warm[2, n // 3, n // 3] = np.inf, -np.inf
    return {"warm": warm, "finite": finite, "nonfinite": nonfinite}


def pipeline(folder: Path, name: str, host_memory: str, device: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(
        f'[input]\npaths = ["{name}.npy"]\n{BANK}\n[output]\npath = "{name}.h5"\n\n'
        f'[run]\ndevice = "{device}"\nhost_memory = "{host_memory}"\n'
    )
    return path


def measure(warm: Path, measured: Path, env: dict[str, str] | None = None) -> dict:
    """Run pipeline ``warm``, then ``measured``, in a fresh process: how far the measured
    run grew the peak RSS (``grown_bytes``) beside its plan (tests/test_host_memory.py too)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(warm), str(measured)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the run failed: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=192, help="edge of the cubic volume")
    parser.add_argument("--host-memory", default="96MiB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="an integer type: finite only")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="write the inputs and pipelines here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="volconv-host-memory-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, vol in volumes(args.size, args.dtype).items():
            np.save(folder / f"{name}.npy", vol)
            paths[name] = pipeline(folder, name, args.host_memory, args.device)
        runs: dict[str, list[dict]] = {name: [] for name in paths if name != "warm"}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(measure(paths["warm"], paths[name]))
    result = {
        "command": " ".join(["python", "scripts/bench/host_memory.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.machine()}), PoCL CPU device",
        "shape": [args.size] * 3, "dtype": args.dtype, "n_filters": 8, "extent": 7,
        "device": args.device, "runs": runs, "inputs": {},
    }  # fmt: skip
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["grown_bytes"])
        each = ", ".join(f"{r['grown_bytes'] / 2**20:.1f}" for r in rs)
        entry = {**best, "grown_over_host_memory": best["grown_bytes"] / best["host_memory"],
                 "grown_over_host_bytes": best["grown_bytes"] / best["host_bytes"]}  # fmt: skip
        result["inputs"][name] = entry
        print(
            f"{name:9s} slab {best['slab_depth']:3d} rows, planned "
            f"{best['host_bytes'] / 2**20:6.1f} MiB of {best['host_memory'] / 2**20:.0f} MiB; "
            f"the run grew RSS by {best['grown_bytes'] / 2**20:6.1f} MiB = "
            f"{entry['grown_over_host_memory']:.2f} x host_memory "
            f"(each: {each} MiB); wall {min(r['wall_seconds'] for r in rs):.2f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
