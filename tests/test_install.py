"""The built package carries every kernels/*.cl and builds them from where it is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh process, from a folder outside the checkout, against the installed copy.
PROBE = """
import sys
from importlib import resources
import numpy as np
import pyopencl as cl
import volconv
from volconv.device.devices import select_device
from volconv.device.programs import build, context_for
from volconv.engines.features import build_with_features

assert volconv.__file__.startswith(sys.argv[1]), volconv.__file__
device = select_device(sys.argv[2])
ctx, _ = context_for(device)
names = sorted(p.name for p in resources.files("volconv.kernels").iterdir() if p.suffix == ".cl")
# Build each kernel with the -D set it requires; a kernel without a set here fails the test.
defines = {
    "bank_conv.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("NV", 4), ("UNROLL", 4), ("IN_T", "uchar"),
                     ("FILT_LOCAL", 1)),
    "pad.cl": (("SRC_T", "uchar"), ("DST_T", "float"), ("PAD_TILE", 32), ("PAD_ROWS", 8)),
    "fma_probe.cl": (),
    "separable.cl": (("K", 5), ("V", 16), ("U", 4), ("UM", 2), ("IN_T", "uchar")),
    # mma.sync emulated: the inline PTX builds on NVIDIA only (tests/test_tensor.py runs it)
    "tensor_int8.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("IN_T", "uchar"), ("NSEG", 1), ("NJ", 1),
                       ("NROWS", 4), ("NQ", 2), ("LROWS", 5), ("PL", 20), ("NT", 1), ("WY", 1),
                       ("WZ", 1), ("TYW", 2), ("XC", 32), ("EMULATE_MMA", 1)),
    "fused.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("TY", 2), ("TZ", 4), ("CX", 2), ("N_ROOTS", 1),
                 ("N_MIDS", 1), ("N_COMBOS", 1), ("N_OUT", 1), ("MID_ROOT", 0), ("COMBO_MID", 0),
                 ("COMBO_OUT", 0), ("WZ", "1.0f,2.0f,1.0f"), ("WY", "1.0f,0.0f,-1.0f"),
                 ("WX", "0.5f,0.5f,0.5f"), ("IN_T", "uchar")),
    "columns.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("N_ROOTS", 1), ("N_MIDS", 1),
                   ("N_COMBOS", 1), ("N_OUT", 1), ("MID_ROOT", 0), ("COMBO_MID", 0),
                   ("COMBO_OUT", 0), ("WZ", "1.0f,2.0f,1.0f"), ("WY", "1.0f,0.0f,-1.0f"),
                   ("WX", "0.5f,0.5f,0.5f"), ("IN_T", "uchar"), ("V", 8), ("EV", 8), ("TY", 2),
                   ("CX", 4)),
    "convert.cl": (),
    "digits.cl": (("SRC_T", "float"), ("DIGITS", 3), ("FIXED_POINT", 1)),
    "features.cl": (("EV", 1),),
    "stencils.cl": (("R", 2), ("RD", 1), ("RO", 1)),
    "smoothing.cl": (("R", 2), ("WEIGHTS", "0.1f,0.2f,0.4f,0.2f,0.1f"), ("M", 1), ("MZ", 1),
                     ("WG", 32), ("LINES", 8), ("IN_T", "float")),
    "tree.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("S0", 0), ("S1", 0), ("S2", 0), ("N_ROOTS", 1),
                ("N_MIDS", 1), ("N_COMBOS", 1), ("N_OUT", 1), ("ROOT_IN", 0), ("ROOT_FIRST", 1),
                ("MID_ROOT", 0), ("COMBO_MID", 0), ("COMBO_OUT", 0), ("WZ", "1.0f,2.0f,1.0f"),
                ("WY", "1.0f,0.0f,-1.0f"), ("WX", "0.5f,0.5f,0.5f"), ("V", 4), ("EV", 4),
                ("UY", 2), ("UX", 2), ("IN_T", "float")),
    "tree_yz.cl": (("KA", 3), ("KB", 3), ("KC", 3), ("SA", 0), ("SB", 0), ("SC", 0),
                   ("N_ROOTS", 1), ("N_MIDS", 1), ("N_COMBOS", 1), ("N_OUT", 1), ("ROOT_IN", 0),
                   ("ROOT_FIRST", 1), ("MID_ROOT", 0), ("COMBO_MID", 0), ("COMBO_OUT", 0),
                   ("WA", "1.0f,2.0f,1.0f"), ("WB", "1.0f,0.0f,-1.0f"), ("WC", "0.5f,0.5f,0.5f"),
                   ("UA", 4), ("TY", 4), ("TZ", 16), ("UB", 2), ("VC", 4), ("PM", 19), ("TL", 1),
                   ("PREFETCH", 0), ("IN_T", "float"), ("MID_SLOT", 0), ("ROOT_MIDS", 1),
                   ("MAXM", 1), ("MG", 1), ("ROUNDS", 1), ("LBUF", 184)),
    "skimage_rows.cl": (("EV", 16),),
    "ilastik_rows.cl": (("R", 2), ("RD", 1), ("RO", 1), ("EV", 8)),
    "structure.cl": (("KX", 3), ("KY", 3), ("KZ", 3), ("S0", 0), ("S1", 0), ("S2", 0),
                     ("WX", "0.5f,0.5f,0.5f"), ("WY", "1.0f,2.0f,1.0f"), ("WZ", "1.0f,0.0f,1.0f"),
                     ("UA", 2), ("TY", 4), ("TZ", 8), ("UY", 2), ("VC", 4), ("UB", 2), ("CH", 2)),
}
options = {"convert.cl": ("-cl-fp32-correctly-rounded-divide-sqrt",)}
# built behind eigen.cl and bands.cl, as they run
behind_eigen = ("features.cl", "stencils.cl", "fused.cl", "tree.cl", "tree_yz.cl", "columns.cl",
                "structure.cl", "skimage_rows.cl", "ilastik_rows.cl")
for name in names:
    if name in behind_eigen:
        build_with_features(ctx, name, defines[name])
    elif name not in ("eigen.cl", "bands.cl"):  # built in front of each of behind_eigen
        build(ctx, name, defines[name], options.get(name, ()))
out = volconv.convolve_bank(np.arange(60, dtype=np.uint8).reshape(3, 4, 5), np.ones((2, 3, 3, 3)),
                            device=device)
assert out.shape == (2, 3, 4, 5)
print(" ".join(names))
"""


def test_wheel_ships_and_builds_every_kernel(tmp_path, device):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("volconv-*.whl")
    shipped = {n.rsplit("/", 1)[1] for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".cl")}
    assert shipped == {p.name for p in (ROOT / "kernels").glob("*.cl")}

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        check=True,
    )
    spec = f"{device.platform.name}:{device.name}"
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(site), spec],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert set(run.stdout.split()) == shipped
