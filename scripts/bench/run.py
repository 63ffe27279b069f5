"""The one runner of volconv's maintained benchmarks (benchmarks/README.md: what each measures,
how, and the figures it gave).

    python scripts/bench/run.py                    # list them
    python scripts/bench/run.py NAME [ARGS...]     # run scripts/bench/NAME.py; NAME --help
    python scripts/bench/run.py gpu/NAME [ARGS...] # bash scripts/bench/gpu/NAME.sh ($OUT set)

A benchmark is any scripts/bench/NAME.py: adding one is adding the file (its docstring's first
line is what the list shows). Each runs as if started alone (``__main__``), with this folder
first on ``sys.path`` so that benchmarks share helpers (``from tensor import Reference``).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from difflib import get_close_matches
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """NAME -> the first line of its docstring, for every benchmark here and on the GPU node."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name != "run.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    for path in sorted((HERE / "gpu").glob("*.sh")):
        lines = [line[2:] for line in path.read_text().splitlines()[:4] if line.startswith("# ")]
        found[f"gpu/{path.stem}"] = lines[0] if lines else ""
    return found


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        width = max(map(len, known))
        for name, line in known.items():
            print(f"  {name:<{width}}  {line}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in known:
        close = get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        print(f"no benchmark {name!r}{hint} (run.py lists them)", file=sys.stderr)
        return 2
    if name.startswith("gpu/"):
        script = HERE / "gpu" / f"{name[4:]}.sh"
        os.execvp("bash", ["bash", str(script), *args])
    script = HERE / f"{name}.py"
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the benchmark's own exit status (a message: printed, status 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
