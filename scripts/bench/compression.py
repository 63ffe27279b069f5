"""Compressed outputs on every core against one: volconv's writer (`ResponseWriter`) writing
the same responses per codec and stored type, with the process on all its cores and pinned
to one, beside h5py writing the same data with HDF5's own filters (which run on one thread).

    python scripts/bench/run.py compression --json benchmarks/results/codecs-$(hostname).json
    python scripts/bench/run.py compression --size 128 --codecs gzip,lzf  # quick

The responses are those of a bank over a smoothed-noise volume (so they compress as real
ones do): ``--filters`` Gaussian derivatives of a ``--size``^3 volume, made once. Each
measurement runs in a fresh process (its own pools, BLOSC_NTHREADS read at start), pinned
with ``os.sched_setaffinity`` for the one-core figure (the same code: its pool then has one
thread, beside the writer's), best of ``--repeats``, each after a sync; the one-core and
all-core processes run one after the other on the same bytes. h5py alone (HDF5's filters,
one thread whatever the cores) is timed once, in the all-core process.
Issue 10's goal: every core at least (cores - 1) times as fast as one. ``cores_busy`` (CPU
seconds over wall seconds) tells how many cores the writer kept busy, which shows its
parallelism even where other work takes the cores away; ``compute_only_speedup``, the same
chunks compressed on the same pool with no file at all, how far the cores themselves scale
(a core alone runs at a higher clock than sixteen together), the writer's ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from volconv.report import write_json

CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
cores, data_path, folder, codec, dtype, repeats, depth, floor = sys.argv[1:9]
if cores == "one":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import h5py
import numpy as np
from volconv.output import ResponseWriter, _direct_codec, _pool, compression_options
data = np.load(data_path)
n, nx = data.shape[:2]
depth = int(depth)
kernels = np.zeros((n, 1, 1, 1), np.float32)
attrs = dict.fromkeys(("affine", "voxel_size", "source", "source_sha256", "pipeline", "device",
                       "gflop", "kernel_seconds", "wall_seconds", "gflops", "peak_gflops",
                       "fraction_of_peak", "engine"), 0)
stored = data.astype(dtype) if dtype != "float32" else data
def volconv():
    path = Path(folder) / f"v-{cores}.h5"
    path.unlink(missing_ok=True)
    os.sync()
    t = time.perf_counter()
    used = resource.getrusage(resource.RUSAGE_SELF)
    with ResponseWriter(path, data.shape[1:], [f"f{i}" for i in range(n)], kernels,
                        dtype=dtype, compression=codec, boundary="reflect", cval=0.0,
                        slab_depth=depth) as w:
        created = time.perf_counter() - t  # the file and its layout: one thread either way
        for a in range(0, nx, depth):
            w.write_slab(a, min(a + depth, nx), stored[:, a : a + depth])
        w.drain()
        seconds = time.perf_counter() - t
        now = resource.getrusage(resource.RUSAGE_SELF)
        cpu = now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime
        chunks = w._responses.chunks
        w.finish(attrs)
    size = path.stat().st_size
    path.unlink()
    return seconds, size, chunks, cpu, created
def h5py_alone(chunks):
    path = Path(folder) / f"h-{cores}.h5"
    os.sync()
    t = time.perf_counter()
    with h5py.File(path, "w") as f:
        f.create_dataset("r", data=stored, chunks=chunks, **compression_options(codec))
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds
def compute_only(chunks):
    # the chunks compressed on the writer's pool and nothing else (no file, no writes, no
    # hand-over): how far the cores themselves scale (clocks, caches), the writer's ceiling
    direct = _direct_codec(compression_options(codec))
    blocks = [stored[f, x : x + chunks[1]] for f in range(n) for x in range(0, nx, chunks[1])]
    t = time.perf_counter()
    for _ in _pool().map(direct, blocks):
        pass
    return time.perf_counter() - t
runs = [volconv() for _ in range(int(repeats))]
best = min(runs)
chunks = best[2]
floor = h5py_alone(chunks) if floor == "1" else None  # HDF5's filters: one thread either way
compute = min(compute_only(chunks) for _ in range(1 if cores == "one" else int(repeats)))
print(json.dumps({"seconds": best[0], "all": [r[0] for r in runs],
                  "cpu_seconds": best[3], "cores_busy": best[3] / best[0],
                  "bytes": best[1], "chunks": chunks, "h5py_seconds": floor,
                  "create_seconds": best[4], "compute_only_seconds": compute,
                  "cores": len(os.sched_getaffinity(0))}))
"""


