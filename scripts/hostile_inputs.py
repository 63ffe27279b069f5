"""Hostile inputs, pipeline settings and progress logs against the `volconv` CLI.

Each case builds its files in a fresh folder, runs ``volconv validate`` or ``volconv run``
as a user would (a subprocess, on ``--device``, default cpu) and prints one line: the case,
what volconv did (exit status and the last line on stderr) and PASS or FAIL. Exit status 1
if any case failed.

    .venv/bin/python scripts/hostile_inputs.py [--device cpu] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # volconv from this checkout, as its subprocesses take it
RNG = np.random.default_rng(21)
DEVICE = "cpu"


def pipeline(folder: Path, paths: list[str], **sections: dict) -> Path:
    data = {
        "input": {"paths": paths},
        "bank": {"size": 3, "filter": [{"type": "gaussian", "sigma": 1.0}]},
        "output": {"path": "out/{stem}.h5"},
        "run": {"device": DEVICE},
    }
    for name, body in sections.items():
        data[name] = {**data.get(name, {}), **body}
    path = folder / "p.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def volconv(*args: str, cwd: Path) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "volconv", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "warnings.warn(" not in ln]
    return lines[-1].strip() if lines else ""


def volume(shape=(16, 16, 16), dtype="uint8") -> np.ndarray:
    return RNG.integers(0, 255, shape, endpoint=True).astype(dtype)


# -- the cases: each returns (what volconv did, passed) -----------------------------------
def hdf5_case(kind: str, allowed: bool) -> Callable[[Path], tuple[str, bool]]:
    def case(d: Path) -> tuple[str, bool]:
        (d / "in").mkdir()
        other = d / "elsewhere"
        other.mkdir()
        data = volume()
        with h5py.File(other / "src.h5", "w") as f:
            f["data"] = data
        x = d / "in" / "x.h5"
        with h5py.File(x, "w") as f:
            if kind.startswith("vds"):
                layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
                name = "missing.h5" if kind == "vds-missing" else str(other / "src.h5")
                layout[:] = h5py.VirtualSource(name, "data", shape=data.shape)
                f.create_virtual_dataset("data", layout, fillvalue=0)
                spec = "x.h5:/data"
            elif kind == "external-storage":
                f.create_dataset("data", shape=(4, 4, 4), dtype="u1",
                                 external=[("/etc/passwd", 0, 64)])  # fmt: skip
                spec = "x.h5:/data"
            else:
                f["g"] = h5py.ExternalLink(str(other / "src.h5"), "/")
                spec = "x.h5:/g/data"
        p = pipeline(d / "in", [spec], input={"external": allowed})
        code, _, err = volconv("run", p, cwd=d / "in")
        did = f"exit {code}: {last_line(err)}"
        if not allowed or kind == "vds-missing":
            return did, code == 2 and "x.h5" in err
        if kind == "external-link":  # a change in the linked file: the rerun must not skip
            with h5py.File(other / "src.h5", "r+") as f:
                f["data"][0, 0, 0] ^= 1
            code2, _, err2 = volconv("run", p, cwd=d / "in")
            did += f"; after the linked data changed: exit {code2}: {last_line(err2)}"
            return did, code == 0 and code2 == 2 and "SHA-256" in err2
        return did, code == 0

    return case


def hdf5_named_mnc(d: Path) -> tuple[str, bool]:
    with h5py.File(d / "a.mnc", "w") as f:
        f["data"] = volume()
    code, _, err = volconv("validate", pipeline(d, ["a.mnc"]), cwd=d)
    return f"exit {code}: {last_line(err)}", code == 2 and "a.mnc" in err and "KeyError:" not in (
        last_line(err).split("(")[0]
    )


def empty_dataspace(d: Path) -> tuple[str, bool]:
    with h5py.File(d / "e.h5", "w") as f:
        f.create_dataset("data", data=h5py.Empty("f4"))
    code, _, err = volconv("validate", pipeline(d, ["e.h5:/data"]), cwd=d)
    return f"exit {code}: {last_line(err)}", code == 2 and "e.h5" in err and "TypeError" not in err


def host_memory_pib(d: Path) -> tuple[str, bool]:
    np.save(d / "v.npy", volume())
    code, out, err = volconv("validate", pipeline(d, ["v.npy"], run={"host_memory": "1PiB"}), cwd=d)
    shown = next((ln.strip() for ln in out.splitlines() if "host memory" in ln), "")
    return f"exit {code}: {shown[-60:] or last_line(err)}", code == 0


def mm_on_npy(d: Path) -> tuple[str, bool]:
    np.save(d / "v.npy", volume())
    code, _, err = volconv("validate", pipeline(d, ["v.npy"], bank={"units": "mm"}), cwd=d)
    return f"exit {code}: {last_line(err)}", code == 2 and "bank.units" in err and "v.npy" in err


def mm_zero_voxel(d: Path) -> tuple[str, bool]:
    import nibabel as nib

    nib.save(nib.Nifti1Image(volume(), np.eye(4)), d / "z.nii")
    raw = bytearray((d / "z.nii").read_bytes())
    raw[80:92] = bytes(12)  # pixdim[1:4] = 0
    raw[252:256] = bytes(4)  # no qform, no sform
    (d / "z.nii").write_bytes(bytes(raw))
    code, _, err = volconv("validate", pipeline(d, ["z.nii"], bank={"units": "mm"}), cwd=d)
    return f"exit {code}: {last_line(err)}", code == 2 and "bank.units" in err and "z.nii" in err


def box_like_gaussian(d: Path) -> tuple[str, bool]:
    np.save(d / "v.npy", volume())
    bank = {"size": 3, "filter": [{"type": "gaussian", "sigma": 10}]}
    code, _, err = volconv("validate", pipeline(d, ["v.npy"], bank=bank), cwd=d)
    warned = next((ln for ln in err.splitlines() if "truncates" in ln), "")
    return f"exit {code}: {warned.split('Warning: ')[-1]}", code == 0 and "0.1 sigma" in warned


def pipeline_placeholder(d: Path) -> tuple[str, bool]:
    np.save(d / "v.npy", volume())
    p = pipeline(d, ["v.npy"], output={"path": "out/{pipeline}/{stem}.h5"})
    code, _, _ = volconv("run", p, cwd=d)
    made = d / "out" / "p" / "v.h5"
    return f"exit {code}: wrote {made.relative_to(d)}: {made.exists()}", code == 0 and made.exists()


def scale_auto(d: Path) -> tuple[str, bool]:
    np.save(d / "v.npy", volume((24, 24, 24)))
    bank = {"size": 5, "filter": [{"type": "gaussian", "sigma": 1.0, "order": [1, 0, 0]},
                                  {"type": "log", "sigma": 1.0}]}  # fmt: skip
    p = pipeline(d, ["v.npy"], bank=bank, output={"dtype": "uint8", "scale": "auto"})
    code, _, err = volconv("run", p, cwd=d)
    with h5py.File(d / "out" / "v.h5") as f:
        attrs = f["responses"].attrs
        did = f"exit {code}: scale {attrs['scale']:.4g}, offset {attrs['offset']:.4g}"
    return did + (f"; {last_line(err)}" if "outside" in err else ""), code == 0 and (
        "outside what uint8 holds" not in err
    )


def forged_progress_log(d: Path) -> tuple[str, bool]:
    """Kill a run mid-volume, add log records for slabs never written (CRCs of zeros, what
    an unwritten chunk reads as); the rerun must compute them."""
    v = volume((600, 32, 32))
    np.save(d / "v.npy", v)
    p = pipeline(d, ["v.npy"], output={"dtype": "float16"}, run={"slab_depth": 1})
    proc = subprocess.Popen([sys.executable, "-m", "volconv", "run", str(p)], cwd=d,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    log = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((d / "out").glob(".v.h5.partial-*/progress"))
        if found and found[0].read_bytes().count(b"\nslab ") >= 20:
            log = found[0]
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if log is None:
        return "the run finished before it could be killed mid-volume", False
    from volconv.run.resume import _line

    crc = f"{zlib.crc32(np.zeros((1, 32, 32), np.float16)):08x}"
    with open(log, "ab") as f:
        f.write(b"".join(_line(f"slab 0 {a} {a + 1} {crc}") for a in range(100, 600)))
    code, _, err = volconv("run", p, cwd=d)
    if code != 0:
        return f"exit {code}: {last_line(err)}", False
    from scipy import ndimage

    with h5py.File(d / "out" / "v.h5") as f:
        got, kernel = f["responses"][0].astype(np.float64), f["kernels"][0]
    ref = ndimage.convolve(v.astype(np.float64), kernel, mode="reflect")
    worst = float(np.abs(got - ref).max())
    return f"exit 0, max |stored - scipy| {worst:.3g}", worst < 0.5  # float16 at |v| < 256


CASES: list[tuple[str, Callable[[Path], tuple[str, bool]]]] = [
    ("HDF5 VDS over a file in another folder, not allowed", hdf5_case("vds", False)),
    ("HDF5 VDS over a file in another folder, external = true", hdf5_case("vds", True)),
    ("HDF5 VDS whose source is missing, not allowed", hdf5_case("vds-missing", False)),
    ("HDF5 VDS whose source is missing, external = true", hdf5_case("vds-missing", True)),
    ("HDF5 external storage on /etc/passwd, not allowed", hdf5_case("external-storage", False)),
    ("HDF5 reached through an external link, not allowed", hdf5_case("external-link", False)),
    ("HDF5 external link allowed, then the linked data changes", hdf5_case("external-link", True)),
    ("an HDF5 file named .mnc", hdf5_named_mnc),
    ("an HDF5 dataset with a null dataspace", empty_dataspace),
    ('host_memory = "1PiB"', host_memory_pib),
    ('units = "mm" on a .npy (no voxel size)', mm_on_npy),
    ('units = "mm" on a NIfTI whose voxel size is 0', mm_zero_voxel),
    ("sigma = 10 with size = 3", box_like_gaussian),
    ("output.path with {pipeline}", pipeline_placeholder),
    ('uint8 output with scale = "auto"', scale_auto),
    ("a forged progress log claiming 500 unwritten slabs", forged_progress_log),
]


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keep", action="store_true", help="keep the cases' folders")
    args = parser.parse_args()
    DEVICE = args.device
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    top = Path(tempfile.mkdtemp(prefix="volconv-hostile-"))
    failed = 0
    for i, (what, case) in enumerate(CASES):
        folder = top / f"case{i:02d}"
        folder.mkdir()
        try:
            did, ok = case(folder)
        except Exception as e:  # a case that breaks is a failure, shown on its line
            did, ok = f"the case raised {type(e).__name__}: {e}", False
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}  ->  {did}", flush=True)
    if args.keep:
        print(f"cases kept in {top}")
    else:
        shutil.rmtree(top, ignore_errors=True)
    print(f"{len(CASES) - failed}/{len(CASES)} cases handled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
