"""A run's host memory within ``[run] host_memory`` whether or not a float input holds NaN or
Inf (SPEC "Memory"): the plan counts the non-finite override (`pipeline.nonfinite_bytes`),
and a real run, measured by the kernel's peak-RSS mark, stays within the bound."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
from test_nonfinite import assert_nonfinite_as_scipy
from test_pipeline import DEVICE, write_pipeline

import volconv.pipeline as pipeline
from volconv.config import load

# In a fresh process: a warm-up run (every program built), then the measured run with the
# peak-RSS mark (VmHWM) reset: what the run held, above what the process held before.
MEASURE = """
import gc, json, sys
from volconv.config import load
from volconv.pipeline import run

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

warm, measured = sys.argv[1:3]
run(load(warm), overwrite=True)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
report = run(load(measured), overwrite=True).reports[0]
print(json.dumps({"status": report.status, "grown": status("VmHWM") - before}))
"""

FILTERS = [
    {"type": "gaussian", "sigma": 1.0, "size": 5},
    {"type": "gaussian", "sigma": 1.0, "size": 5, "order": [1, 0, 0]},
    {"type": "log", "sigma": 1.0, "size": 5},
    {"type": "custom", "path": "random.npy"},  # not separable: a direct group's override
]


def masked_volume(shape: tuple[int, int, int]) -> np.ndarray:
    """A float32 map with a NaN background outside a ball and +-Inf voxels inside."""
    rng = np.random.default_rng(5)
    v = (rng.standard_normal(shape) * 30).astype(np.float32)
    x, y, z = np.indices(shape, sparse=True)
    c = (np.array(shape) - 1) / 2
    v[(x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2 > (0.45 * min(shape)) ** 2] = np.nan
    v[shape[0] // 2, 20:23, 30:34] = np.inf
    v[shape[0] // 3, 40, 41:44] = -np.inf
    return v


def test_a_float_input_holding_nan_runs_within_host_memory(tmp_path):
    """A masked map through separable filters and a direct group: the slab depth is the
    deepest whose bytes, the override's included, fit the bound (without them a deeper one
    did); the run holds no more than counted; NaN and Inf land where scipy puts them."""
    vol = masked_volume((48, 96, 96))
    np.save(tmp_path / "random.npy", np.random.default_rng(6).standard_normal((3, 3, 3)))
    bound = 12 * 2**20
    paths = {}
    for name, v in (("warm", vol[20:28]), ("masked", vol)):
        np.save(tmp_path / f"{name}.npy", v)
        paths[name] = write_pipeline(
            tmp_path, FILTERS, input={"paths": [f"{name}.npy"]},
            output={"path": f"out/{name}.h5"}, run={"device": DEVICE, "host_memory": bound},
        )  # fmt: skip
        paths[name] = paths[name].rename(tmp_path / f"{name}.toml")
    cfg = load(paths["masked"])
    device = pipeline.choose_device(cfg)
    (job,) = pipeline.plan_jobs(cfg, device)
    depth = job.plan.slab_depth
    assert job.plan.n_separable and len(job.plan.groups) == 2  # overrides of each kind

    def fits(d: int, counted: bool = True) -> bool:
        need = pipeline.host_bytes(job, cfg, d, device)
        if not counted:  # as before the override was counted
            need -= sum(pipeline.nonfinite_bytes(job, cfg, d, device))
        return need <= bound

    # the deepest slab that fits with the override counted; without it, a deeper one did
    assert 1 < depth < vol.shape[0] and fits(depth) and not fits(depth + 1)
    assert fits(depth + 1, counted=False)
    assert job.host_bytes == pipeline.host_bytes(job, cfg, depth, device) <= bound
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(paths["warm"]), str(paths["masked"])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["status"] == "done"
    grown = measured["grown"]  # within what the plan counted, so within the bound
    assert grown <= job.host_bytes, f"the run grew by {grown / 2**20:.1f} MiB"
    with h5py.File(tmp_path / "out" / "masked.h5") as f:
        out = f["responses"][()]
    assert_nonfinite_as_scipy(out, vol, job.kernels, "reflect")
