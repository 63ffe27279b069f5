r"""The tensor-core engine on inputs split into 8-bit digits (`DigitConvolver`) against the
FP32 kernel, in one run: time and error against float64 for int16 and float32 volumes.

On 256^3 volumes made from the MNI152 scan in data/ (else random bytes) and random ones, for a
bank of N random normal k^3 filters: device seconds of the filtering (OpenCL profiling, best
of ``--repeats``; the digits' split and sums included, and the tensor passes alone beside
them) and max |err| / (sum|w| x max|v|) against float64 (torch on the GPU, checked against
scipy on a crop: `tensor.Reference`). The 8-bit engine on the uint8 scan is the floor.
Floats run at `FLOAT_DIGITS` and at each of ``--float-digits``.

    python3 scripts/bench/run.py tensor_types --device nvidia \
        --json benchmarks/results/h100-tensor-types.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tensor import Reference, load_volume, tflops

from volconv.device.devices import select_device
from volconv.engines import digits as digit_module
from volconv.engines.digits import DigitConvolver
from volconv.engines.direct import BankConvolver
from volconv.engines.tensor import TensorConvolver
from volconv.report import write_json


def log(*args: object) -> None:
    print(*args, flush=True)


def volumes(n: int) -> dict[str, np.ndarray]:
    scan, source = load_volume(n)
    rng = np.random.default_rng(3)
    log(f"scan: {source}")
    return {
        "uint8 scan": scan,
        "int16 scan x 100 - 1000": (scan.astype(np.int16) * 100 - 1000).astype(np.int16),
        "int16 random": rng.integers(-32768, 32768, scan.shape, dtype=np.int16),
        "float32 scan / 255 + noise": (scan / 255.0 + rng.normal(0, 0.01, scan.shape)).astype(
            np.float32
        ),
        "float32 normal x 1000": (rng.standard_normal(scan.shape) * 1000).astype(np.float32),
    }


def error(out: np.ndarray, ref: np.ndarray, bank: np.ndarray, vol: np.ndarray) -> float:
    scale = np.abs(bank).sum(axis=(1, 2, 3)) * float(np.abs(vol).max())
    return float((np.abs(out.astype(np.float64) - ref).max(axis=(1, 2, 3)) / scale).max())


def timed(conv, vol: np.ndarray, repeats: int) -> tuple[dict, np.ndarray]:
    """Best kernel seconds over the whole volume (one slab), the tensor passes alone (digits),
    and the responses."""
    assert conv.plan.n_slabs == 1
    depth = vol.shape[0]
    out = conv.convolve_slab(0, depth, vol)
    row = {"engine": conv.engine, "seconds": float(conv.time_kernel(0, depth, repeats).min())}
    if isinstance(conv, DigitConvolver):
        passes = 0.0
        for dt in conv.digits:
            inner = conv._inner[dt]
            inner._out = conv._out
            passes += float(inner.time_kernel(0, depth, repeats).min())
        row["tensor_passes_seconds"] = passes
    return row, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="nvidia")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--float-digits", default="4", help="other fixed-point widths to try")
    p.add_argument("--only", default="", help="the volumes whose names hold this, e.g. int16")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import torch

    dev = select_device(args.device)
    bank = np.random.default_rng(1).standard_normal((args.n, args.k, args.k, args.k))
    shape = (args.size,) * 3
    voxels = args.size**3
    record = {"device": dev.name.strip(), "driver": dev.driver_version, "n": args.n,
              "k": args.k, "size": args.size, "repeats": args.repeats, "rows": []}  # fmt: skip
    for name, vol in volumes(args.size).items():
        if args.only not in name:
            continue
        ref = Reference(vol, torch).responses(vol, bank)
        digits = [digit_module.FLOAT_DIGITS]
        if vol.dtype.kind == "f":
            digits += [int(d) for d in args.float_digits.split(",") if d]
        convs = [BankConvolver(bank, shape, vol.dtype, device=dev, tuned=False)]
        for d in digits:
            digit_module.FLOAT_DIGITS = d  # read by digit_types when the convolver is made
            cls = TensorConvolver if vol.dtype.itemsize == 1 else DigitConvolver
            convs.append(cls(bank, shape, vol.dtype, device=dev, tuned=False))
        digit_module.FLOAT_DIGITS = digits[0]
        for conv in convs:
            row, out = timed(conv, vol, args.repeats)
            row.update(volume=name, dtype=vol.dtype.name, error=error(out, ref, bank, vol),
                       tflops=tflops(args.n, args.k, voxels, row["seconds"]))  # fmt: skip
            record["rows"].append(row)
            log(f"{name:28s} {row['engine']:16s} {row['seconds'] * 1e3:7.3f} ms "
                f"{row['tflops']:6.1f} TFLOP/s  err {row['error']:.3g}"
                + (f"  (tensor passes {row['tensor_passes_seconds'] * 1e3:.3f} ms)"
                   if "tensor_passes_seconds" in row else ""))  # fmt: skip
            del conv
    if args.json:
        write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
