"""Each output format's in-run wall beside its floor, in one call: the demo scan through
pipelines/demo.toml written as HDF5, NIfTI (.nii, .nii.gz) and OME-Zarr by `volconv run`
(the report's wall: reading, the device and writing, overlapped), and the same values written
by the format's own library alone: h5py (same chunks), nibabel (the same 4D image, gzip level
1 as nibabel's default and volconv's ``gzip``), zarr (same chunks and codec). JSON to
``$OUT/bench_formats.json`` (or ``--json``).

    python scripts/bench/run.py formats --work /tmp/vf --device nvidia [--compression none|zstd]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FORMATS = {"hdf5": ".h5", "nifti": ".nii", "nifti-gz": ".nii.gz", "zarr": ".zarr"}


def in_run(work: Path, suffix: str, compression: str, device: str, pipeline: Path,
           source: Path) -> tuple:  # fmt: skip
    """`volconv run` on the pipeline: the report's wall seconds of its one input, and its
    output."""
    report = work / f"report{suffix}.json"
    # the .nii.gz is compressed whatever the setting (its suffix); HDF5 and zarr take it
    comp = "gzip" if suffix == ".nii.gz" else ("none" if suffix == ".nii" else compression)
    args = [sys.executable, "-m", "volconv", "run", str(pipeline),
            "--set", f"output.path={work}/run/{{stem}}{suffix}", "--set",
            f"output.compression={comp}", "--overwrite", "--report", str(report),
            "--device", device, "--set", f'input.paths=["{source.resolve()}"]']  # fmt: skip
    subprocess.run(args, check=True, capture_output=True)
    (record,) = json.loads(report.read_text())["inputs"]
    return float(record["wall_seconds"]), Path(record["output"])


def floor(work: Path, fmt: str, data: np.ndarray, affine: np.ndarray, compression: str,
          slab_depth: int) -> float:  # fmt: skip
    """The format's own library writing ``data`` (N, x, y, z) as volconv lays it out."""
    target = work / "floor" / f"out{FORMATS[fmt]}"
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    os.sync()
    start = time.perf_counter()
    if fmt == "hdf5":
        from volconv.output import chunk_shape, compression_options

        with h5py.File(target, "w") as f:
            f.create_dataset("responses", data=data, chunks=chunk_shape(data.shape, slab_depth, 4),
                             **compression_options(compression))  # fmt: skip
    elif fmt.startswith("nifti"):
        import nibabel as nib

        nib.Nifti1Image(np.moveaxis(data, 0, -1), affine).to_filename(target)
    else:
        import zarr

        from volconv.output.omezarr import codec

        n, nx, ny, nz = data.shape
        arr = zarr.create_array(str(target), shape=(n, nz, ny, nx), dtype=data.dtype,
                                chunks=(1, nz, ny, min(slab_depth, nx)),
                                compressors=codec(compression), fill_value=0)  # fmt: skip
        arr[...] = data.transpose(0, 3, 2, 1)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/dev/shm/volconv-formats"))
    p.add_argument("--compression", default="none", help="HDF5 and zarr: none, gzip, zstd")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--pipeline", type=Path, default=ROOT / "pipelines" / "demo.toml")
    p.add_argument("--input", type=Path, default=ROOT / "data" / "mni152_t1_256.nii")
    p.add_argument("--json", type=Path,
                   default=Path(os.environ.get("OUT", ".")) / "bench_formats.json")  # fmt: skip
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"host": platform.node(), "cores": len(os.sched_getaffinity(0)),
                     "compression": args.compression, "formats": {}}  # fmt: skip
    outputs: dict[str, Path] = {}
    for fmt, suffix in FORMATS.items():
        runs = [in_run(args.work, suffix, args.compression, args.device, args.pipeline,
                       args.input)
                for _ in range(args.repeats)]  # fmt: skip
        results["formats"][fmt] = {"in_run_seconds": [w for w, _ in runs]}
        outputs[fmt] = runs[0][1]
    from volconv.output import read

    with read(outputs["hdf5"]) as stored:
        data = np.stack([np.asarray(o) for o in stored.outputs])
        affine = np.asarray(stored.attrs["affine"], np.float64)
    with h5py.File(outputs["hdf5"]) as f:
        depth = f["responses"].chunks[1]
    for fmt in FORMATS:
        comp = "gzip" if fmt == "nifti-gz" else args.compression
        floors = [floor(args.work, fmt, data, affine, comp, depth) for _ in range(args.repeats)]
        entry = results["formats"][fmt]
        entry["floor_seconds"] = floors
        entry["ratio"] = min(entry["in_run_seconds"]) / min(floors)
        print(f"{fmt:9} in-run {min(entry['in_run_seconds']):.3f} s  floor {min(floors):.3f} s"
              f"  ratio {entry['ratio']:.2f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
