"""A run's host memory within ``[run] host_memory`` whether or not a float input holds NaN or
Inf (contract, "Memory"): the plan counts the non-finite override (`memory.nonfinite_bytes`),
and a real run, measured by the kernel's peak-RSS mark, stays within the bound."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pyopencl as cl
import pytest
from test_nonfinite import assert_nonfinite_as_scipy
from test_pipeline import DEVICE, write_pipeline

from volconv.config import load
from volconv.engines.digits import DigitConvolver, DigitPlan
from volconv.engines.direct import BankConvolver
from volconv.engines.padder import Padder
from volconv.engines.tensor import TensorShape
from volconv.run import jobs, memory

# The measuring script's fresh-process run: a warm-up run (every program built), then the
# measured run with the peak-RSS mark (VmHWM) reset: what the run held, above what the
# process held before.
_spec = importlib.util.spec_from_file_location(
    "measure_host_memory", Path(__file__).parents[1] / "scripts" / "bench" / "host_memory.py"
)
measure_host_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure_host_memory)

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
    device = jobs.choose_device(cfg)
    (job,) = jobs.plan_jobs(cfg, device)
    depth = job.plan.slab_depth
    assert job.plan.n_separable and len(job.plan.groups) == 2  # overrides of each kind

    def fits(d: int, counted: bool = True) -> bool:
        need = memory.host_bytes(job, cfg, d, device)
        if not counted:  # as before the override was counted
            on_host, buffers = memory.nonfinite_bytes(job, d, device)
            need -= on_host + (buffers if device.type & cl.device_type.CPU else 0)
        return need <= bound

    # the deepest slab that fits with the override counted; without it, a deeper one did
    assert 1 < depth < vol.shape[0] and fits(depth) and not fits(depth + 1)
    assert fits(depth + 1, counted=False)
    assert job.host_bytes == memory.host_bytes(job, cfg, depth, device) <= bound
    # glibc's mmap threshold fixed: freed slabs go back to the system rather than staying in
    # a thread's heap, which made the peak vary by up to 8 MiB from run to run
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 2**10)}
    measured = measure_host_memory.measure(paths["warm"], paths["masked"], env)
    assert measured["status"] == "done"
    grown = measured["grown_bytes"]  # within what the plan counted, so within the bound
    assert grown <= job.host_bytes, f"the run grew by {grown / 2**20:.1f} MiB"
    with h5py.File(tmp_path / "out" / "masked.h5") as f:
        out = f["responses"][()]
    assert_nonfinite_as_scipy(out, vol, job.kernels, "reflect")


def held_buffers(obj: object, found: dict[int, int] | None = None) -> dict[int, int]:
    """Every OpenCL buffer ``obj`` holds (in its attributes, their containers, its padder
    and inner convolvers), by address: its size."""
    found = {} if found is None else found
    items = vars(obj).values() if hasattr(obj, "__dict__") else obj
    for v in items:
        if isinstance(v, cl.Buffer):
            found[v.int_ptr] = v.size
        elif isinstance(v, (Padder, BankConvolver)):
            held_buffers(v, found)
        elif isinstance(v, dict):
            held_buffers(v.values(), found)
        elif isinstance(v, (list, tuple)):
            held_buffers(v, found)
    return found


@pytest.mark.parametrize("dtype", [np.float32, np.int16])
def test_digit_convolvers_count_the_buffers_they_hold(device, dtype):
    """`DigitConvolver` (the emulated kernel, on any device): its plan's ``device_bytes``
    grows with the slab as the buffers it really holds do (the digit slabs and the second
    response buffer included), and a memory budget plans the deepest slab that fits it."""
    bank = np.random.default_rng(3).standard_normal((3, 3, 3, 5))
    shape = (40, 9, 20)

    def digits(**kw) -> DigitConvolver:
        return DigitConvolver(bank, shape, dtype, "reflect", device=device, emulate=True,
                              shape_split=TensorShape(1, 2, 1, 2, 4), **kw)  # fmt: skip

    held, plans = [], []
    for depth in (4, 12):
        conv = digits(slab_depth=depth)
        assert isinstance(conv.plan, DigitPlan) and conv.plan.slab_depth == depth
        held.append(sum(held_buffers(conv).values()))
        plans.append(conv.plan.device_bytes)
    # every buffer that grows with the slab is counted, but the padders' row maps (4 bytes a
    # row each: outer, and one per digit type)
    assert 0 <= (held[1] - held[0]) - (plans[1] - plans[0]) <= 3 * 4 * (12 - 4)
    assert 0 <= held[0] - plans[0] < 16384  # the rest, fixed: coefficients and index maps
    budget = (plans[0] + plans[1]) // 2
    conv = digits(memory_budget=budget)
    plan = conv.plan
    assert 4 < plan.slab_depth < 12
    assert plan.device_bytes <= budget < replace(plan, slab_depth=plan.slab_depth + 1).device_bytes


def test_a_shorter_last_slab_counts_its_padded_chunks(tmp_path):
    """The writer pads the last slab's chunks to whole ones (a slab of the stored type held
    at once), so a depth that does not divide the volume counts one stored slab more."""
    np.save(tmp_path / "a.npy", np.zeros((24, 16, 16), np.uint8))
    cfg = load(write_pipeline(tmp_path, [{"type": "box"}, {"type": "gaussian", "sigma": 1.0}]))
    device = jobs.choose_device(cfg)
    (job,) = jobs.plan_jobs(cfg, device)

    def need(depth: int) -> int:
        return memory.host_bytes(job, cfg, depth, device)

    slab = 2 * 7 * 16 * 16 * 4  # 2 float32 responses, 7 rows
    assert need(7) == need(6) + (need(8) - need(6)) // 2 + slab  # 24 = 3 x 8 = 4 x 6
