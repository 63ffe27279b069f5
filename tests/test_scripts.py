"""scripts/bench/run.py, the one runner of the maintained benchmarks: it lists every benchmark
in scripts/bench/ and on the GPU node, runs one with its own arguments (its helpers imported
from beside it), and names the closest for a name it lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "scripts" / "bench" / "run.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RUN), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_lists_every_benchmark_with_its_first_line():
    listed = run()
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    bench = ROOT / "scripts" / "bench"
    names = {p.stem for p in bench.glob("*.py")} - {"run"}
    names |= {f"gpu/{p.stem}" for p in (bench / "gpu").glob("*.sh")}
    assert names <= set(lines), names - set(lines)
    assert "session" in names and "gpu/throughput" in names
    assert "tensor-core engine" in lines["tensor"]


def test_runs_a_benchmark_with_its_arguments_and_sibling_imports():
    # tensor_types imports its reference from tensor.py beside it
    done = run("tensor_types", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: tensor_types.py" in done.stdout and "--float-digits" in done.stdout


def test_an_unknown_name_is_exit_2_with_the_closest():
    done = run("tensr")
    assert done.returncode == 2
    assert "did you mean tensor" in done.stderr
