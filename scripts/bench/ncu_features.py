"""Launch a feature set's OpenCL kernel through the CUDA driver, for Nsight Compute (which does
not profile OpenCL), on the data volconv gave it: the set runs slab by slab up to the middle
slab through `SeparableConvolver`; the named kernel's last launch (its arguments, work sizes
and buffers as they were) is then replayed with cupy from the PTX volconv built, and its
outputs compared with OpenCL's. Prints the kernel's registers, spills and shared memory.

    ncu --clock-control none -k regex:last_yz --launch-skip 1 --launch-count 1 --set full \\
        python3 scripts/bench/run.py ncu_features --set hessian_s3 --kernel last_yz \\
        --ptx /tmp/k.ptx
    # kernels: last_yz, first_x (Hessian, gradient magnitude), st_x, st_yz (structure tensor)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cupy as cp
import numpy as np
import pyopencl as cl
from features import convolver_for, feature_sets, volume_of
from ncu import cuda_launchable

from volconv.device.devices import select_device
from volconv.engines import structure, xfirst


class Recorded:
    """A kernel whose arguments are kept as they are set (`replay` needs them)."""

    def __init__(self, kernel: cl.Kernel) -> None:
        self.kernel, self.args = kernel, ()

    def set_args(self, *args) -> None:
        self.args = args
        self.kernel.set_args(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", default="hessian_s3", help="scripts/bench/features.py's sets")
    ap.add_argument("--kernel", default="last_yz")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--ptx", type=Path, required=True, help="where the PTX is written")
    ap.add_argument("--json", type=Path, default=None, help="registers and times, appended")
    ap.add_argument("--shape", default="", help="'FLAT=0,VC=4': XFIRST_SHAPE's and ST_SHAPES' "
                    "GPU entries changed where they have the key")  # fmt: skip
    ap.add_argument("--dense", action="store_true", help="features.py's synthetic volume")
    ap.add_argument("--device", default="gpu")
    args = ap.parse_args()
    for item in filter(None, args.shape.split(",")):
        key, value = item.split("=")
        for table in (xfirst.XFIRST_SHAPE["gpu"], structure.ST_SHAPES["gpu"]):
            if key in table:
                table[key] = int(value)
    device = select_device(args.device)
    volume = volume_of(args.size, synthetic=args.dense)
    feats, mode = feature_sets()[args.set]
    conv = convolver_for(volume, feats, mode, device)
    holders = [conv._passes]  # the engines' objects that hold kernels (a dict or attributes)
    for stage, _ in conv._tensors:
        holders += [getattr(stage, "_st", None), getattr(getattr(stage, "grad", None),
                                                         "_passes", None)]  # fmt: skip
    recorded = None
    for h in filter(None, holders):
        for attr, table in list(vars(h).items()):
            if isinstance(table, dict) and isinstance(table.get(args.kernel), cl.Kernel):
                recorded = table[args.kernel] = Recorded(table[args.kernel])
            elif isinstance(table, cl.Kernel) and table.function_name == args.kernel:
                recorded = Recorded(table)
                setattr(h, attr, recorded)
    if recorded is None:
        raise SystemExit(f"no kernel {args.kernel} in the set {args.set}'s engines")
    launches = []
    enqueue = cl.enqueue_nd_range_kernel

    def record(queue, kernel, glob, local, *rest, **kw):
        if isinstance(kernel, Recorded):
            launches.append((kernel.args, glob, local))
            kernel = kernel.kernel
        return enqueue(queue, kernel, glob, local, *rest, **kw)

    cl.enqueue_nd_range_kernel = record
    slabs = list(conv.slabs())
    out = np.empty((conv.plan.n_outputs, *volume.shape), np.float32)
    for a, b in slabs[: len(slabs) // 2 + 1]:
        conv.convolve_slab(a, b, out=out[:, a:b], frame=volume)
    conv.queue.finish()
    cl.enqueue_nd_range_kernel = enqueue
    cl_args, glob, local = launches[-1]
    program = recorded.kernel.get_info(cl.kernel_info.PROGRAM)
    text = program.get_info(cl.program_info.BINARIES)[0].rstrip(b"\0").decode()
    args.ptx.write_text(cuda_launchable(text) + "\n")
    host = {}
    params = []
    for i, a in enumerate(cl_args):
        if isinstance(a, cl.Buffer):
            host[i] = np.empty(a.size // 4, np.float32)  # bytes; compared as float32 words
            cl.enqueue_copy(conv.queue, host[i], a)
            params.append(cp.asarray(host[i]))
        else:
            params.append(a)
    conv.queue.finish()
    function = cp.RawModule(path=str(args.ptx)).get_function(args.kernel)
    keys = ("num_regs", "local_size_bytes", "shared_size_bytes", "max_threads_per_block")
    attributes = {k: function.attributes[k] for k in keys}
    local = tuple(local) if local is not None else (1, 1, 1)
    grid = tuple(-(-g // w) for g, w in zip(glob, local, strict=True))
    print(args.set, args.kernel, "grid", grid, "block", local, attributes, flush=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(args.launches):
        start.record()
        function(grid, local, tuple(params))
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    print("ms (CUDA events):", " ".join(f"{t:.3f}" for t in times), flush=True)
    worst = 0.0
    for i in host:  # the outputs as OpenCL left them (its last launch's, the same inputs)
        got = params[i].get()
        same = np.isclose(got, host[i], rtol=0, atol=0, equal_nan=True)
        worst = max(worst, float(1 - same.mean()))
    print(f"words differing from OpenCL's: {worst:.2e}", flush=True)
    if args.json:
        record_ = {"set": args.set, "kernel": args.kernel, "shape": args.shape,
                   "dense": args.dense, "grid": grid, "block": local,
                   **attributes, "ms": times, "differing": worst}  # fmt: skip
        with args.json.open("a") as f:
            f.write(json.dumps(record_) + "\n")


if __name__ == "__main__":
    main()
