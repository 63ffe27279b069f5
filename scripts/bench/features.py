"""Derived features on the device against the peers' own functions, on the same volume, in one run.

Feature sets (each through `volconv.engines.separable.SeparableConvolver` with its features, the
volume slab by slab as `volconv run` streams it, float32 outputs):
  hessian_s1, hessian_s3      hessian_eigenvalues(sigma)
  structure_s1, structure_s3  structure_tensor_eigenvalues(sigma=1, rho=1 or 3)
  gradient_s1                 gradient_magnitude(1)
  skimage                     preset "skimage" (multiscale_basic_features' 30 channels)
  ilastik                     preset "ilastik" at scales 0.7, 1, 1.6, 3.5, 5 (50 channels)
After a warm-up pass (PoCL compiles each kernel at its first launch) one timed pass (the
median of --repeat; each peer as often, after): wall
seconds to every output in host memory, the process's CPU seconds (every thread: the host's
and PoCL's workers; less sensitive than the wall to other programs on a shared machine), and
device seconds per stage from OpenCL profiling
events ("kernel": the passes and the features; a structure tensor's second smoothing and
eigenvalues included) and per kernel by name ("kernel_ms_by_name": pass_fast, pass_mid,
pass_out, fused, eigen3, magnitude, product_pad, ...); device bytes: the plan's buffers and
the structure tensors'.

Peers on the same volume (float32, each timed once after a warm-up where it runs on a GPU):
  --mode pocl: scikit-image on the CPU (hessian_matrix + hessian_matrix_eigvals,
    structure_tensor + structure_tensor_eigenvalues, multiscale_basic_features) and
    scipy.ndimage for the gradient magnitude and ilastik's definitions (ilastik itself is not
    installed); volconv on the PoCL device. JSON to --json (benchmarks/results/).
  --mode gpu: cuCIM (cucim.skimage.feature, CUDA events, CuPy's memory pool) and
    pyclesperanto (wall after a sync), each call guarded (a peer's missing function is
    recorded, not fatal); volconv on the first GPU. JSON to $OUT/bench_features.json.

    .venv/bin/python scripts/bench/run.py features --mode pocl --size 128 \\
        --json benchmarks/results/pocl-features.json
    # on the GPU node (source scripts/gpu_env.sh first):
    python3 scripts/bench/run.py features --mode gpu --size 256 --json $OUT/bench_features.json \
        --save-volume /tmp/scan256.npy
    # end to end, the ilastik preset against the raw-response bank (bytes written, wall):
    python3 -m volconv run pipelines/ilastik_preset.toml \
        --set 'input.paths=["/tmp/scan256.npy"]' --set 'output.path=/tmp/e2e/preset/{stem}.h5' \
        --report $OUT/e2e_ilastik_preset.json
    python3 -m volconv run pipelines/ilastik_features.toml \
        --set 'input.paths=["/tmp/scan256.npy"]' --set 'output.path=/tmp/e2e/raw/{stem}.h5' \
        --report $OUT/e2e_ilastik_raw.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.ndimage as ndi

from volconv.bank.features import PAIRS, build_features, expand
from volconv.bench import volume_record
from volconv.device.devices import select_device
from volconv.engines.features import eigenvalues
from volconv.engines.separable import SeparableConvolver
from volconv.plan.separable import make_separable_plan, plan_paths

ROOT = Path(__file__).resolve().parents[2]
AXES = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
ILASTIK_SCALES = [0.7, 1.0, 1.6, 3.5, 5.0]


def feature_sets() -> dict[str, tuple[list, str]]:
    """name -> (features, boundary mode)."""

    def tables(*t: dict) -> list:
        return build_features(list(t))

    return {
        "hessian_s1": (tables({"type": "hessian_eigenvalues", "sigma": 1.0, "name": "h"}),
                       "reflect"),
        "hessian_s3": (tables({"type": "hessian_eigenvalues", "sigma": 3.0, "name": "h"}),
                       "reflect"),
        "structure_s1": (tables({"type": "structure_tensor_eigenvalues", "sigma": 1.0,
                                 "rho": 1.0, "name": "s"}), "reflect"),
        "structure_s3": (tables({"type": "structure_tensor_eigenvalues", "sigma": 1.0,
                                 "rho": 3.0, "name": "s"}), "reflect"),
        "gradient_s1": (tables({"type": "gradient_magnitude", "sigma": 1.0, "name": "g"}),
                        "reflect"),
        "skimage": (build_features(None, preset="skimage"), "nearest"),
        "ilastik": (build_features(None, preset="ilastik", scales=ILASTIK_SCALES), "mirror"),
    }  # fmt: skip


def volume_of(size: int, synthetic: bool = False) -> np.ndarray:
    """The demo scan (scripts/make_demo_volume.py) if present at this size (and not
    ``synthetic``), else a synthetic uint8 volume: a smooth field, balls and noise."""
    scan = ROOT / "data" / "mni152_t1_256.nii"
    if scan.exists() and not synthetic:
        import nibabel

        data = np.asarray(nibabel.load(scan).dataobj)
        if data.shape[:3] == (size,) * 3:
            return np.clip(data[..., 0] if data.ndim == 4 else data, 0, 255).astype(np.uint8)
    rng = np.random.default_rng(0)
    x = np.indices((size,) * 3) / size
    v = 100 + 60 * np.sin(6 * x[0]) * np.cos(5 * x[1]) + 40 * x[2]
    for c in rng.random((12, 3)):
        v[((x - c[:, None, None, None]) ** 2).sum(0) < 0.004] += 60
    v += rng.normal(0, 8, v.shape)
    return np.clip(v, 0, 255).astype(np.uint8)


def convolver_for(volume: np.ndarray, feats: list, mode: str, device) -> SeparableConvolver:
    """The convolver `volconv run` makes for a feature set: its plan's paths and slab depth
    (streamed)."""
    ex = expand([], feats)
    choices = plan_paths(ex.filters, device, separable=ex.separable)
    plan = make_separable_plan(ex.filters, volume.shape, volume.dtype, mode, 0.0, device,
                               choices=choices, stream=True, **ex.plan_sizes())  # fmt: skip
    return SeparableConvolver(ex.filters, volume.shape, volume.dtype, mode, 0.0, device=device,
                              expanded=ex, choices=choices,
                              slab_depth=plan.slab_depth)  # fmt: skip


def run_volconv(volume: np.ndarray, feats: list, mode: str, device, repeat: int = 1) -> dict:
    """One feature set as `volconv run` runs it: its plan's slab depth (streamed); the wall
    and device seconds the median of ``repeat`` timed passes."""
    t0 = time.perf_counter()
    conv = convolver_for(volume, feats, mode, device)
    build = time.perf_counter() - t0
    pinned = conv.pinned_slab()

    cpu: list[float] = []

    def one_pass() -> float:
        t, c = time.perf_counter(), time.process_time()
        for a, b in conv.slabs():
            conv.convolve_slab(a, b, out=pinned[:, : b - a], frame=volume)
        cpu.append(time.process_time() - c)
        return time.perf_counter() - t

    first = one_pass()
    cpu.clear()
    walls, stage_runs, kernel_runs = [], [], []
    for _ in range(repeat):
        before, kernels_before = dict(conv.timings), conv.kernel_seconds
        walls.append(one_pass())
        stage_runs.append({k: conv.timings[k] - before[k] for k in conv.timings})
        kernel_runs.append({k: v - kernels_before.get(k, 0.0)
                            for k, v in conv.kernel_seconds.items()})  # fmt: skip
    wall = float(np.median(walls))
    stages = {k: float(np.median([r[k] for r in stage_runs])) for k in stage_runs[0]}
    kernels = {k: float(np.median([r.get(k, 0.0) for r in kernel_runs])) for k in kernel_runs[0]}
    stage_bytes = sum(getattr(s, "held_bytes", 0) for s, _ in conv._tensors)
    return {
        "outputs": conv.plan.n_outputs,
        "filters": conv.plan.n_filters,
        "engines": conv.engines,
        "fused": conv.plan.fused,
        "slab_depth": conv.plan.slab_depth,
        "build_seconds": build,
        "first_pass_seconds": first,
        "wall_seconds": wall,
        "wall_seconds_all": walls,
        "cpu_seconds": float(np.median(cpu)),
        "cpu_seconds_all": cpu,
        "columns": getattr(conv.plan, "columns", False),
        "device_seconds": stages,
        "kernel_ms": stages["kernel"] * 1e3,
        "kernel_ms_by_name": {k: v * 1e3 for k, v in sorted(kernels.items())},
        "device_bytes": conv.plan.device_bytes + stage_bytes,
    }


# -- peers on the CPU ---------------------------------------------------------------------
def cpu_peers(volume: np.ndarray) -> dict[str, Callable[[], object]]:
    from skimage import feature

    v = volume.astype(np.float32)

    def hessian(s: float) -> Callable[[], object]:
        return lambda: feature.hessian_matrix_eigvals(
            feature.hessian_matrix(v, s, order="rc", use_gaussian_derivatives=True)
        )

    def structure(rho: float) -> Callable[[], object]:
        return lambda: feature.structure_tensor_eigenvalues(
            feature.structure_tensor(v, sigma=rho, order="rc")
        )

    def ilastik() -> object:  # ilastik's definitions in scipy (OpPixelFeaturesPresmoothed)
        out = []
        for s in ILASTIK_SCALES:
            pre = ndi.gaussian_filter(v, math.sqrt(s * s - 1) if s > 1 else s, truncate=3.5,
                                      mode="mirror")  # fmt: skip
            i = min(s, 1.0)
            g = [ndi.gaussian_filter(pre, i, o, truncate=2, mode="mirror") for o in AXES]
            out += [ndi.gaussian_filter(pre, i, truncate=2, mode="mirror"),
                    ndi.gaussian_laplace(pre, i, truncate=2, mode="mirror"),
                    np.sqrt(sum(x * x for x in g)),
                    ndi.gaussian_filter(pre, 0.66 * i, truncate=2, mode="mirror")]  # fmt: skip
            out += eigenvalues([ndi.gaussian_filter(g[a] * g[b], 0.5 * i, truncate=2,
                                                    mode="mirror") for a, b in PAIRS])  # fmt: skip
            hs = [ndi.gaussian_filter(pre, i, tuple(x + y for x, y in zip(AXES[a], AXES[b],
                                                                       strict=True)),
                                      truncate=2, mode="mirror") for a, b in PAIRS]  # fmt: skip
            out += eigenvalues(hs)
        return out

    return {
        "hessian_s1": hessian(1.0),
        "hessian_s3": hessian(3.0),
        "structure_s1": structure(1.0),
        "structure_s3": structure(3.0),
        "gradient_s1": lambda: ndi.gaussian_gradient_magnitude(v, 1.0),
        "skimage": lambda: feature.multiscale_basic_features(v),
        "ilastik": ilastik,
    }


def time_cpu(fn: Callable[[], object], repeat: int = 1) -> dict:
    """The median of ``repeat`` calls, and each; the median CPU seconds."""
    runs, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        runs.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"seconds": float(np.median(runs)), "seconds_all": runs,
            "cpu_seconds": float(np.median(cpu))}  # fmt: skip


# -- peers on the GPU ---------------------------------------------------------------------
def gpu_peers(volume: np.ndarray) -> dict[str, dict]:
    """cuCIM and pyclesperanto on each feature set they have, guarded."""
    out: dict[str, dict] = {}
    try:
        import cupy as cp
        from cucim.skimage import feature as cf

        v = cp.asarray(volume, dtype=cp.float32)
        pool = cp.get_default_memory_pool()
        calls = {
            "hessian_s1": lambda: cf.hessian_matrix_eigvals(
                cf.hessian_matrix(v, 1.0, order="rc", use_gaussian_derivatives=True)),
            "hessian_s3": lambda: cf.hessian_matrix_eigvals(
                cf.hessian_matrix(v, 3.0, order="rc", use_gaussian_derivatives=True)),
            "structure_s1": lambda: cf.structure_tensor_eigenvalues(
                cf.structure_tensor(v, sigma=1.0, order="rc")),
            "structure_s3": lambda: cf.structure_tensor_eigenvalues(
                cf.structure_tensor(v, sigma=3.0, order="rc")),
            "skimage": lambda: cf.multiscale_basic_features(v),
        }  # fmt: skip
        for name, fn in calls.items():
            try:
                pool.free_all_blocks()
                t = time.perf_counter()
                fn()
                cp.cuda.runtime.deviceSynchronize()
                first = time.perf_counter() - t
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                out.setdefault(name, {})["cucim"] = {
                    "ms": cp.cuda.get_elapsed_time(start, stop),
                    "first_call_seconds": first,
                    "pool_bytes": int(pool.total_bytes()),
                }
            except Exception as e:  # a peer's missing function or memory: recorded
                out.setdefault(name, {})["cucim"] = {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:
        out["cucim"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        import pyclesperanto as cle

        g = cle.push(volume.astype(np.float32))

        def hessian(s: float) -> Callable[[], object]:
            def fn() -> object:
                blurred = cle.gaussian_blur(g, sigma_x=s, sigma_y=s, sigma_z=s)
                return cle.hessian_eigenvalues(blurred)

            return fn

        for name, fn in {"hessian_s1": hessian(1.0), "hessian_s3": hessian(3.0)}.items():
            try:
                fn()
                t = time.perf_counter()
                result = fn()
                np.asarray(cle.pull(result[0] if isinstance(result, list | tuple) else result))
                out.setdefault(name, {})["pyclesperanto"] = {
                    "ms_with_pull": (time.perf_counter() - t) * 1e3
                }
            except Exception as e:
                out.setdefault(name, {})["pyclesperanto"] = {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:
        out["pyclesperanto"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("pocl", "gpu"), default="pocl")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--only", default="", help="comma-separated feature sets (default: all)")
    p.add_argument("--device", default=None, help="volconv's device (default: cpu / gpu)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-peers", action="store_true", help="volconv only")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each; their medians")
    p.add_argument(
        "--max-fused-values",
        type=int,
        default=None,
        help="the fused kernel's register bound (separable.MAX_FUSED_VALUES), for trials",
    )
    p.add_argument(
        "--save-volume",
        type=Path,
        default=None,
        help="also save the volume as .npy (for volconv run end to end)",
    )
    args = p.parse_args()
    device = select_device(args.device or ("cpu" if args.mode == "pocl" else "gpu"))
    if args.max_fused_values is not None:
        from volconv.plan import separable

        separable.MAX_FUSED_VALUES = args.max_fused_values
    volume = volume_of(args.size)
    if args.save_volume:
        np.save(args.save_volume, volume)
    sets = feature_sets()
    if args.only:
        sets = {k: v for k, v in sets.items() if k in args.only.split(",")}
    result: dict = {
        **volume_record(volume, device),
        "mode": args.mode,
        "max_fused_values": args.max_fused_values,
        "repeat": args.repeat,
        "sets": {},
    }
    peers = cpu_peers(volume) if args.mode == "pocl" and not args.no_peers else {}
    for name, (feats, mode) in sets.items():
        entry = {"volconv": run_volconv(volume, feats, mode, device, args.repeat)}
        if name in peers:
            entry["cpu_peer"] = time_cpu(peers[name], args.repeat)
            entry["speedup_wall"] = entry["cpu_peer"]["seconds"] / entry["volconv"]["wall_seconds"]
        result["sets"][name] = entry
        print(name, json.dumps(entry, default=float), flush=True)
    if args.mode == "gpu" and not args.no_peers:
        for name, found in gpu_peers(volume).items():
            result["sets"].setdefault(name, {}).update(found)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
