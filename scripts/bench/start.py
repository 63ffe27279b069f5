"""Where a `volconv run` process spends its time outside its in-run wall, this tree against another.

    python scripts/bench/run.py start PIPELINE [--before DIR] [--tree NAME=DIR ...] [--device D]
                                      [--repeats R] [--json OUT.json]

Runs, in one go: `python -c pass` and `volconv --help`; then the whole `volconv run
--overwrite --report` process R times (after one that fills the caches: a cache folder per
tree), in turns with this checkout's volconv, with ``--before``'s (a tree holding volconv/
and kernels/, e.g. ``git archive COMMIT volconv kernels | tar -x -C DIR``) and with each
``--tree``'s; and the run's imports once (``-X importtime``: the largest, cumulative). Each
process's figures: ``process`` (timed from here, as a shell does), ``minus_input`` (the
process less its first input's own wall: what scripts/bench/e2e.py reports as the start),
``minus_run`` (less the run's total wall, which counts making the convolvers), ``start``
(the report's: the process's start to its first input) and whether it said it built
kernels. Medians and minima per tree; ``--json`` saves it all.

``--timeline R`` also runs this checkout's process R more times with a ``sitecustomize``
first on its path that notes when the interpreter reached site, when chosen modules began to
import and when the process called ``os._exit``; with the report's start and run walls and
the time this parent saw it end, each process splits into: the interpreter's start, the
imports and planning before the run, the run, what follows the run inside the process (the
table, the report, the start record) and the exit (the kernel's and driver's teardown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The processes run outside the checkout: `python -m` puts the working folder first on
# sys.path, where the checkout's volconv would shadow the one PYTHONPATH names.
OUTSIDE = tempfile.gettempdir()
HERE = Path(__file__).resolve().parents[2]


def timed(
    args: list[str], tree: Path | None = None, cache: Path | None = None
) -> tuple[float, str]:
    """Seconds the process took, and its stderr; ``tree``'s volconv, ``cache`` its cache."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    if cache is not None:
        env["VOLCONV_CACHE_DIR"] = str(cache)
    t = time.perf_counter()
    done = subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, cwd=OUTSIDE, env=env)  # fmt: skip
    return time.perf_counter() - t, done.stderr


def one_run(cmd: list[str], report: Path, tree: Path, cache: Path) -> dict:
    seconds, said = timed([*cmd, "--report", str(report)], tree, cache)
    doc = json.loads(report.read_text())
    return {
        "process": seconds,
        "input_wall": doc["inputs"][0]["stages"]["wall"],
        "run_wall": doc["run_seconds"],
        "minus_input": seconds - doc["inputs"][0]["stages"]["wall"],
        "minus_run": seconds - doc["run_seconds"],
        "start": doc.get("start_seconds"),
        "built_kernels": "building kernels" in said,
    }


# Noted by the timed process (scripts/bench/start.py --timeline): where it was when each of
# these began to import, and when it called os._exit; written as JSON to $VOLCONV_TIMELINE.
WATCHED = (
    "numpy", "pyopencl", "typer", "rich.console", "h5py", "volconv.commands", "volconv.config",
    "volconv.console", "volconv.run.pipeline", "volconv.output",
)  # fmt: skip
SITECUSTOMIZE = f"""
import json, os, sys, time
_noted = {{"site": time.perf_counter()}}
try:
    with open("/proc/self/stat") as _f:
        _ticks = int(_f.read().rsplit(")", 1)[1].split()[19])
    _noted["proc_start"] = _noted["site"] - (time.clock_gettime(time.CLOCK_BOOTTIME)
                                             - _ticks / os.sysconf("SC_CLK_TCK"))
except (OSError, ValueError, IndexError):
    pass
class _Noting:
    def find_spec(self, name, path=None, target=None):
        if name in {WATCHED!r} and name not in _noted:
            _noted[name] = time.perf_counter()
        return None
sys.meta_path.insert(0, _Noting())
_exit, _pid = os._exit, os.getpid()
def _noted_exit(code):
    if os.getpid() == _pid:  # not a child it forked (volconv.device.driver.leave)
        _noted["exit"] = time.perf_counter()
        with open(os.environ["VOLCONV_TIMELINE"], "w") as f:
            json.dump(_noted, f)
    _exit(code)
os._exit = _noted_exit
"""


