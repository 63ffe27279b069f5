"""Batch throughput as the user times it: N inputs through a pipeline on every device
(``--devices``) against one device, each a whole command timed from outside (process start,
worker start and all), beside the floor the disk sets: raw h5py writer processes writing the
same bytes at once into the same folder (one, one per device, two per device).

    python scripts/bench/run.py batch --out /tmp/vb --devices all --inputs 48,8,2 \\
        --json $OUT/batch.json
    python scripts/bench/run.py batch --out /tmp/vb --size 64 --inputs 4,2 --devices cpu,cpu  # CPU

Inputs are ``--size``^3 uint8 NIfTI files (smoothed noise, one seed each) made once in
``--out``; each count runs on the first N of them (hard links in a folder of their own).
Each run writes its outputs there (put it on the node's local disk) and they are deleted
before the next. A first untimed run builds the programs (so no timed run compiles). For
every count and output type of ``--dtypes`` it records inputs per minute of the whole command
and of the run itself (the batch's first task to its last record; one device's run), the
process's start (command - run), the workers' start and ready time and whether the batch ran
in the client's process (the small-batch rule), how many processes filtered, the ratios
all/one, and the floors. For the counts of ``--one-process`` it also runs ``--devices`` with
one process per device (``VOLCONV_PROCESSES_PER_DEVICE=1``: against the default rule's
count). ``worker_ready`` is a local worker's start to ready (context, programs, first pinned
buffer), measured alone, each device's worker at once, ``--ready-repeats`` times. With
``--repeats R`` each count's one-device and ``--devices`` commands run R times in turns, and
the ratios are of their medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("read", "upload", "pad", "kernel", "convert", "download", "write", "wall")


def make_inputs(folder: Path, n: int, size: int) -> list[Path]:
    """``n`` uint8 volumes of ``size``^3: noise smoothed to look like tissue, one seed each."""
    import nibabel as nib
    from scipy.ndimage import gaussian_filter

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"scan{i:03d}.nii"
        if not path.exists():
            noise = np.random.default_rng(i).standard_normal((size,) * 3).astype(np.float32)
            v = gaussian_filter(noise, 2.0)
            v = np.clip((v - v.min()) / (np.ptp(v) or 1) * 255, 0, 255).astype(np.uint8)
            nib.save(nib.Nifti1Image(v, np.eye(4)), path)
        paths.append(path)
    return paths


def run_volconv(pipeline: Path, inputs: Path, out: Path, dtype: str, device_args: list[str],
                report: Path, env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """One ``volconv run``: the command's wall seconds and its ``--report``."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "volconv", "run", str(pipeline), *device_args, "--overwrite",
        "--set", f'input.paths=["{inputs}/*.nii"]', "--set", f"output.path={out}/{{stem}}.h5",
        "--set", f'output.dtype="{dtype}"', "--report", str(report),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    os.sync()  # the writeback of what ran before stays out of this run
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"volconv failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr}")
    doc = json.loads(report.read_text())
    shutil.rmtree(out, ignore_errors=True)
    done_inputs = [r for r in doc["inputs"] if r["status"] == "done"]
    n = len(done_inputs)
    # the run's own wall: the batch's, or one device's (inputs overlap there: their walls
    # overlap, so their sum would count the overlap twice)
    run_seconds = (doc.get("batch_seconds") or doc.get("run_seconds")
                   or sum(r["stages"]["wall"] for r in done_inputs))  # fmt: skip
    per_input = {s: sum(r["stages"][s] for r in done_inputs) / n for s in STAGES}
    # the batch's own start (workers, or the client's plan where it ran in its process)
    start = doc.get("batch_start_seconds") or 0.0
    return {
        "command": cmd, "inputs": n, "command_seconds": seconds, "run_seconds": run_seconds,
        # what the command spent outside its run: process start, imports, planning, workers
        "process_start_seconds": seconds - run_seconds,
        "worker_start_seconds": start, "worker_ready_seconds": doc.get("worker_ready_seconds"),
        "in_process": doc.get("in_process"),
        "inputs_per_minute_command": 60 * n / seconds,
        "inputs_per_minute_run": 60 * n / run_seconds,
        "device": doc.get("device"), "workers": doc.get("workers"), "env": env or {},
        "processes": len(doc.get("workers") or []) or None,
        "last_line": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "",
        "seconds_per_input": per_input, "n_filters": done_inputs[0]["n_filters"],
        "shape": done_inputs[0]["shape"],
    }  # fmt: skip


