"""Chains of SIGKILLs at random moments of `volconv run`, then a last run: is the output bit for
bit the uninterrupted run's, with nothing left beside it? One JSON line per chain.

    python scripts/bench/run.py stress_resume --chains 4 --seed 1 > results.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from volconv.config import dump_toml

ROOT = Path(__file__).resolve().parents[2]
CASES = (("none", "float32"), ("gzip", "float16"), ("lzf", "uint8"))


def pipeline(folder: Path, compression: str, dtype: str, device: str) -> Path:
    filters = [{"type": "gaussian", "name": f"g{i}", "sigma": 1.5, "order": [0, 0, i % 3]}
               for i in range(4)]  # fmt: skip
    data = {
        "input": {"paths": ["b.npy"]},
        "bank": {"size": 5, "filter": filters},
        "output": {"path": "out/{stem}.h5", "dtype": dtype, "compression": compression},
        "run": {"device": device, "slab_depth": 2},
    }
    (folder / "p.toml").write_text(dump_toml(data))
    return folder / "p.toml"


def go(path: Path, kill_after: float | None = None) -> tuple[int, str, str]:
    """Run ``volconv run path``; SIGKILL it after ``kill_after`` seconds if still running."""
    proc = subprocess.Popen([sys.executable, "-m", "volconv", "run", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if kill_after is not None:
        try:
            proc.wait(kill_after)
        except subprocess.TimeoutExpired:
            proc.kill()
    out, err = proc.communicate()
    return proc.returncode, out, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4, help="per output type")
    parser.add_argument("--kills", type=int, default=4, help="at most, per chain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    random.seed(args.seed)
    volume = np.random.default_rng(args.seed).integers(0, 255, (600, 40, 40), dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for compression, dtype in CASES:
            ref = Path(tmp) / compression / "ref"
            ref.mkdir(parents=True)
            np.save(ref / "b.npy", volume)
            start = time.monotonic()
            code, _, err = go(pipeline(ref, compression, dtype, args.device))
            whole_s = time.monotonic() - start
            assert code == 0, err
            with h5py.File(ref / "out" / "b.h5") as f:
                whole = f["responses"][()]
            for chain in range(args.chains):
                folder = Path(tmp) / compression / f"chain{chain}"
                folder.mkdir()
                np.save(folder / "b.npy", volume)
                path = pipeline(folder, compression, dtype, args.device)
                kills = 0
                for _ in range(args.kills):
                    code, out, err = go(path, random.uniform(0.5, whole_s))
                    if code == 0 or (folder / "out" / "b.h5").exists():  # done before the kill
                        break
                    kills += 1
                    assert "Traceback" not in err, err
                code, out, err = go(path)
                assert code == 0, err
                with h5py.File(folder / "out" / "b.h5") as f:
                    same = f.attrs["complete"] and np.array_equal(f["responses"][()], whole)
                line = {
                    "compression": compression, "dtype": dtype, "kills": kills,
                    "bitwise_equal": bool(same),
                    "left_beside": sorted(p.name for p in (folder / "out").iterdir()),
                    "last_run_first_line": out.splitlines()[0],
                }  # fmt: skip
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
