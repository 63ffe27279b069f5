"""Plant hostile entries in volconv's cache folder and check what `volconv run` does with each:
one line per case, PASS or FAIL (exit 1 if any failed).

    .venv/bin/python scripts/hostile_cache.py [--device cpu]

Each case starts from a copy of a warm cache (this user's, private) and plants one thing:
program binaries forged from a pad.cl that writes 777 for every voxel (under the genuine
entries' names and digests, so that only the trust rule stands between them and the run),
peak.json and tune.json entries, FIFOs, devices and links, a cache folder others can write.
volconv must exit 0 with responses within SPEC's tolerance of scipy.ndimage.convolve, warn
once naming what it ignored, never block, and leave its own entries (this user's, private)
where it replaced a planted one. The control case shows that the forgery, when it is this
user's own and private, is loaded (the responses are then wrong): the trust rule is what
refuses it. Cases owned by another user need root (os.chown to nobody); without it they are
skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import scipy.ndimage as ndi

ROOT = Path(__file__).resolve().parent.parent
PAD_LINE = "dst[at] = (DST_T)src[i0 * s0 + i1 * s1 + i2 * s2];"  # kernels/pad.cl's copy
TIMEOUT = 120  # a run that blocks on a planted FIFO fails the case, not the script


def setup(work: Path) -> Path:
    """An input, two custom 3x3x3 kernels (full rank: the direct path, through pad.cl) and a
    pipeline writing float32."""
    rng = np.random.default_rng(21)
    np.save(work / "scan.npy", rng.random((20, 19, 18)).astype(np.float32))
    for i in range(2):
        np.save(work / f"k{i}.npy", rng.standard_normal((3, 3, 3)))
    filters = "\n".join(f'[[bank.filter]]\nname = "k{i}"\ntype = "custom"\npath = "k{i}.npy"\n'
                        for i in range(2))  # fmt: skip
    (work / "pipeline.toml").write_text(
        f'[input]\npaths = ["scan.npy"]\n\n[bank]\nsize = 3\nboundary = "reflect"\n\n{filters}\n'
        '[output]\npath = "out/{stem}.h5"\ndtype = "float32"\n'
    )
    return work / "pipeline.toml"


def run(pipeline: Path, cache: Path, device: str, xdg: Path) -> tuple[int | None, str, str]:
    """`volconv run --overwrite` with ``cache`` as VOLCONV_CACHE_DIR: (status or None when it
    blocked past TIMEOUT, stdout, stderr)."""
    env = {**os.environ, "VOLCONV_CACHE_DIR": str(cache), "XDG_CACHE_HOME": str(xdg)}
    command = [sys.executable, "-m", "volconv", "run", str(pipeline), "--overwrite",
               "--device", device]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env,
                              cwd=ROOT)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or ""), str(e.stderr or "")
    return done.returncode, done.stdout, done.stderr


def right(work: Path) -> str | None:
    """Why the output is not scipy's within SPEC's tolerance, or None."""
    from volconv.checks import spec_tolerance

    volume = np.load(work / "scan.npy").astype(np.float64)
    with h5py.File(work / "out" / "scan.h5", "r") as f:
        out, kernels = f["responses"][...], f["kernels"][...]
    for k, kernel in enumerate(kernels):
        ref = ndi.convolve(volume, kernel.astype(np.float64), mode="reflect")
        err = float(np.max(np.abs(out[k] - ref)))
        if not err <= spec_tolerance(kernel, float(np.abs(volume).max())):
            return f"response {k} off by {err:.3g}"
    return None


def planted_peak_used(work: Path) -> bool:
    """Whether the planted probe rate (9.99e9 GFLOP/s) is among the output's numbers."""
    found = []
    with h5py.File(work / "out" / "scan.h5", "r") as f:
        f.visititems(lambda _, obj: found.extend(obj.attrs.values()))
        found.extend(f.attrs.values())
    numbers = [
        float(v) for v in found if np.ndim(v) == 0 and isinstance(v, (int, float, np.number))
    ]
    return any(abs(v - 9.99e9) < 1e7 for v in numbers)


