"""Launch the tensor engine's kernel through the CUDA driver, for Nsight Compute (which does not
profile OpenCL): the PTX volconv builds for a split (as `build_sm90a` gives the driver) is
loaded with cupy, launched as `TensorConvolver` launches it on a padded 256^3 uint8 slab of
random bytes and random filters, and checked at random voxels against float64 (a valid
correlation of the padded slab with the flipped filters).

    ncu --section SpeedOfLight -k regex:tensor_int8 -c 1 \
        python3 scripts/profile_tensor.py --n 8 --ptx /tmp/k.ptx
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import cupy as cp
import numpy as np
import pyopencl as cl
from bench_tensor import with_fields  # scripts/ (this script's folder)

from volconv.device import select_device
from volconv.programs import context_for
from volconv.tensor import (
    KERNEL_FILE,
    KERNEL_NAME,
    build_sm90a,
    default_shape,
    digit_exponents,
    fit_split,
    int8_fragments,
    tensor_defines,
)

# NVIDIA's OpenCL reads the group offset and the number of groups from environment registers
# that a CUDA launch leaves unset: here they are the CUDA launch's (no offset).
ENVREG = {"0": "0", "1": "0", "2": "0", "3": "0", "4": "0", "5": "0",
          "6": "%nctaid.x", "7": "%nctaid.y", "8": "%nctaid.z"}  # fmt: skip


def cuda_launchable(ptx: str) -> str:
    """``ptx`` with its reads of %envreg0..8 replaced by what a CUDA launch means by them."""
    for line in sorted(set(re.findall(r"^.*%envreg\d+.*$", ptx, flags=re.M))):
        print("PTX:", line.strip())
    return re.sub(r"%envreg(\d+)", lambda m: ENVREG[m[1]], ptx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--extent", type=int, default=7)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--split", default="", help="TensorShape fields, e.g. 'xo=2,tyw=3'")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--ptx", type=Path, required=True, help="where the PTX is written")
    args = ap.parse_args()
    k, n, size = args.extent, args.n, args.size
    split = with_fields(default_shape(n, k), args.split)
    device = select_device("nvidia")
    extents = (k, k, k)
    split = fit_split(extents, np.dtype(np.uint8), split, device.local_mem_size)
    defines = tensor_defines(extents, np.dtype(np.uint8), split)
    ctx, _ = context_for(device)
    prg = build_sm90a(ctx, KERNEL_FILE, tuple(defines.items()))
    text = prg.get_info(cl.program_info.BINARIES)[0].rstrip(b"\0").decode()
    args.ptx.write_text(cuda_launchable(text) + "\n")
    print(split, defines, flush=True)

    rng = np.random.default_rng(0)
    vol = rng.integers(0, 256, (size,) * 3, dtype=np.uint8)
    bank = rng.standard_normal((n, k, k, k))
    padded = np.pad(vol, k // 2, mode="symmetric")  # scipy's 'reflect' (odd extents)
    flipped = bank[:, ::-1, ::-1, ::-1]
    frags = int8_fragments(flipped, defines)
    unscale = np.ldexp(1.0, -digit_exponents(flipped)).astype(np.float32)
    p1, p2 = padded.shape[1:]
    d_in, d_frags, d_unscale = cp.asarray(padded), cp.asarray(frags), cp.asarray(unscale)
    out = cp.full((n, size, size, size), cp.nan, cp.float32)
    kernel = cp.RawModule(path=str(args.ptx)).get_function(KERNEL_NAME)
    groups = split.persistent * device.max_compute_units
    params = (d_in, out, d_frags, d_unscale, np.int32(size), np.int32(size), np.int32(size),
              np.int32(p1), np.int32(p2), np.int64(size**3), np.int32(0), np.int32(n))  # fmt: skip
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(args.launches):
        start.record()
        kernel((groups, 1, 1), (split.threads, 1, 1), params)
        end.record()
        end.synchronize()
        print(f"{cp.cuda.get_elapsed_time(start, end):.3f} ms (CUDA events)", flush=True)
    got = out.get()
    assert np.isfinite(got).all(), "responses left unwritten"
    points = rng.integers(0, size, (200, 3))
    worst = 0.0
    for x, y, z in points:  # a valid correlation of the padded slab with the flipped filters
        window = padded[x : x + k, y : y + k, z : z + k].astype(np.float64)
        ref = (flipped * window).sum(axis=(1, 2, 3))
        err = np.abs(got[:, x, y, z] - ref) / (np.abs(bank).sum(axis=(1, 2, 3)) * 255)
        worst = max(worst, float(err.max()))
    print(f"max |err| / (sum|w| x 255) = {worst:.2e}", flush=True)
    assert worst < 1e-5, "wrong responses"


if __name__ == "__main__":
    main()
