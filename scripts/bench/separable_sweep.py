"""Sweep the separable path's shapes on one device: a 256^3 uint8 volume, kernel seconds (best
of 3, OpenCL profiling counters), the bank forced separable.

``--tree``: the pass tree's vector width and rows per work-item, ilastik and demo banks.
``--fused``: the fused kernel's tile (TY, TZ) and rows per work-group CX on the demo bank,
beside the pass tree on the same bank, the boundary extension (pad) and two floors measured in
the same run: writing the demo's 8 float32 responses (a buffer fill) and a device copy.

    python scripts/bench/run.py separable_sweep --device nvidia --fused --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import tomllib
from pathlib import Path

import numpy as np
import pyopencl as cl
from separable import derivative_specs

from volconv.bank.filters import build_bank
from volconv.device.devices import select_device
from volconv.device.programs import context_for, device_seconds
from volconv.engines.separable import SeparableConvolver
from volconv.plan import separable
from volconv.plan.separable import plan_bank

ROOT = Path(__file__).resolve().parents[2]
TILES = [(4, 16), (8, 8), (2, 32), (4, 32), (8, 16), (16, 16), (2, 64), (8, 32)]
ROWS = [16, 32, 64]


def bank(name: str) -> list:
    data = tomllib.loads((ROOT / "pipelines" / f"{name}.toml").read_text())
    return build_bank(data["bank"]["filter"], data["bank"].get("size", 7))


def kernel_seconds(conv: SeparableConvolver, vol: np.ndarray, repeats: int = 3) -> float:
    """Best kernel seconds of the whole volume (slab by slab); the first run compiles."""
    seconds = 0.0
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, vol[conv.source_rows(a, b)])
        seconds += float(np.min(conv.time_kernel(a, b, repeats)))
    return seconds


def pad_seconds(conv: SeparableConvolver, vol: np.ndarray) -> float:
    before = conv.timings["pad"]
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, vol[conv.source_rows(a, b)])
    return conv.timings["pad"] - before


def floors(device, nbytes: int) -> dict:
    """Device seconds to fill ``nbytes`` (a write floor) and to copy them (read + write)."""
    ctx, queue = context_for(device)
    src = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
    dst = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
    fills = [cl.enqueue_fill_buffer(queue, src, np.float32(1), 0, nbytes) for _ in range(3)]
    cl.wait_for_events(fills)
    copies = [cl.enqueue_copy(queue, dst, src) for _ in range(3)]
    cl.wait_for_events(copies)
    best = {name: min(device_seconds([e]) for e in events)
            for name, events in (("fill_s", fills), ("copy_s", copies))}  # fmt: skip
    return {"bytes": nbytes, **best}


def sweep_tree(device, vol, result: list) -> None:
    for name in ("ilastik_features", "demo"):
        filters = bank(name)
        choices = plan_bank(filters, force="separable")
        for v, u in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
            conv = SeparableConvolver(filters, vol.shape, vol.dtype, device=device,
                                      choices=choices, vector_width=v, rows=u,
                                      fused=False)  # fmt: skip
            seconds = kernel_seconds(conv, vol)
            result.append({"bank": name, "vector_width": v, "rows": u, "kernel_s": seconds})
            print(f"{name} V={v} U={u}: {seconds * 1e3:.3f} ms", flush=True)


def sweep_fused(device, vol, result: list, ptx: Path | None) -> None:
    filters = bank("demo")
    choices = plan_bank(filters, force="separable")
    tree = SeparableConvolver(filters, vol.shape, vol.dtype, device=device, choices=choices,
                              fused=False)  # fmt: skip
    seconds = kernel_seconds(tree, vol)
    result.append({"bank": "demo", "engine": "tree", "kernel_s": seconds})
    print(f"demo tree: {seconds * 1e3:.3f} ms", flush=True)
    for (ty, tz), cx in itertools.product(TILES, ROWS):
        try:
            conv = SeparableConvolver(filters, vol.shape, vol.dtype, device=device,
                                      choices=choices, fused=True, tile=(ty, tz, cx))  # fmt: skip
            seconds = kernel_seconds(conv, vol)
        except (cl.Error, ValueError) as e:
            print(f"demo fused {ty}x{tz} CX={cx}: {type(e).__name__}: {e}", flush=True)
            continue
        if ptx and not ptx.exists():  # the first build's binary (PTX on NVIDIA), to read
            program = conv._fused.get_info(cl.kernel_info.PROGRAM)
            ptx.write_bytes(program.get_info(cl.program_info.BINARIES)[0])
        private = conv._fused.get_work_group_info(cl.kernel_work_group_info.PRIVATE_MEM_SIZE,
                                                  device)  # fmt: skip
        result.append({"bank": "demo", "engine": "fused", "tile": [ty, tz, cx],
                       "kernel_s": seconds, "private_bytes": private,
                       "pad_s": pad_seconds(conv, vol),
                       "gbps": conv.kernel_bytes / seconds / 1e9})  # fmt: skip
        print(f"demo fused {ty}x{tz} CX={cx}: {seconds * 1e3:.3f} ms (private {private} B)",
              flush=True)  # fmt: skip
    result.append({"floors": floors(device, 8 * vol.size * 4)})
    print(result[-1], flush=True)
    # banks at or past MAX_FUSED_VALUES, fused anyway (the limit lifted) beside their tree
    separable.MAX_FUSED_VALUES = 1 << 30
    for sigma, size in ((1.0, 7), (1.6, 11), (1.0, 11)):
        filters = build_bank(derivative_specs(sigma, size))
        choices = plan_bank(filters, force="separable")
        for fused in (False, True):
            conv = SeparableConvolver(filters, vol.shape, vol.dtype, device=device,
                                      choices=choices, fused=fused)  # fmt: skip
            seconds = kernel_seconds(conv, vol)
            private = (
                conv._fused.get_work_group_info(cl.kernel_work_group_info.PRIVATE_MEM_SIZE, device)
                if fused
                else None
            )
            name = f"derivatives s{sigma} {size}^3"
            result.append({"bank": name, "engine": "fused" if fused else "tree",
                           "sums": len(filters) * size, "kernel_s": seconds,
                           "private_bytes": private})  # fmt: skip
            print(f"{name} {result[-1]['engine']} ({len(filters) * size} sums): "
                  f"{seconds * 1e3:.3f} ms (private {private} B)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--tree", action="store_true", help="sweep the pass tree")
    p.add_argument("--fused", action="store_true", help="sweep the fused kernel")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--ptx", type=Path, default=None, help="write the fused kernel's binary")
    args = p.parse_args()
    device = select_device(args.device)
    vol = np.random.default_rng(0).integers(0, 256, (args.size,) * 3).astype(np.uint8)
    result: list = []
    if args.tree or not args.fused:
        sweep_tree(device, vol, result)
    if args.fused:
        sweep_fused(device, vol, result, args.ptx)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
