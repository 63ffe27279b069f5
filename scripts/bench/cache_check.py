"""The binary cache on one device, cold then warm, as two fresh processes each: every engine
(the FP32 kernel, and the tensor cores where they run, wgmma on sm_90) right against scipy,
the programs built once and loaded after, one 'building kernels' line the first time only,
no pyopencl CompilerWarning. JSON to --json (e.g. $OUT/cache_check.json).

    python scripts/bench/run.py cache_check --device nvidia --json $OUT/cache_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
import numpy as np, scipy.ndimage as ndi
t0 = time.perf_counter()
from volconv.checks import spec_tolerance
from volconv.engine import convolve_bank
rng = np.random.default_rng(5)
cases = []
runs = (("fp32", np.float32, 3), ("tensor", np.uint8, 7), ("tensor", np.int16, 7))
for engine, dtype, extent in runs:
    os.environ["VOLCONV_ENGINE"] = engine
    v = (rng.random((24, 22, 40)) * 200).astype(dtype)
    k = rng.standard_normal((8, extent, extent, extent))
    try:
        out = convolve_bank(v, k, "reflect", device=sys.argv[1])
    except Exception as e:  # the tensor cores absent here
        cases.append({"engine": engine, "dtype": np.dtype(dtype).name, "error": repr(e)[:300]})
        continue
    worst = max(float(np.max(np.abs(out[i] - ndi.convolve(v.astype(float), k[i], mode="reflect"))))
                / spec_tolerance(k[i], float(np.abs(v).max())) for i in range(len(k)))
    cases.append({"engine": engine, "dtype": np.dtype(dtype).name, "error_over_tolerance": worst})
print(json.dumps({"cases": cases, "seconds_in_process": time.perf_counter() - t0}))
"""


def child(device: str, cache: Path) -> dict:
    env = {**os.environ, "VOLCONV_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, device], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    wall = time.perf_counter() - t0
    record = {"returncode": done.returncode, "process_seconds": wall, "stderr": done.stderr}
    if done.returncode == 0:
        record.update(json.loads(done.stdout.strip().splitlines()[-1]))
    record["building_lines"] = done.stderr.count("volconv: building kernels")
    record["compiler_warnings"] = done.stderr.count("CompilerWarning")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="volconv-cache-check-") as tmp:
        cache = Path(tmp) / "cache"
        cold = child(args.device, cache)
        entries = sorted(p.name for p in (cache / "programs").iterdir()) if cache.exists() else []
        warm = child(args.device, cache)
    ok = (cold["returncode"] == 0 and warm["returncode"] == 0 and bool(entries)
          and cold["building_lines"] == 1 and warm["building_lines"] == 0
          and cold["compiler_warnings"] == warm["compiler_warnings"] == 0
          and all(c.get("error_over_tolerance", 0) <= 1 for r in (cold, warm)
                  for c in r.get("cases", [])))  # fmt: skip
    record = {"device": args.device, "ok": ok, "program_entries": len(entries), "cold": cold,
              "warm": warm}  # fmt: skip
    text = json.dumps(record, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