def timeline_run(cmd: list[str], report: Path, cache: Path) -> dict:
    """One process of this checkout, split by the sitecustomize's notes (ms from its spawn)."""
    folder = Path(tempfile.mkdtemp(prefix="volconv-timeline-"))
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(folder), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ, "VOLCONV_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(path),
        "VOLCONV_TIMELINE": str(folder / "noted.json"),
    }  # fmt: skip
    spawned = time.perf_counter()
    subprocess.run([*cmd, "--report", str(report)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=OUTSIDE, env=env)  # fmt: skip
    ended = time.perf_counter()
    noted = json.loads((folder / "noted.json").read_text())
    doc = json.loads(report.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    t0 = noted.get("proc_start", spawned)
    run_begins = t0 + doc["start_seconds"]
    run_ends = run_begins + doc["run_seconds"]
    ms = {f"import {k}": (v - spawned) * 1000 for k, v in noted.items() if k in WATCHED}
    return {
        "process": (ended - spawned) * 1000,
        "to_site": (noted["site"] - spawned) * 1000,
        **dict(sorted(ms.items(), key=lambda kv: kv[1])),
        "run_begins": (run_begins - spawned) * 1000,
        "run": doc["run_seconds"] * 1000,
        "after_run": (noted["exit"] - run_ends) * 1000,
        "exit": (ended - noted["exit"]) * 1000,
    }


def summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("process", "input_wall", "minus_input", "minus_run", "start"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[f"{key}_median"] = statistics.median(values)
            out[f"{key}_min"] = min(values)
    return out


def import_times(cmd: list[str], tree: Path, cache: Path) -> list[tuple[str, float]]:
    """The run's imports by cumulative time (ms): the top level's and theirs."""
    _, said = timed([cmd[0], "-X", "importtime", *cmd[1:]], tree, cache)
    rows = []
    for line in said.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cumulative, name = line.split("|")
            if (len(name) - len(name.lstrip()) - 1) // 2 > 1:
                continue  # what the program imports, and what those import themselves
            rows.append((name.strip(), int(cumulative) / 1000))
    return sorted(rows, key=lambda r: -r[1])[:20]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pipeline")
    ap.add_argument("--before", default=None, help="a tree with volconv/ and kernels/")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another tree, run in turn with these (repeatable)")  # fmt: skip
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline", type=int, default=0, metavar="R",
                    help="R more processes of this checkout, split by where time goes")  # fmt: skip
    a = ap.parse_args()
    pipeline = str(Path(a.pipeline).resolve())  # the processes run in OUTSIDE
    dev = ["--device", a.device] if a.device else []
    report = Path(tempfile.mkdtemp()) / "report.json"
    cmd = [sys.executable, "-m", "volconv", "run", pipeline, "--overwrite", *dev]
    trees = {"after": HERE}
    if a.before:
        trees = {"before": Path(a.before).resolve(), **trees}
    for given in a.tree:
        name, _, folder = given.partition("=")
        trees[name] = Path(folder).resolve()
    # a cache folder per tree (programs, the start record: another tree's record would name
    # its programs and buffers), each with the FMA probe's rates where they are cached
    caches = {name: Path(tempfile.mkdtemp(prefix=f"volconv-start-{name}-")) for name in trees}
    peak = Path(os.environ.get("VOLCONV_CACHE_DIR") or Path.home() / ".cache/volconv") / "peak.json"
    for name, tree in trees.items():  # the caches filled (programs, start), compiled modules
        if peak.is_file():
            shutil.copyfile(peak, caches[name] / "peak.json")
            os.chmod(caches[name] / "peak.json", 0o600)
        timed(cmd, tree, caches[name])
    out: dict = {
        "command": " ".join(cmd[1:]),
        "trees": {k: str(v) for k, v in trees.items()},
        "python_pass": min(timed([sys.executable, "-c", "pass"])[0] for _ in range(3)),
        "help": min(timed([sys.executable, "-m", "volconv", "--help"], HERE)[0] for _ in range(3)),
        "runs": {k: [] for k in trees},
    }
    for _ in range(a.repeats):  # alternately, so that the machine's load falls on both
        for name, tree in trees.items():
            out["runs"][name].append(one_run(cmd, report, tree, caches[name]))
    out["summary"] = {name: summary(runs) for name, runs in out["runs"].items()}
    out["imports_after"] = import_times(cmd, HERE, caches["after"])
    if a.timeline:
        runs = [timeline_run(cmd, report, caches["after"]) for _ in range(a.timeline)]
        out["timeline"] = {"runs": runs, "median_ms": {
            k: statistics.median(r[k] for r in runs if k in r) for k in runs[-1]}}  # fmt: skip
    for name, figures in out["summary"].items():
        shown = "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in figures.items() if "median" in k)
        print(f"{name:<7} {shown}")
    print(f"python -c pass {out['python_pass'] * 1000:.0f} ms, --help {out['help'] * 1000:.0f} ms")
    for name, ms in out["imports_after"][:8]:
        print(f"{ms:8.1f} ms  import {name}")
    for name, ms in out.get("timeline", {}).get("median_ms", {}).items():
        print(f"timeline {name:<28} {ms:8.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    for folder in caches.values():
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
