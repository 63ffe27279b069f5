"""The write stage alone: `ResponseWriter` fed slabs from memory as the pipeline feeds it
(float32 responses, or the stored type as the device makes it), beside h5py alone writing the
same bytes, in one process, alternating, best of ``--repeats``: no device, so its noise stays
out. ``--compare OLD_WRITER.py`` loads another version of volconv/writer.py beside (e.g.
``git show REV:volconv/writer.py > /tmp/old_writer.py``), fed float32 as it was.

    python scripts/bench/run.py writer --out /dev/shm/vw --json benchmarks/results/writer.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import h5py
import numpy as np

from volconv.convert import encode
from volconv.output import ResponseWriter
from volconv.report import write_json
from volconv.resume import Progress

ATTRS = dict.fromkeys(("affine", "voxel_size", "source", "source_sha256", "pipeline", "device",
                       "gflop", "kernel_seconds", "wall_seconds", "gflops", "peak_gflops",
                       "fraction_of_peak", "engine"), 0)  # fmt: skip


def timed(call) -> float:
    os.sync()
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--rows", type=int, default=0, help="rows along x (default: --size)")
    p.add_argument("--stored-only", action="store_true",
                   help="only the stored type given, as the device makes it")  # fmt: skip
    p.add_argument("--progress", action="store_true",
                   help="also with resumable progress (volconv.resume: CRCs, a flush and a "
                        "record every slab)")  # fmt: skip
    p.add_argument("--filters", type=int, default=8)
    p.add_argument("--slab-depth", type=int, default=64)
    p.add_argument("--dtypes", default="float32,float16,uint8")
    p.add_argument("--compression", default="none")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compare", type=Path, default=None, help="another writer.py, beside")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    n, size, depth = args.filters, args.size, args.slab_depth
    rows = args.rows or size
    shape = (rows, size, size)
    rng = np.random.default_rng(0)
    slabs = [rng.standard_normal((n, depth, size, size), np.float32) * 100 for _ in range(3)]
    writers = {"volconv": ResponseWriter}
    if args.compare:
        spec = importlib.util.spec_from_file_location("volconv_old_writer", args.compare)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        writers["compared"] = old.ResponseWriter
    kernels = np.zeros((n, 1, 1, 1), np.float32)
    names = [f"f{i}" for i in range(n)]
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
              "cores": len(os.sched_getaffinity(0)), "out": str(args.out),
              "shape": [n, *shape], "slab_depth": depth,
              "compression": args.compression, "compare": str(args.compare or ""),
              "dtypes": {}}  # fmt: skip
    for dtype in args.dtypes.split(","):
        stored = []  # what the device hands over: the stored type
        for s in slabs:
            out = np.empty(s.shape, dtype)
            encode(s, out) if dtype != "float32" else out.__setitem__(..., s)
            stored.append(out)

        flushes: list[float] = []  # seconds each write with progress spent flushing

        def write(cls, given, dtype=dtype, progress=False, flushes=flushes) -> None:
            path = args.out / "w.h5"
            path.unlink(missing_ok=True)
            progress = Progress("bench", lambda: "0" * 64) if progress else None
            extra = {} if progress is None else {"progress": progress}
            with cls(path, shape, names, kernels, dtype=dtype, boundary="reflect", cval=0.0,
                     slab_depth=depth, compression=args.compression, **extra) as w:  # fmt: skip
                for i, a in enumerate(range(0, rows, depth)):
                    w.write_slab(a, min(a + depth, rows), given[i % 3][:, : min(depth, rows - a)])
                w.drain()
                w.finish(ATTRS)
            if progress is not None:
                flushes.append(progress.flush_seconds)

        def floor(dtype=dtype, stored=stored) -> None:
            path = args.out / "f.h5"
            with h5py.File(path, "w") as f:
                ds = f.create_dataset("r", (n, *shape), dtype, chunks=(1, depth, size, size))
                for i, a in enumerate(range(0, rows, depth)):
                    ds[:, a : a + depth] = stored[i % 3][:, : min(depth, rows - a)]
            path.unlink()

        cases = {"h5py alone": floor}
        for name, cls in writers.items():
            if not args.stored_only:
                cases[f"{name}, float32 given"] = lambda cls=cls: write(cls, slabs)
            if name == "volconv" and (dtype != "float32" or args.stored_only):
                cases[f"{name}, {dtype} given"] = lambda cls=cls, stored=stored: write(cls, stored)
        if args.progress:  # what resume adds: CRCs, a flush a slab and the log
            cases[f"volconv, {dtype} given, progress"] = lambda stored=stored: write(
                ResponseWriter, stored, progress=True)  # fmt: skip
        times = {k: [] for k in cases}
        for _ in range(args.repeats):
            for k, call in cases.items():
                times[k].append(timed(call))
        best = {k: min(v) for k, v in times.items()}
        result["dtypes"][dtype] = {"best": best, "all": times, "flush_seconds": flushes}
        if flushes:
            print(f"  progress: {-(-rows // depth)} flushes a write, in all "
                  + ", ".join(f"{t:.4f}" for t in flushes) + " s", flush=True)  # fmt: skip
        print(f"{dtype}: " + ", ".join(f"{k} {v:.3f} s ({v / best['h5py alone']:.2f}x)"
                                       for k, v in best.items()), flush=True)  # fmt: skip
    (args.out / "w.h5").unlink(missing_ok=True)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
