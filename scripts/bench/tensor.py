"""Benchmark the tensor-core engine against the FP32 kernel, torch conv3d and cupyx, in one run.

On a 256^3 uint8 volume (the MNI152 scan in data/ where present, else uniform random bytes),
for banks of N random normal filters of k^3:
  - volconv's tensor-core engine (`TensorConvolver`) and FP32 kernel (`BankConvolver`): device
    seconds of the filtering kernels from OpenCL profiling events, best of ``--repeats``;
    every work split of ``--sweep`` for the tensor engine (the best is reported);
  - torch.nn.functional.conv3d on float32 (cuDNN, TF32 on and off), CUDA events;
  - cupyx.scipy.ndimage.convolve, one filter at a time, CUDA events;
  - a bank of mixed extents (``--mixed``), each extent a direct group as volconv runs it;
  - TFLOP/s of useful work (2 x voxels x taps x N / seconds) and, for volconv's two engines,
    max |err| / (sum|w| x 255) against a float64 reference on the same data (torch float64
    on the GPU over the volume padded by scipy's 'reflect', checked against
    scipy.ndimage.convolve on a crop first).
The first tensor split of each row is the engine as shipped (`default_shape`); the others are
the sweep's candidates, each with its time and error. The compiler's report (-cl-nv-verbose:
registers, spills, local memory) of each tensor build is kept. torch and cupy are optional:
absent, their rows say so.

    python3 scripts/bench/run.py tensor --device nvidia --json benchmarks/results/h100-tensor.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pyopencl as cl
import scipy.ndimage as ndi

import volconv.engines.tensor
from volconv.device.devices import select_device
from volconv.device.peak import tensor_peak, theoretical_peak
from volconv.device.programs import context_for, kernel_source
from volconv.engines.direct import BankConvolver
from volconv.engines.tensor import (
    KERNEL_FILE,
    TensorConvolver,
    TensorShape,
    build_sm90a,
    default_shape,
    tensor_supported,
)

ROOT = Path(__file__).resolve().parents[2]
WG1, WG2 = {"wgmma": 1}, {"wgmma": 2}
X1, X2 = {"wgmma": 1, "xo": 2}, {"wgmma": 2, "xo": 2}  # two outputs along x per step
SWEEP = {  # work splits tried beside the default, by N (benchmarks/README.md has the rest)
    8: [TensorShape(1, 3, 2, 2, persistent=3, **X2),
        TensorShape(1, 4, 2, 2, persistent=3, **WG1)],
    16: [TensorShape(2, 4, 2, 2, persistent=2, **WG2)],
    32: [TensorShape(2, 4, 2, 2, persistent=2, **WG2)],
}  # fmt: skip
SWEEP_SHORT = {  # for extents of 3 along x, where the output stores weigh most
    8: [TensorShape(1, 4, 2, 2, persistent=3, **WG1),
        TensorShape(1, 4, 2, 2, persistent=4, **WG1),
        TensorShape(1, 2, 2, 2, persistent=4, **WG1),
        TensorShape(1, 8, 2, 2, persistent=2, **WG2),
        TensorShape(1, 8, 1, 4, persistent=2, **WG1),
        TensorShape(1, 8, 2, 2, persistent=2, blocal=True)],
    16: [TensorShape(2, 4, 2, 2, persistent=2, **WG2),
         TensorShape(2, 2, 2, 2, persistent=4, **WG1),
         TensorShape(2, 2, 2, 2, persistent=3, **WG1),
         TensorShape(2, 4, 2, 2, persistent=2, **WG1)],
}  # fmt: skip


def with_fields(split: TensorShape, text: str) -> TensorShape:
    """``split`` with the fields of ``text`` ("xo=2,tyw=3") set."""
    fields = dict(item.split("=") for item in text.split(",") if item)
    return replace(split, **{key: int(value) for key, value in fields.items()})


def log(*args: object) -> None:
    print(*args, flush=True)


def load_volume(n: int) -> tuple[np.ndarray, str]:
    path = ROOT / "data" / "mni152_t1_256.nii"
    if n == 256 and path.exists():
        import nibabel

        vol = np.ascontiguousarray(np.asanyarray(nibabel.load(str(path)).dataobj))
        if vol.dtype == np.uint8 and vol.shape == (256, 256, 256):
            return vol, str(path.relative_to(ROOT))
    return np.random.default_rng(0).integers(0, 256, (n, n, n), dtype=np.uint8), "random"


def tflops(n_filters: int, k: int, voxels: int, seconds: float) -> float:
    return 2.0 * voxels * n_filters * k**3 / seconds / 1e12


def volconv_engine(conv, vol: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    """Best kernel seconds over the whole volume (one slab) and the responses."""
    assert conv.plan.n_slabs == 1
    out = conv.convolve_slab(0, vol.shape[0], vol)
    return float(conv.time_kernel(0, vol.shape[0], repeats).min()), out


def verbose_log(device: cl.Device, name: str, defines: dict) -> dict:
    return _verbose_log(device, name, tuple(defines.items()))


@cache
def _verbose_log(device: cl.Device, name: str, defines: tuple) -> dict:
    """Registers, spills and local memory the compiler reports for one tensor build."""
    ctx, _ = context_for(device)
    if "WGMMA" in dict(defines):
        prg = build_sm90a(ctx, name, defines, ("-cl-nv-verbose",))
    else:
        options = [f"-D{k}={v}" for k, v in defines] + ["-cl-nv-verbose"]
        prg = cl.Program(ctx, kernel_source(name)).build(options=options)
    text = prg.get_build_info(device, cl.program_build_info.LOG)
    found = {
        key: int(m.group(1)) if (m := re.search(pat, text)) else None
        for key, pat in (
            ("registers", r"Used (\d+) registers"),
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
            ("stack_bytes", r"(\d+) bytes stack frame"),
            ("shared_bytes", r"(\d+) bytes smem"),
        )
    }
    return {**found, "log": text.strip()[-600:]}


class Reference:
    """float64 responses of scipy.ndimage.convolve (mode 'reflect') on the GPU through torch,
    checked against scipy on a crop at construction."""

    def __init__(self, vol: np.ndarray, torch) -> None:
        self.torch, self.vol = torch, vol
        crop = vol[:24, :20, :28]
        w = np.random.default_rng(9).standard_normal((2, 5, 4, 7))
        want = np.stack([ndi.convolve(crop.astype(np.float64), k, mode="reflect") for k in w])
        got = self.responses(crop, w)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-9), "torch float64 reference is off"

    def responses(self, vol: np.ndarray, bank: np.ndarray) -> np.ndarray:
        torch = self.torch
        lo = [k - 1 - k // 2 for k in bank.shape[1:]]  # as scipy centres an extent k
        hi = [k // 2 for k in bank.shape[1:]]
        padded = np.pad(vol.astype(np.float64), list(zip(lo, hi, strict=True)), mode="symmetric")
        w = torch.from_numpy(np.ascontiguousarray(bank[:, None, ::-1, ::-1, ::-1])).cuda()
        out = np.empty((len(bank), *vol.shape))
        step = 32  # output rows per chunk: bounds any im2col workspace
        for a in range(0, vol.shape[0], step):
            b = min(a + step, vol.shape[0])
            x = torch.from_numpy(padded[a : b + lo[0] + hi[0]])[None, None].cuda()
            out[:, a:b] = torch.nn.functional.conv3d(x, w)[0].cpu().numpy()
        return out


def relative_error(out: np.ndarray, ref: np.ndarray, bank: np.ndarray) -> float:
    scale = np.abs(bank).sum(axis=(1, 2, 3)) * 255.0
    return float((np.abs(out.astype(np.float64) - ref).max(axis=(1, 2, 3)) / scale).max())


def cuda_seconds(fn, repeats: int, torch) -> float:
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def peers(vol: np.ndarray, bank: np.ndarray, repeats: int) -> dict:
    """torch conv3d (TF32 on, off) and cupyx.scipy.ndimage.convolve seconds on this bank."""
    rows: dict = {}
    try:
        import torch
    except ImportError as e:
        return {"torch": f"not installed ({e})", "cupyx": "not measured"}
    k = bank.shape[1]
    x = torch.from_numpy(vol.astype(np.float32))[None, None].cuda()
    w = torch.from_numpy(bank[:, None, ::-1, ::-1, ::-1].astype(np.float32)).cuda()
    torch.backends.cudnn.benchmark = True
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        s = cuda_seconds(lambda: torch.nn.functional.conv3d(x, w, padding=k // 2), repeats, torch)
        rows[f"torch_conv3d_tf32_{'on' if tf32 else 'off'}"] = s
    try:
        import cupy
        import cupyx.scipy.ndimage as cndi

        xv = cupy.asarray(vol.astype(np.float32))
        ws = [cupy.asarray(f.astype(np.float32)) for f in bank]
        rows["cupyx_convolve"] = cuda_seconds(
            lambda: [cndi.convolve(xv, f, mode="reflect") for f in ws], max(1, repeats // 3), torch
        )
    except ImportError as e:
        rows["cupyx_convolve"] = f"not installed ({e})"
    torch.cuda.empty_cache()
    return rows


def mixed_row(spec: str, vol: np.ndarray, reference, device, repeats: int) -> dict:
    """A bank of mixed extents as volconv runs it (``spec`` 'k:N,k:N'): each extent's filters
    one direct group (volconv.engines.separable), on the tensor engine and on the FP32 kernel; the
    seconds summed over the groups, the error the worst group's."""
    row: dict = {"mixed": spec, "groups": []}
    whole = {"slab_depth": vol.shape[0]}
    for part in spec.split(","):
        k, n = map(int, part.split(":"))
        bank = np.random.default_rng(1000 + 100 * k + n).standard_normal((n, k, k, k))
        ref = reference.responses(vol, bank) if reference is not None else None
        group: dict = {"k": k, "n": n}
        emulate = not tensor_supported(device)  # off NVIDIA: the script checked, not timed
        for name, conv in (
            ("fp32", BankConvolver(bank, vol.shape, np.uint8, device=device, **whole)),
            (
                "tensor",
                TensorConvolver(bank, vol.shape, np.uint8, device=device, **whole, emulate=emulate),
            ),
        ):
            group[f"{name}_seconds"], out = volconv_engine(conv, vol, repeats)
            group[f"{name}_error"] = relative_error(out, ref, bank) if ref is not None else None
            del conv, out
        row["groups"].append(group)
    voxels = vol.size
    useful = sum(2.0 * voxels * g["n"] * g["k"] ** 3 for g in row["groups"])
    for name in ("fp32", "tensor"):
        row[f"{name}_seconds"] = sum(g[f"{name}_seconds"] for g in row["groups"])
        row[f"{name}_tflops"] = useful / row[f"{name}_seconds"] / 1e12
        errors = [g[f"{name}_error"] for g in row["groups"] if g[f"{name}_error"] is not None]
        row[f"{name}_error"] = max(errors) if errors else None
    row["speedup_vs_fp32"] = row["fp32_seconds"] / row["tensor_seconds"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="nvidia")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--extents", default="7:8,1,2,4,16,32;3:8;5:8;11:8;9:16", help="k:N,N;k:N ...")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--mixed", default="3:8,5:8,7:8", help="a bank of mixed extents, k:N,k:N "
                    "('' for none)")  # fmt: skip
    ap.add_argument("--splits", default="", help="more splits for the sweep, the default's "
                    "with fields set: 'xo=2,tyw=3;wgmma=2'")  # fmt: skip
    ap.add_argument("--define", action="append", default=[], help="an extra -D of every "
                    "tensor build, NAME=VALUE: a kernel knob")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.define:  # every TensorConvolver's build takes them
        extra = dict(item.split("=") for item in args.define)
        base = volconv.engines.tensor.tensor_defines
        volconv.engines.tensor.tensor_defines = lambda *a, **k: {**base(*a, **k), **extra}

    device = select_device(args.device)
    vol, source = load_volume(args.size)
    voxels = vol.size
    tpeak, fpeak = tensor_peak(device), theoretical_peak(device)
    log(f"{device.name.strip()}: FP32 peak {fpeak} ({fpeak.how}); tensor FP16 peak {tpeak}")
    log(f"volume {vol.shape} uint8 from {source}")
    try:
        import torch

        reference = Reference(vol, torch) if torch.cuda.is_available() else None
    except ImportError:
        reference = None
    doc: dict = {
        "device": device.name.strip(), "driver": device.driver_version,
        "fp32_peak_gflops": fpeak.gflops, "tensor_peak_gflops": tpeak.gflops,
        "tensor_peak_how": tpeak.how, "volume": source, "shape": list(vol.shape),
        "command": " ".join(sys.argv), "results": [],
    }  # fmt: skip
    for spec in args.extents.split(";"):
        k, ns = spec.split(":")
        k = int(k)
        for n in map(int, ns.split(",")):
            bank = np.random.default_rng(100 * k + n).standard_normal((n, k, k, k))
            row: dict = {"k": k, "n": n}
            t0 = time.perf_counter()
            whole = {"slab_depth": vol.shape[0]}  # one slab: the kernel over the whole volume
            ref = reference.responses(vol, bank) if reference is not None else None
            fp32 = BankConvolver(bank, vol.shape, np.uint8, device=device, **whole)
            row["fp32_seconds"], out = volconv_engine(fp32, vol, args.repeats)
            row["fp32_tflops"] = tflops(n, k, voxels, row["fp32_seconds"])
            if ref is not None:
                row["fp32_error"] = relative_error(out, ref, bank)
            del fp32, out
            # the engine as shipped (its default split) first, then the sweep's candidates
            splits = [default_shape(n, k)]
            if not args.no_sweep:
                sweep = (SWEEP_SHORT if k <= 3 else SWEEP).get(n, [])
                splits += [s for s in sweep if s != splits[0]]
            splits += [with_fields(splits[0], text) for text in args.splits.split(";") if text]
            row["tensor_sweep"] = []
            for split in splits:
                try:
                    conv = TensorConvolver(bank, vol.shape, np.uint8, device=device,
                                           shape_split=split, **whole)  # fmt: skip
                except (ValueError, cl.Error) as e:
                    row["tensor_sweep"].append({"split": split.__dict__, "error": str(e)[:300]})
                    continue
                seconds, out = volconv_engine(conv, vol, args.repeats)
                info = verbose_log(device, KERNEL_FILE, conv.defines)
                entry = {
                    "split": conv.split.__dict__, "seconds": seconds,
                    "tflops": tflops(n, k, voxels, seconds),
                    "fraction_of_tensor_peak": conv.tensor_gflop / seconds / tpeak.gflops
                    if tpeak.gflops else None,
                    "error": relative_error(out, ref, bank) if ref is not None else None,
                    **{key: v for key, v in info.items() if key != "log"},
                }  # fmt: skip
                row["tensor_sweep"].append(entry)
                spill = f"{info['spill_stores']}/{info['spill_loads']}"
                log(f"  k={k} N={n} {conv.split}: {seconds * 1e3:.3f} ms "
                    f"{entry['tflops']:.1f} TFLOP/s, err {entry['error']}, regs "
                    f"{info['registers']} spill {spill}")  # fmt: skip
                if split is splits[0]:
                    # diagnostic: the same launches storing nothing (nreal = 0), the MMAs kept
                    passes = conv._passes
                    conv._passes = [(p[0], 0, *p[2:]) for p in passes]
                    row["tensor_seconds_no_store"] = float(
                        conv.time_kernel(0, vol.shape[0], args.repeats).min()
                    )
                    conv._passes = passes
                    log(f"    without stores: {row['tensor_seconds_no_store'] * 1e3:.3f} ms")
                    row["tensor_seconds"] = seconds
                    row["tensor_split"] = conv.split.__dict__
                    row["tensor_build_log"] = info["log"]
                    row["tensor_tflops"] = entry["tflops"]
                    row["tensor_error"] = entry["error"]
                    row["speedup_vs_fp32"] = row["fp32_seconds"] / seconds
                    row["fraction_of_tensor_peak"] = entry["fraction_of_tensor_peak"]
                del conv, out
            timed = [e for e in row["tensor_sweep"] if "seconds" in e]
            if timed:
                fastest = min(timed, key=lambda e: e["seconds"])
                row["sweep_best_seconds"] = fastest["seconds"]
                row["sweep_best_tflops"] = fastest["tflops"]
                row["sweep_best_error"] = fastest["error"]
            del ref
            if not args.no_peers and reference is not None:
                for name, s in peers(vol, bank, args.repeats).items():
                    row[name + "_seconds"] = s
                    if isinstance(s, float):
                        row[name + "_tflops"] = tflops(n, k, voxels, s)
            row["bench_seconds"] = time.perf_counter() - t0
            doc["results"].append(row)
            shown = {key: (f"{v:.4g}" if isinstance(v, float) else v) for key, v in row.items()
                     if key not in ("tensor_sweep", "tensor_build_log")}  # fmt: skip
            log(json.dumps(shown))
            if args.json:  # after every row: a run cut short keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.mixed:
        row = mixed_row(args.mixed, vol, reference, device, args.repeats)
        doc["results"].append(row)
        log(json.dumps({key: v for key, v in row.items() if key != "groups"}))
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
