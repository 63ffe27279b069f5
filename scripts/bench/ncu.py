"""Launch one of volconv's direct kernels through the CUDA driver, for Nsight Compute (which
does not profile OpenCL): the program volconv builds for a bank (its PTX, as the OpenCL driver
returns it) is loaded with cupy and launched as the engine launches it, on a padded 256^3
uint8 slab of random bytes and random normal filters, and checked at random voxels against
float64 (a valid correlation of the padded slab with the flipped filters).

    ncu --section SpeedOfLight -k regex:tensor_int8 -c 1 \
        python3 scripts/bench/run.py ncu --engine tensor --n 8 --ptx /tmp/k.ptx
    python3 scripts/bench/run.py ncu --engine fp32 --n 8 --ptx /tmp/k.ptx   # bank_conv
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import cupy as cp
import numpy as np
import pyopencl as cl
from tensor import with_fields  # scripts/bench/ (this script's folder)

from volconv.device.devices import select_device
from volconv.engines.direct import BankConvolver
from volconv.engines.tensor import TensorConvolver, default_shape, digit_exponents, int8_fragments

# NVIDIA's OpenCL reads the group offset, the global offset and the number of groups from
# environment registers that a CUDA launch leaves unset: here they are the CUDA launch's.
ENVREG = {"0": "0", "1": "0", "2": "0", "3": "0", "4": "0", "5": "0",
          "6": "%nctaid.x", "7": "%nctaid.y", "8": "%nctaid.z"}  # fmt: skip


def cuda_launchable(ptx: str) -> str:
    """``ptx`` with its reads of %envreg0..8 replaced by what a CUDA launch means by them."""
    for line in sorted(set(re.findall(r"^.*%envreg\d+.*$", ptx, flags=re.M))):
        print("PTX:", line.strip())
    return re.sub(r"%envreg(\d+)", lambda m: ENVREG[m[1]], ptx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("tensor", "fp32"), default="tensor")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--extent", type=int, default=7)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--split", default="", help="tensor: TensorShape fields, 'xo=2,tyw=3'")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--ptx", type=Path, required=True, help="where the PTX is written")
    args = ap.parse_args()
    k, n, size = args.extent, args.n, args.size
    device = select_device("nvidia")
    rng = np.random.default_rng(0)
    vol = rng.integers(0, 256, (size,) * 3, dtype=np.uint8)
    bank = rng.standard_normal((n, k, k, k))
    flipped = bank[:, ::-1, ::-1, ::-1]
    if args.engine == "tensor":
        split = with_fields(default_shape(n, k), args.split)
        conv = TensorConvolver(bank, vol.shape, np.uint8, device=device, shape_split=split)
        program, name = conv.program, "tensor_int8"
        coeffs = int8_fragments(flipped, conv.defines)
        unscale = np.ldexp(1.0, -digit_exponents(flipped)).astype(np.float32)
        extra = (cp.asarray(coeffs), cp.asarray(unscale))
        local = (conv.split.threads, 1, 1)
        grid = (conv.split.persistent * device.max_compute_units, 1, 1)
    else:
        conv = BankConvolver(bank, vol.shape, np.uint8, device=device, engine="fp32")
        p, knl, _ = conv._passes[0]
        program, name = knl.get_info(cl.kernel_info.PROGRAM), "bank_conv"
        coeffs = np.zeros((k**3, p.width), np.float32)
        coeffs[:, : p.count] = flipped[p.first : p.first + p.count].reshape(p.count, -1).T
        extra = (cp.asarray(coeffs),)
        block = conv.plan.block(p)
        local = block.local_size
        grid = (-(-size // block.unroll // local[0]), -(-size // block.rows // local[1]), size)
    print(conv.plan.block(), getattr(conv, "split", None), flush=True)
    text = program.get_info(cl.program_info.BINARIES)[0].rstrip(b"\0").decode()
    args.ptx.write_text(cuda_launchable(text) + "\n")
    p1, p2 = conv.plan.padded_yz
    padded = np.zeros((size + k - 1, p1, p2), np.uint8)  # scipy's 'reflect' (odd extents)
    padded[:, :, : size + k - 1] = np.pad(vol, k // 2, mode="symmetric")
    out = cp.full((n, size, size, size), cp.nan, cp.float32)
    kernel = cp.RawModule(path=str(args.ptx)).get_function(name)
    params = (cp.asarray(padded), out, *extra, np.int32(size), np.int32(size), np.int32(size),
              np.int32(p1), np.int32(p2), np.int64(size**3), np.int32(0), np.int32(n))  # fmt: skip
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(args.launches):
        start.record()
        kernel(grid, local, params)
        end.record()
        end.synchronize()
        print(f"{cp.cuda.get_elapsed_time(start, end):.3f} ms (CUDA events)", flush=True)
    got = out.get()
    assert np.isfinite(got).all(), "responses left unwritten"
    worst = 0.0
    for x, y, z in rng.integers(0, size, (200, 3)):
        window = padded[x : x + k, y : y + k, z : z + k].astype(np.float64)
        ref = (flipped * window).sum(axis=(1, 2, 3))
        err = np.abs(got[:, x, y, z] - ref) / (np.abs(bank).sum(axis=(1, 2, 3)) * 255)
        worst = max(worst, float(err.max()))
    print(f"max |err| / (sum|w| x 255) = {worst:.2e}", flush=True)
    assert worst < 1e-5, "wrong responses"


if __name__ == "__main__":
    main()
