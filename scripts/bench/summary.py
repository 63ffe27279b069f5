"""Print the summary and every point of `volconv bench` JSON files; optionally plot them.

python scripts/bench/run.py summary [--plot PREFIX] RESULT.json...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from volconv.bench import point_line, summary, write_plots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON written by volconv bench")
    parser.add_argument("--plot", help="also draw PREFIX-n.png and PREFIX-unroll.png")
    args = parser.parse_args()
    for path in args.results:
        result = json.loads(path.read_text())
        print(f"# {path}")
        print(summary(result))
        for section in ("sweep_n", "sweep_unroll"):
            print(f"\n{section}")
            for p in result.get(section, []):
                print(f"  {point_line(p)}")
        if args.plot:
            for png in write_plots(result, args.plot):
                print(f"wrote {png}")
        print()


if __name__ == "__main__":
    main()