def _write_files(args: tuple[Path, list[str], tuple[int, ...], str]) -> float:
    """One raw writer: each file one dataset of ``shape``, written whole; seconds."""
    import h5py

    folder, names, shape, dtype = args
    data = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    t0 = time.perf_counter()
    for name in names:
        with h5py.File(folder / name, "w") as f:
            f.create_dataset("responses", data=data)
    return time.perf_counter() - t0


def writer_floor(folder: Path, n: int, writers: int, shape: tuple[int, ...], dtype: str) -> dict:
    """``writers`` processes writing ``n`` files of ``shape`` at once: the disk's rate."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = [f"raw{i:03d}.h5" for i in range(n)]
    shares = [(folder, names[w::writers], shape, dtype) for w in range(writers)]
    with mp.get_context("spawn").Pool(writers) as pool:
        pool.map(_write_files, [(folder, [], shape, dtype)] * writers)  # start the processes
        os.sync()
        t0 = time.perf_counter()
        each = pool.map(_write_files, shares)
        seconds = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    nbytes = n * int(np.prod(shape)) * np.dtype(dtype).itemsize
    return {
        "writers": writers, "files": n, "bytes": nbytes, "seconds": seconds,
        "writer_seconds": each, "gb_per_s": nbytes / seconds / 1e9,
        "inputs_per_minute": 60 * n / seconds,
    }  # fmt: skip


def _ready_once(cfg: object, spec: str, specs: tuple[str, ...]) -> list[float | None]:
    """One start of a worker per spec; each one's seconds to its ready message."""
    import threading

    from volconv.run.pool import Pending, Pool

    t0 = time.time()
    pool = Pool(specs, (cfg, spec))
    all_ready, lock, seen = threading.Event(), threading.Lock(), []

    def on_ready(worker: object) -> None:
        with lock:
            seen.append(worker)
            if len(seen) == len(pool.workers):
                all_ready.set()

    pool.feed(cfg, Pending([]), True, "bench", lambda job, r: None, None, on_ready)
    all_ready.wait(120)
    pool.close()
    return [w.ready_at - t0 if w.ready_at else None for w in pool.workers]


