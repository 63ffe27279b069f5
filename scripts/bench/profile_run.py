"""Where a run's time goes, thread by thread: `volconv run` in this process while a sampler
thread looks at every other thread's stack each millisecond (py-spy's idea, without py-spy).

    python scripts/bench/run.py profile_run pipelines/demo.toml --device nvidia \\
        --set output.dtype=float16

It runs the pipeline once to warm up (imports, context, programs), then once sampled, and
prints for each thread (the run, its inputs, the reader, the writer, the encoders) the share
of the run's wall it spent in each place: the innermost frame of volconv's own code, and the
innermost frame of all (a C call shows as the Python function that made it: an h5py write,
an OpenCL wait, a lock). ``--json`` saves the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path


def where(frame, own: bool) -> str:
    """The innermost frame (of volconv's code, if ``own``) as ``file:function``."""
    f = frame
    while own and f is not None and "volconv" not in f.f_code.co_filename:
        f = f.f_back
    f = f or frame
    return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pipeline", type=Path)
    p.add_argument("--set", action="append", default=[], dest="sets")
    p.add_argument("--device", default=None)
    p.add_argument("--interval", type=float, default=0.001, help="seconds between samples")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from volconv.config import load
    from volconv.run.pipeline import run

    cfg = load(args.pipeline, args.sets, device=args.device)
    run(cfg, overwrite=True)  # warm
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    stop = threading.Event()
    main_ident = threading.get_ident()  # it waits for the run's thread (Ctrl-C)

    def sample() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident in (me, main_ident):
                    continue
                name = names.get(ident, str(ident))
                counts[name][where(frame, False)] += 1
                own[name][where(frame, True)] += 1
            time.sleep(args.interval)

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    sampler.start()
    t = time.perf_counter()
    result = run(cfg, overwrite=True)
    wall = time.perf_counter() - t
    stop.set()
    sampler.join()
    samples = max((sum(c.values()) for c in counts.values()), default=1)
    print(f"run: {wall:.3f} s, {len(result.reports)} input(s); "
          f"stages of the first: {result.reports[0].stages}")  # fmt: skip
    doc = {"wall_seconds": wall, "stages": [r.stages for r in result.reports], "threads": {}}
    for name in sorted(counts):
        n = sum(counts[name].values())
        print(f"\n{name}: {n} samples ({n / samples:.0%} of the longest-lived thread's)")
        for label, c in (("volconv", own[name]), ("innermost", counts[name])):
            top = c.most_common(args.top)
            print(f"  {label}: " + ", ".join(f"{k} {v / n:.0%}" for k, v in top))
        doc["threads"][name] = {"samples": n, "volconv": dict(own[name].most_common(args.top)),
                                "innermost": dict(counts[name].most_common(args.top))}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
