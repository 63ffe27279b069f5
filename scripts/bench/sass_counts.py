"""SASS instruction counts of bank_conv.cl's hot loop, with or without a GPU.

`sass_counts` assembles PTX (the binary NVIDIA's OpenCL returns, or clang's) with ptxas and
disassembles it with cuobjdump (``$CUOBJDUMP``, else on PATH; pip's nvidia-cuda-cuobjdump has
one): registers and spills, the hot loop's instructions by opcode, its load kinds, and how
many FFMAs take a constant-bank (c[..]) or uniform-register (UR) operand. (The FP32
kernel's sweep that counted every build on the GPU node, sweep_fp32_gpu.py, is in git's
history: benchmarks/README.md, "History".)

Run alone, it compiles kernels/bank_conv.cl offline with clang's OpenCL front end for NVPTX
(kernels/offline_nvptx.h stands in for the driver's built-ins) and counts that: another
front end than the driver's, the same ptxas; for a first look at a variant, not a measure
(FILT_LOCAL=1 does not link offline: async_work_group_copy is the driver's).

    python3 scripts/bench/run.py sass_counts KX=7 KY=7 KZ=7 NV=8 UNROLL=8 IN_T=uchar \\
        FILT_LOCAL=0 ROWS=1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sass_counts(ptx: bytes, arch: str) -> dict[str, object]:
    """The hot loop's SASS instructions of one build: ptxas (offline, as the driver's JIT) and
    cuobjdump; the loop is the backward branch's body holding the most FFMAs. FFMA operands
    are counted by kind: a constant bank (c[..]) or a uniform register (UR) as the b or c."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_bytes(ptx.rstrip(b"\0"))
        try:
            r = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                               capture_output=True, text=True)  # fmt: skip
        except FileNotFoundError:
            return {"ptxas": "no ptxas on PATH"}
        info = " ".join(ln.strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln)
        if r.returncode:
            return {"ptxas": r.stderr[-400:]}
        text = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True).stdout  # fmt: skip
    ins = []  # (address, opcode, operands)
    pattern = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);"
    for m in re.finditer(pattern, text):
        ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    ffmas = lambda body: sum(i[1].startswith("FFMA") for i in body)  # noqa: E731
    best: list = []
    for addr, op, args in ins:
        t = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            body = [i for i in ins if int(t.group(1), 16) <= i[0] <= addr]
            if ffmas(body) > ffmas(best):
                best = body
    ops: dict[str, int] = {}
    for _, op, _ in best:
        ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + 1
    ffma = [a for _, op, a in best if op.startswith("FFMA")]
    loads = sorted({op for _, op, _ in best if op.startswith(("LD", "ULD"))})
    return {"ptxas": info, "loop": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "loop_len": len(best), "load_kinds": loads,
            "ffma_const_operand": sum("c[" in a for a in ffma),
            "ffma_ur_operand": sum(bool(re.search(r"\bUR\d", a)) for a in ffma),
            "total": len(ins),
            "loop_head": [f"{op} {a.strip()}" for _, op, a in best[:48]]}  # fmt: skip


def offline_ptx(defines: dict[str, str], clang: str = "clang-15") -> bytes:
    """PTX of kernels/bank_conv.cl from clang's OpenCL front end (sm_80 PTX, for ptxas)."""
    kernels = ROOT / "kernels"
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    cmd = [clang, "-x", "cl", "-cl-std=CL1.2", "-target", "nvptx64-nvidia-nvcl", "-O3", "-S",
           "-Xclang", "-finclude-default-header", "-Xclang", "-target-cpu", "-Xclang", "sm_80",
           "-include", str(kernels / "offline_nvptx.h"), "-Dget_global_id=offline_global_id",
           "-Dmin=offline_min", *flags, str(kernels / "bank_conv.cl"), "-o", "-"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("defines", nargs="+", help="bank_conv.cl's -D defines, KEY=VALUE")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--clang", default="clang-15")
    ap.add_argument("--head", type=int, default=0, help="print the loop's first instructions")
    args = ap.parse_args()
    defines = dict(d.split("=", 1) for d in args.defines)
    counts = sass_counts(offline_ptx(defines, args.clang), args.arch)
    head = counts.pop("loop_head", [])
    print(json.dumps({"defines": defines, **counts}))
    for ins in head[: args.head]:
        print("   ", ins)


if __name__ == "__main__":
    main()
