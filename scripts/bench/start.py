"""Where a `volconv run` process spends its time before and after the in-run wall.

    python scripts/bench/run.py start PIPELINE [--device D] [--repeats R] [--json OUT.json]

Runs, in one go: `python -c pass`, `volconv --help`, the whole `volconv run --overwrite`
process (once to fill caches, then R times replacing its output, R times with the output
removed beforehand; minima are kept), and then the same run phase by
phase in this process (each import, load, device, plan, peaks, program build, the run
itself), so the gap between the process and the in-run wall can be read off. Prints a
table; ``--json`` saves it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The processes run outside the checkout: `python -m` puts the working folder first on
# sys.path, where the checkout's volconv would shadow the one PYTHONPATH names (a "before"
# tree profiled beside it).
OUTSIDE = tempfile.gettempdir()


def process_seconds(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=OUTSIDE)  # fmt: skip
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pipeline")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.pipeline = str(Path(a.pipeline).resolve())  # the processes run in OUTSIDE
    dev = ["--device", a.device] if a.device else []
    report = Path(tempfile.mkdtemp()) / "report.json"
    cmd = [sys.executable, "-m", "volconv", "run", a.pipeline, "--overwrite", *dev]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=OUTSIDE)  # caches
    runs = range(a.repeats)
    out: dict = {"python_pass": min(process_seconds([sys.executable, "-c", "pass"]) for _ in runs)}
    out["help"] = min(process_seconds([sys.executable, "-m", "volconv", "--help"]) for _ in runs)
    walls, first = [], []
    for _ in runs:  # the process's and its own in-run wall, pairwise
        seconds = process_seconds([*cmd, "--report", str(report)])
        doc = json.loads(report.read_text())
        walls.append((seconds, doc["total"]["wall_seconds"]))
        first.append(seconds - doc["inputs"][0]["stages"]["wall"])
    out["process"], out["in_run_wall"] = min(w[0] for w in walls), min(w[1] for w in walls)
    out["process_minus_in_run_each"] = sorted(p - w for p, w in walls)
    # as scripts/bench/e2e.py reports it: the process less its first input's own wall (the
    # convolvers' making counts as start there)
    out["process_minus_first_input_wall"] = min(first)
    outputs = [Path(r["output"]) for r in json.loads(report.read_text())["inputs"]]
    fresh = []
    for _ in runs:  # the same with no old output to replace (removed beforehand, untimed)
        for path in outputs:
            path.unlink(missing_ok=True)
        fresh.append((process_seconds([*cmd, "--report", str(report)]),
                      json.loads(report.read_text())["total"]["wall_seconds"]))  # fmt: skip
    out["process_no_old_output"] = min(w[0] for w in fresh)
    out["in_run_wall_no_old_output"] = min(w[1] for w in fresh)

    phases: dict[str, float] = {}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now

    import numpy  # noqa: F401

    mark("import numpy")
    import pyopencl  # noqa: F401

    mark("import pyopencl")
    from volconv.device import programs

    started = hasattr(programs, "start_driver")  # volconv starts the driver ahead
    if started:
        programs.start_driver()
        mark("start the driver (in the background)")
    import h5py  # noqa: F401

    mark("import h5py")
    import volconv.cli  # noqa: F401

    mark("import volconv.cli (typer, rich)")
    from volconv import config, console, pipeline  # noqa: F401

    mark("import volconv.config, pipeline, console")
    cfg = config.load(a.pipeline, (), device=a.device)
    mark("load pipeline")
    device = pipeline.choose_device(cfg)
    mark("choose device (platforms, or the wait for them)")
    if started:
        programs.start_context(device)
    else:
        programs.context_for(device)
    mark("context (started in the background, or made)")
    jobs = pipeline.plan_jobs(cfg, device, overwrite=True, report=None)
    mark("plan jobs")
    result = pipeline.RunResult(device, *pipeline.peaks(device))
    mark("peaks (cache)")
    convolvers = pipeline.Convolvers(cfg, device)
    for job in jobs:
        convolvers.get(job)
    mark("context taken, programs, pinned buffers (the first only, in the background, if lazy)")
    for job in jobs:
        convolvers.get(job)[0].pinned_slab()
    mark("one more pinned slab buffer per convolver (its share of the line above)")
    for job in jobs:
        pipeline.run_one(cfg, job, convolvers, result, overwrite=True)
    mark("run (in-run walls; nibabel's import, where the inputs need it)")
    out["phases"] = phases
    # what the run itself imported beyond the phases above (nibabel: inputs a plain .nii is
    # not; the others never belong to a run)
    watched = ("nibabel", "matplotlib", "scipy", "rich.progress", "tomli_w")
    out["imported_by_the_run"] = sorted(m for m in watched if m in sys.modules)
    out["process_minus_in_run"] = out["process"] - out["in_run_wall"]
    out["process_no_old_output_minus_in_run"] = (
        out["process_no_old_output"] - out["in_run_wall_no_old_output"]
    )
    out["process_minus_in_run_minus_pass"] = out["process_minus_in_run"] - out["python_pass"]
    for k, v in phases.items():
        print(f"{v * 1000:8.1f} ms  {k}")
    for k in ("python_pass", "help", "process", "in_run_wall", "process_minus_in_run",
              "process_minus_first_input_wall", "process_no_old_output",
              "in_run_wall_no_old_output"):  # fmt: skip
        print(f"{out[k] * 1000:8.1f} ms  {k}")
    print(
        f"imported by the run: {', '.join(out['imported_by_the_run']) or 'none of'} "
        "(nibabel, matplotlib, scipy, rich.progress, tomli_w)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
