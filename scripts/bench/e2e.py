"""The whole path, stage by stage, against each stage's floor measured in the same run.

For one input and one pipeline, for each output dtype asked for:
  - the real run, as a user runs it (`python -m volconv run ... --report`): the process's wall
    time, the in-run wall time and the seconds per stage from the report, and its max RSS;
  - the read floor: the input read whole by nibabel (numpy for .npy), best of three;
  - the write floor: the same bytes (the output's shape, dtype, chunks and codec) written by
    h5py alone from memory, chunked as volconv chunks and contiguous, and uncompressed chunks
    each with write_direct_chunk (what volconv's writer does).
It prints each figure beside its floor and their ratio, and saves everything as JSON.

Runs and floors alternate ``--repeats`` times and the minima are compared, each after
``os.sync()``, so that the disk's writeback of one step never lands in the next (page cache
and shared disks vary a lot between minutes). ``--inputs K`` runs K copies of the input in
one run (inputs overlap: one read while another is on the device and a third written) against
K raw writes; its wall is the report's ``run_seconds``. ``--out`` on a tmpfs (/dev/shm) takes
the disk out and leaves the host's own work: how the path compares with h5py there.

    python scripts/bench/run.py e2e --input data/mni152_t1_256.nii --pipeline pipelines/demo.toml \\
        --dtypes float32,float16 --device nvidia --json benchmarks/results/h100-e2e.json

``--size N`` makes a synthetic N^3 uint8 NIfTI input instead (e.g. 1024 for the 16 GiB case).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import nibabel as nib
import numpy as np

from volconv.output import compression_options
from volconv.report import write_json


def read_floor(path: Path) -> float:
    """Seconds for nibabel (numpy for .npy) to read the whole input, best of three."""
    if path.suffix == ".npy":
        return best_of(3, lambda: np.load(path))
    return best_of(3, lambda: np.array(nib.load(path).dataobj))  # a copy: read, not mapped


def write_floor(
    like: Path, compression: str, folder: Path, kinds: str = "all", repeats: int = 2
) -> dict[str, float]:
    """Seconds for h5py alone to write the bytes of output ``like`` (its shape, dtype and
    chunks, the same codec) from memory, chunked and (``kinds`` "all") contiguous and by
    direct chunks, best of ``repeats`` each (after a sync)."""
    with h5py.File(like, "r") as f:
        ds = f["responses"]
        data = np.empty(ds.shape, ds.dtype)
        ds.read_direct(data)
        chunks = ds.chunks
    options = compression_options(compression)

    def write(**kw) -> None:
        target = folder / "floor.h5"
        with h5py.File(target, "w") as g:
            g.create_dataset("responses", data=data, **kw)
        target.unlink()

    def direct() -> None:  # each chunk with write_direct_chunk, from memory, as volconv does
        target = folder / "floor.h5"
        with h5py.File(target, "w") as g:
            ds = g.create_dataset("responses", data.shape, data.dtype, chunks=chunks)
            depth = chunks[1]
            for f in range(data.shape[0]):
                for x in range(0, data.shape[1], depth):
                    block = data[f, x : x + depth]
                    if block.shape[0] < depth:  # an edge chunk, stored whole
                        block = np.concatenate(
                            [block, np.zeros((depth - len(block), *block.shape[1:]), block.dtype)]
                        )
                    ds.id.write_direct_chunk((f, x, *(0,) * (data.ndim - 2)), block)
        target.unlink()

    floors = {"chunked": best_of(repeats, lambda: write(chunks=chunks, **options))}
    if not options and kinds == "all":
        floors["contiguous"] = best_of(repeats, lambda: write())
        if data.ndim == 4:
            floors["direct_chunks"] = best_of(repeats, direct)
    floors["bytes"] = data.nbytes
    return floors


def best_of(n: int, call) -> float:
    times = []
    for _ in range(n):
        os.sync()
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times)


def run_volconv(pipeline: Path, sets: list[str], device: str, report: Path,
                overwrite: bool = True) -> dict:  # fmt: skip
    """`volconv run` as a user runs it: process wall, its max RSS (GNU time) and the report
    (its first input's record; ``run_seconds``: the run's own wall over every input).
    ``overwrite`` False: as a user's first run into an empty folder, which records resumable
    progress (a CRC of every slab); ``--overwrite`` records none."""
    options = [a for s in sets for a in ("--set", s)]
    overwriting = ["--overwrite"] if overwrite else []
    command = [sys.executable, "-m", "volconv", "run", str(pipeline), "--device", device,
               "--report", str(report), *options, *overwriting]  # fmt: skip
    timed = Path("/usr/bin/time").exists()
    os.sync()
    t = time.perf_counter()
    done = subprocess.run((["/usr/bin/time", "-f", "%M"] if timed else []) + command,
                          capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"volconv run failed: {done.stderr.strip()}")
    rss = int(done.stderr.strip().splitlines()[-1]) * 1024 if timed else None
    doc = json.loads(report.read_text())
    entry = doc["inputs"][0]
    run_seconds = doc.get("run_seconds") or sum(e["stages"]["wall"] for e in doc["inputs"])
    return {"process_seconds": wall, "max_rss_bytes": rss, "report": entry,
            "inputs": len(doc["inputs"]), "run_seconds": run_seconds}  # fmt: skip


def summary(repeats: list[dict], inputs: int, result: dict, name: str) -> dict:
    """The best run of ``repeats`` (least in-run wall), the floors' minima and the ratios;
    printed."""
    best = min(repeats, key=lambda r: r["report"]["stages"]["wall"])
    floors = {k: min(r["write_floor_seconds"][k] for r in repeats)
              for k in repeats[0]["write_floor_seconds"]}  # fmt: skip
    stages = best["report"]["stages"]
    run = {**best, "write_floor_seconds": floors, "repeats": [
        {"process_seconds": r["process_seconds"], "run_seconds": r["run_seconds"],
         "stages": r["report"]["stages"], "write_floor_seconds": r["write_floor_seconds"]}
        for r in repeats]}  # fmt: skip
    run_seconds = min(r["run_seconds"] for r in repeats)
    run["ratios"] = {
        "in_run_wall_over_write_floor": stages["wall"] / floors["chunked"],
        "read_over_floor": stages["read"] / result["read_floor_seconds"],
        "process_minus_in_run_seconds": best["process_seconds"] - stages["wall"],
        "run_over_inputs_write_floors": run_seconds / (inputs * floors["chunked"]),
    }
    print(
        f"{name}: process {best['process_seconds']:.2f} s, in-run wall {stages['wall']:.3f}"
        f" s (read {stages['read']:.3f}, kernel {stages['kernel']:.4f}, convert "
        f"{stages.get('convert', 0.0):.4f}, download {stages['download']:.4f}, write "
        f"{stages['write']:.3f}); h5py write floor {floors['chunked']:.3f} s chunked"
        + (f", {floors['contiguous']:.3f} s contiguous" if "contiguous" in floors else "")
        + (f", {floors['direct_chunks']:.3f} s direct chunks" if "direct_chunks" in floors
           else "")
        + f"; wall/floor {run['ratios']['in_run_wall_over_write_floor']:.2f}, read/floor "
        f"{run['ratios']['read_over_floor']:.2f}, start "
        f"{run['ratios']['process_minus_in_run_seconds']:.2f} s, max RSS "
        f"{(best['max_rss_bytes'] or 0) / 2**30:.2f} GiB; walls "
        + ", ".join(f"{r['report']['stages']['wall']:.2f}" for r in repeats)
        + (f"; {inputs} inputs in {run_seconds:.3f} s, over {inputs} floors "
           f"{run['ratios']['run_over_inputs_write_floors']:.2f}" if inputs > 1 else ""),
        flush=True,
    )  # fmt: skip
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=Path, default=Path("data/mni152_t1_256.nii"))
    p.add_argument("--size", type=int, default=0, help="a synthetic N^3 uint8 NIfTI instead")
    p.add_argument("--pipeline", type=Path, default=Path("pipelines/demo.toml"))
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--compression", default="none")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=None, help="folder for the outputs (a tmp dir)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=3, help="runs and floors, alternating")
    p.add_argument("--inputs", type=int, default=1, help="copies of the input in one run")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="runs without --overwrite into an empty folder (resumable progress)",
    )
    p.add_argument(
        "--alternate",
        action="store_true",
        help="each repeat runs both ways, --overwrite and fresh, in turns (the floor between)",
    )
    p.add_argument(
        "--floors",
        choices=("all", "chunked"),
        default="all",
        help="chunked: only h5py's chunked write, once a repeat (for large outputs)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="sets",
        metavar="KEY=VALUE",
        help="passed to volconv run (e.g. run.slab_depth=19)",
    )
    args = p.parse_args()

    folder = args.out or Path(tempfile.mkdtemp(prefix="volconv-e2e-"))
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    source = args.input.resolve()
    if args.size:
        source = folder / f"synthetic{args.size}.nii"
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, (args.size,) * 3, dtype=np.uint8)
        nib.save(nib.Nifti1Image(data, np.eye(4)), source)
        del data
    sources = [source]
    for i in range(1, args.inputs):  # hard links: the same bytes, another stem
        copy = folder / f"copy{i}-{source.name}"
        copy.unlink(missing_ok=True)
        os.link(source, copy) if source.stat().st_dev == folder.stat().st_dev else (
            copy.write_bytes(source.read_bytes()))  # fmt: skip
        sources.append(copy)
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cores": len(os.sched_getaffinity(0)),
        "input": str(source),
        "input_bytes": source.stat().st_size,
        "pipeline": str(args.pipeline),
        "device": args.device,
        "compression": args.compression,
        "repeats": args.repeats,
        "inputs": args.inputs,
        "fresh": args.fresh,
        "alternate": args.alternate,
        "read_floor_seconds": read_floor(source),
        "runs": {},
    }
    print(f"read floor (nibabel, whole): {result['read_floor_seconds'] * 1e3:.1f} ms", flush=True)
    modes = ["overwrite", "fresh"] if args.alternate else ["fresh" if args.fresh else "overwrite"]
    floor_repeats = 1 if args.floors == "chunked" else 2
    for dtype in args.dtypes.split(","):
        out = folder / "out" / f"{{stem}}-{args.compression}.h5"
        paths = ", ".join(f'"{s}"' for s in sources)
        sets = [f"input.paths=[{paths}]", f"output.path={out}", f"output.dtype={dtype}",
                f"output.compression={args.compression}", *args.sets]  # fmt: skip
        first = Path(str(out).format(stem=source.name.split(".")[0]))
        repeats = {mode: [] for mode in modes}
        floors_seen = []
        for i in range(args.repeats):  # run, floor, run, ...: the same minutes for each
            for mode in modes[:: -1 if i % 2 else 1]:  # turns: neither always goes first
                run = run_volconv(args.pipeline, sets, args.device, folder / f"report-{dtype}.json",
                                  overwrite=mode == "overwrite")  # fmt: skip
                if len(floors_seen) <= i:  # once a repeat, from the first run's output
                    floors_seen.append(write_floor(first, args.compression, folder, args.floors,
                                                   floor_repeats))  # fmt: skip
                run["write_floor_seconds"] = floors_seen[i]
                repeats[mode].append(run)
                shutil.rmtree(folder / "out", ignore_errors=True)  # fresh runs find none
        for mode in modes:
            name = f"{dtype}/{mode}" if args.alternate else dtype
            result["runs"][name] = summary(repeats[mode], args.inputs, result, name)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