def forge(cache: Path, device: str) -> dict[str, bytes]:
    """The forged entries for every pad.cl program in ``cache``/programs: name -> bytes."""
    import pyopencl as cl

    from volconv.device.devices import select_device
    from volconv.device.programs import (
        PROGRAM_MAGIC,
        context_for,
        kernel_source,
        pack_program,
        program_digest,
    )

    dev = select_device(device)
    ctx, _ = context_for(dev)
    source = kernel_source("pad.cl")
    if PAD_LINE not in source:
        sys.exit(f"pad.cl no longer has the line this script forges: {PAD_LINE}")
    evil = source.replace(PAD_LINE, "dst[at] = (DST_T)777;")
    forged = {}
    for path in sorted((cache / "programs").iterdir()):
        data = path.read_bytes()
        header = json.loads(data[len(PROGRAM_MAGIC) :].split(b"\n", 1)[0])
        if program_digest(dev, source, header["options"]) != header["digest"]:
            continue
        program = cl.Program(ctx, evil).build(options=header["options"])
        binary = program.get_info(cl.program_info.BINARIES)[0]
        forged[path.name] = pack_program(header["digest"], binary, header["options"])
    if not forged:
        sys.exit("no pad.cl program in the warm cache: the run took another path")
    return forged


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="as volconv run --device (default cpu)")
    args = parser.parse_args()
    root = os.geteuid() == 0
    nobody = pwd.getpwnam("nobody").pw_uid if root else None
    failed = 0
    with tempfile.TemporaryDirectory(prefix="volconv-hostile-") as tmp:
        work = Path(tmp)
        pipeline = setup(work)
        warm = work / "warm"
        warm.mkdir(mode=0o700)
        code, _, err = run(pipeline, warm, args.device, work / "xdg-warm")
        if code != 0 or right(work):
            print(f"FAIL warm-up: exit {code}, {right(work)}: {err.strip()}")
            return 1
        said = "building kernels" in err
        print(f"{'PASS' if said else 'FAIL'} a cold cache: one line says kernels are built")
        code, _, err = run(pipeline, warm, args.device, work / "xdg-warm")
        quiet = code == 0 and "building kernels" not in err and "Warning" not in err
        print(f"{'PASS' if quiet else 'FAIL'} a warm cache: nothing built, nothing said "
              f"({err.strip() or 'stderr empty'})")  # fmt: skip
        failed += (not said) + (not quiet)
        forged = forge(warm, args.device)
        peak_key = None

        def plant_binaries(cache: Path, then: Callable[[Path], None] | None = None) -> Path:
            for name, data in forged.items():
                path = cache / "programs" / name
                path.write_bytes(data)
                path.chmod(0o600)
                if then:
                    then(path)
            return cache / "programs" / next(iter(forged))

        def chown(path: Path) -> None:
            os.chown(path, nobody, nobody)

        def peak_doc(cache: Path) -> Path:
            nonlocal peak_key
            if peak_key is None:
                from volconv.device.devices import select_device
                from volconv.device.peak import _cache_key

                peak_key = _cache_key(select_device(args.device))
            path = cache / "peak.json"
            path.write_text(json.dumps({peak_key: {"gflops": 9.99e9}}))
            path.chmod(0o600)
            return path

        def tune_doc(cache: Path, **knobs: object) -> Path:
            from volconv.device.devices import select_device
            from volconv.engines.registry import ENGINES
            from volconv.plan.knobs import TUNE_FORMAT, kernel_hash, tune_keys

            dev_key, bank_key = tune_keys(select_device(args.device), (3, 3, 3), 2,
                                          np.dtype(np.float32))  # fmt: skip
            entry = {"format": TUNE_FORMAT, "kernel": kernel_hash(), "engine": ENGINES[0].name,
                     "vector_width": None, "unroll": 4, "rows": 1, "local_size": [4, 4],
                     **knobs}  # fmt: skip
            path = cache / "tune.json"
            path.write_text(json.dumps({dev_key: {bank_key: entry}}))
            path.chmod(0o600)
            return path

        def programs_link(cache: Path) -> Path:
            plant_binaries(cache)
            (cache / "programs").rename(cache / "forged")
            (cache / "programs").symlink_to(cache / "forged")
            return cache / "programs"

        def shared(cache: Path) -> Path:
            plant_binaries(cache)
            cache.chmod(0o1777)
            return cache

        def device_node(path: Path) -> Path:
            path.unlink(missing_ok=True)
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            return path

        # (case, needs root, plant(cache) -> the path the warning must name, or None: the
        # control, whose responses must be wrong)
        cases: list[tuple[str, bool, Callable[[Path], Path | None]]] = [
            ("control: a forged binary of this user's, private, IS loaded (wrong responses)",
             False, lambda c: (plant_binaries(c), None)[1]),
            ("a forged binary owned by another user", True, lambda c: plant_binaries(c, chown)),
            ("a forged binary writable by others (0666)", False,
             lambda c: plant_binaries(c, lambda p: p.chmod(0o666))),
            ("a forged binary writable by the group (0620)", False,
             lambda c: plant_binaries(c, lambda p: p.chmod(0o620))),
            ("a FIFO at a program binary", False, lambda c: plant_binaries(c, fifo)),
            ("a link at a program binary (to a forged file of ours)", False,
             lambda c: plant_binaries(c, lambda p: (p.rename(p.with_suffix(".x")),
                                                    p.symlink_to(p.with_suffix(".x"))))),
            ("a device node at a program binary", True, lambda c: plant_binaries(c, device_node)),
            ("forged binaries in a cache folder of mode 1777", False, shared),
            ("programs/ a link to a folder of forged binaries", False, programs_link),
            ("programs/ owned by another user", True,
             lambda c: (plant_binaries(c), chown(c / "programs"))[0].parent),
            ("the cache folder owned by another user", True,
             lambda c: (plant_binaries(c), chown(c))[0].parent.parent),
            ("peak.json owned by another user (9.99e9 GFLOP/s)", True,
             lambda c: (p := peak_doc(c), chown(p))[0]),
            ("peak.json writable by others", False,
             lambda c: (p := peak_doc(c), p.chmod(0o646))[0]),
            ("a FIFO at peak.json", False, lambda c: (fifo(c / "peak.json"), c / "peak.json")[1]),
            ("peak.json a link to a file of ours", False,
             lambda c: (peak_doc(c).rename(c / "p"), (c / "peak.json").symlink_to(c / "p"),
                        c / "peak.json")[2]),
            ("tune.json owned by another user", True, lambda c: (p := tune_doc(c), chown(p))[0]),
            ("a FIFO at tune.json", False, lambda c: (fifo(c / "tune.json"), c / "tune.json")[1]),
            ("a device node at tune.json", True, lambda c: device_node(c / "tune.json")),
            ("tune.json of ours with a work-group of 1048576 x 1048576", False,
             lambda c: tune_doc(c, local_size=[1048576, 1048576])),
            ("tune.json of ours with input tiles past local memory", False,
             lambda c: tune_doc(c, unroll=24, rows=4, input_local=True, local_size=[64, 64])),
        ]  # fmt: skip
        for i, (name, needs_root, plant) in enumerate(cases):
            if needs_root and not root:
                print(f"SKIP {name}: needs root")
                continue
            cache = work / f"case{i}"
            shutil.copytree(warm, cache)
            named = plant(cache)
            code, _, err = run(pipeline, cache, args.device, work / f"xdg{i}")
            wrong = right(work) if code == 0 else None
            if code is None:
                ok, why = False, f"blocked past {TIMEOUT} s"
            elif named is None:  # the control
                ok, why = code == 0 and wrong is not None, f"exit {code}, {wrong or 'RIGHT'}"
            else:
                warned = [ln for ln in err.splitlines() if str(named) in ln]
                ok = code == 0 and wrong is None and len(warned) == 1
                if "peak.json" in name and code == 0:
                    ok = ok and not planted_peak_used(work)
                why = (
                    f"exit {code}, responses {wrong or 'right'}, "
                    f"{len(warned)} warning(s) naming {named.name}: "
                    f"{warned[0].split('Warning: ', 1)[-1][:160] if warned else err.strip()[-200:]}"
                )
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name}: {why}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