def responses(size: int, n: int) -> np.ndarray:
    """``n`` responses of Gaussian derivatives over a smoothed-noise ``size``^3 volume."""
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(0)
    volume = gaussian_filter(rng.standard_normal((size,) * 3).astype(np.float32), 2.0) * 400
    orders = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2, 0, 0), (0, 2, 0), (0, 0, 2),
              (1, 1, 0)]  # fmt: skip
    return np.stack([gaussian_filter(volume, 1.0 + i % 3, order=orders[i % len(orders)])
                     for i in range(n)]).astype(np.float32)  # fmt: skip


def measure(cores: str, data: Path, folder: Path, codec: str, dtype: str, args) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, cores, str(data), str(folder), codec, dtype,
         str(args.repeats), str(args.slab_depth), "1" if cores == "all" and args.h5py else "0"],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{codec} {dtype} ({cores}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256, help="edge of the volume")
    p.add_argument("--filters", type=int, default=8)
    p.add_argument("--codecs", default="gzip,lzf,blosc,blosc2,lz4,zstd",
                   help="output.compression names (hdf5plugin's skipped if absent)")  # fmt: skip
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--slab-depth", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-h5py", dest="h5py", action="store_false",
                   help="skip h5py alone writing the same data (one thread, slow)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="folder for the files (a tmp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    try:
        import hdf5plugin  # noqa: F401

        plugins = True
    except ImportError:
        plugins = False
    codecs = [c for c in args.codecs.split(",")
              if plugins or c in ("gzip", "lzf") or c.startswith("gzip-")]  # fmt: skip
    folder = args.out or Path(tempfile.mkdtemp(prefix="volconv-codecs-"))
    folder.mkdir(parents=True, exist_ok=True)
    data_path = folder / "responses.npy"
    np.save(data_path, responses(args.size, args.filters))
    cores = len(os.sched_getaffinity(0))
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cores": cores,
        "shape": [args.filters, *(args.size,) * 3], "slab_depth": args.slab_depth,
        "repeats": args.repeats, "goal_speedup": max(1, cores - 1), "codecs": {},
    }  # fmt: skip
    print(f"{cores} cores; responses {result['shape']} float32 "
          f"({np.load(data_path, mmap_mode='r').nbytes / 2**20:.0f} MiB)", flush=True)  # fmt: skip
    for codec in codecs:
        for dtype in args.dtypes.split(","):
            one = measure("one", data_path, folder, codec, dtype, args)
            every = measure("all", data_path, folder, codec, dtype, args)
            speedup = one["seconds"] / every["seconds"]
            raw = np.prod(result["shape"]) * np.dtype(dtype).itemsize
            ceiling = one["compute_only_seconds"] / every["compute_only_seconds"]
            entry = {
                "one_core": one, "all_cores": every, "speedup": speedup,
                "compute_only_speedup": ceiling,
                "over_h5py_alone": every["h5py_seconds"] / every["seconds"]
                if every["h5py_seconds"] else None,
                "compressed_fraction": every["bytes"] / raw,
                "goal_met": speedup >= result["goal_speedup"],
            }  # fmt: skip
            result["codecs"][f"{codec}/{dtype}"] = entry
            print(
                f"{codec:7s} {dtype}: one core {one['seconds']:.3f} s, {every['cores']} cores "
                f"{every['seconds']:.3f} s: {speedup:.2f}x (goal {result['goal_speedup']}x; "
                f"{every['cores_busy']:.1f} cores busy; file made in "
                f"{every['create_seconds'] * 1e3:.0f} ms); "
                f"compressing alone, no file: {ceiling:.2f}x; "
                + (
                    f"h5py alone {every['h5py_seconds']:.3f} s ({entry['over_h5py_alone']:.2f}x); "
                    if every["h5py_seconds"]
                    else ""
                )
                + f"{100 * entry['compressed_fraction']:.0f} % of the raw bytes",
                flush=True,
            )
    data_path.unlink()
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
