"""Write the PTX the NVIDIA OpenCL driver returns for the tensor engine's kernel (for ptxas and
cuobjdump on the GPU node: SASS instruction counts of the engine as built).

    python3 scripts/tensor_ptx.py --device nvidia --extents 7,7,7 --n 8 --out k.ptx
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv.device import select_device
from volconv.programs import context_for, kernel_source
from volconv.tensor import (
    KERNEL_FILE,
    build_sm90a,
    default_shape,
    fit_split,
    tensor_defines,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="nvidia")
    ap.add_argument("--extents", default="7,7,7")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--dtype", default="uint8")
    ap.add_argument("--wgmma", type=int, default=0, help="the split on wgmma (1 or 2)")
    ap.add_argument("--xo", type=int, default=0, help="outputs along x per step (wgmma)")
    ap.add_argument("--tyw", type=int, default=0, help="output rows per warp")
    ap.add_argument("--persistent", type=int, default=0, help="work-groups per multiprocessor")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = select_device(args.device)
    extents = tuple(int(k) for k in args.extents.split(","))
    src = np.dtype(args.dtype)
    split = default_shape(args.n, extents[0])
    split = replace(split, wgmma=args.wgmma) if args.wgmma else split
    split = replace(split, xo=args.xo) if args.xo else split
    split = replace(split, tyw=args.tyw) if args.tyw else split
    split = replace(split, persistent=args.persistent) if args.persistent else split
    split = fit_split(extents, src, split, device.local_mem_size)
    defines = tensor_defines(extents, src, split)
    ctx, _ = context_for(device)
    if "WGMMA" in defines:  # the PTX retargeted to sm_90a (`build_sm90a`)
        prg = build_sm90a(ctx, KERNEL_FILE, tuple(defines.items()))
    else:
        options = [f"-D{k}={v}" for k, v in defines.items()]
        prg = cl.Program(ctx, kernel_source(KERNEL_FILE)).build(options=options)
    args.out.write_bytes(prg.get_info(cl.program_info.BINARIES)[0].rstrip(b"\0") + b"\n")
    print(split, defines)


if __name__ == "__main__":
    main()