def worker_ready(pipeline: Path, spec: str, specs: tuple[str, ...], dtype: str,
                 repeats: int) -> dict:  # fmt: skip
    """Seconds from starting one local worker per spec (volconv.run.pool) to each one's
    ready message (its warm-up for ``spec`` done), ``repeats`` times."""
    from volconv.config import load

    cfg = load(pipeline, [f'output.dtype="{dtype}"'])
    runs = []
    for _ in range(repeats):
        runs.append(_ready_once(cfg, spec, specs))
        time.sleep(1.0)  # the workers gone before the next start
    return {
        "specs": list(specs),
        "seconds": runs,
        "max_seconds": [max((x for x in r if x is not None), default=None) for r in runs],
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median command seconds (the lower middle of an even count)."""
    return sorted(runs, key=lambda r: r["command_seconds"])[(len(runs) - 1) // 2]


def subset(inputs: list[Path], n: int, folder: Path) -> Path:
    """A folder holding the first ``n`` inputs (hard links)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in inputs[:n]:
        os.link(path, folder / path.name)
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="work folder (the local disk)")
    p.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "demo.toml")
    p.add_argument("--inputs", default="48,8,2", help="input counts, one batch each")
    p.add_argument("--size", type=int, default=256, help="edge of the cubic uint8 inputs")
    p.add_argument("--devices", default="all", help="as volconv run --devices takes it")
    p.add_argument(
        "--one-device",
        default=None,
        help="the one-device run's --device (default: the first of --devices)",
    )
    p.add_argument("--dtypes", default="float32,float16", help="output types, one run each")
    p.add_argument(
        "--one-process",
        default="48",
        help="counts also run with one process per device (comma-separated; none: '')",
    )
    p.add_argument("--ready-repeats", type=int, default=3, help="worker ready measurements")
    p.add_argument("--repeats", type=int, default=1, help="runs of each command, in turns")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()

    from volconv.config import load
    from volconv.device.devices import list_devices
    from volconv.run.batch import local_devices

    specs = local_devices(load(args.pipeline, devices=args.devices))
    one = args.one_device or (specs[0] if args.devices != "all" else "auto")
    counts = [int(n) for n in args.inputs.split(",")]
    inputs = make_inputs(args.out / "inputs", max(counts), args.size)
    for path in inputs:  # the inputs in the page cache for every run alike
        path.read_bytes()
    result: dict = {
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "opencl_devices": [f"{d.spec} {d.name} ({d.platform})" for d in list_devices()],
        "pipeline": str(args.pipeline), "inputs": counts, "size": args.size,
        "devices": args.devices, "worker_devices": list(specs), "one_device": one,
        "out": str(args.out), "runs": {},
    }  # fmt: skip
    report = args.out / "report.json"
    # untimed: every program built (and cached) for each output type, on one device
    for dtype in args.dtypes.split(","):
        run_volconv(args.pipeline, subset(inputs, 1, args.out / "in-1"), args.out / "warm",
                    dtype, ["--device", one], report)  # fmt: skip
    if args.ready_repeats:
        result["worker_ready"] = worker_ready(
            args.pipeline, str(inputs[0]), specs, args.dtypes.split(",")[0], args.ready_repeats
        )
        print(f"worker ready (s, each worker): {result['worker_ready']['seconds']}", flush=True)
    one_process = {int(n) for n in args.one_process.split(",") if n.strip()}
    for n in counts:
        folder = subset(inputs, n, args.out / f"in-{n}")
        for dtype in args.dtypes.split(","):
            turns: dict[str, list[dict]] = {"one": [], "all": []}
            for _ in range(max(1, args.repeats)):  # in turns: the machine's drift shared
                turns["one"].append(run_volconv(args.pipeline, folder, args.out / "one", dtype,
                                                ["--device", one], report))  # fmt: skip
                turns["all"].append(run_volconv(args.pipeline, folder, args.out / "all", dtype,
                                                ["--devices", args.devices], report))  # fmt: skip
            runs = {name: median_run(r) for name, r in turns.items()}
            if n in one_process:
                runs["all_one_process"] = run_volconv(
                    args.pipeline, folder, args.out / "all", dtype, ["--devices", args.devices],
                    report, {"VOLCONV_PROCESSES_PER_DEVICE": "1"},
                )  # fmt: skip
            shape = (runs["one"]["n_filters"], *runs["one"]["shape"])
            floor = writer_floor(args.out / "raw", n, len(specs), shape, dtype)
            floor_one = writer_floor(args.out / "raw", n, 1, shape, dtype)
            floor_two = writer_floor(args.out / "raw", n, 2 * len(specs), shape, dtype)
            entry = {
                **runs, "floor": floor,
                "floor_one_writer": floor_one,
                "repeats": {k: [r["command_seconds"] for r in v] for k, v in turns.items()},
                "floor_two_per_device": floor_two,
                "one_over_one_writer": runs["one"]["inputs_per_minute_run"]
                / floor_one["inputs_per_minute"],
                "ratio_command": runs["all"]["inputs_per_minute_command"]
                / runs["one"]["inputs_per_minute_command"],
                "ratio_run": runs["all"]["inputs_per_minute_run"]
                / runs["one"]["inputs_per_minute_run"],
                "all_command_over_floor": runs["all"]["inputs_per_minute_command"]
                / floor["inputs_per_minute"],
                "all_command_over_best_floor": runs["all"]["inputs_per_minute_command"]
                / max(floor["inputs_per_minute"], floor_two["inputs_per_minute"]),
            }  # fmt: skip
            if "all_one_process" in runs:
                entry["ratio_command_one_process"] = (
                    runs["all_one_process"]["inputs_per_minute_command"]
                    / runs["one"]["inputs_per_minute_command"]
                )
            result["runs"][f"{n}-{dtype}"] = entry
            print(f"\n{dtype}: {n} inputs of {args.size}^3 uint8, {len(specs)} devices "
                  f"({args.devices}) vs one device ({one})")  # fmt: skip
            for name, r in runs.items():
                ready = r["worker_ready_seconds"]
                ready = "?" if ready is None else f"{ready:.2f}"
                how = ("in the client's process" if r["in_process"] else
                       f"{r['processes']} processes, first worker ready "
                       f"{r['worker_start_seconds']:.2f} s, last {ready} s"
                       ) if name != "one" else ""  # fmt: skip
                print(f"  {name:<15} {r['inputs_per_minute_command']:7.1f} inputs/min (command, "
                      f"{r['command_seconds']:.2f} s)  {r['inputs_per_minute_run']:7.1f} (run, "
                      f"{r['run_seconds']:.2f} s)  process start "
                      f"{r['process_start_seconds']:.2f} s  {how}")  # fmt: skip
            print(f"  ratio all/one: {entry['ratio_command']:.2f}x (command), "
                  f"{entry['ratio_run']:.2f}x (run)")  # fmt: skip
            print(f"  floor: {floor['writers']} raw h5py writers, {floor['gb_per_s']:.2f} GB/s, "
                  f"{floor['inputs_per_minute']:.1f} inputs/min; all (command)/floor "
                  f"{entry['all_command_over_floor']:.2f}; one raw writer "
                  f"{floor_one['gb_per_s']:.2f} GB/s; {floor_two['writers']} raw writers "
                  f"{floor_two['gb_per_s']:.2f} GB/s")  # fmt: skip
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=1) + "\n")  # after every run
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
