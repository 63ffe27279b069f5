"""Summarise Nsight Compute's SASS page (``ncu -i R --page source --print-source sass --csv``):
warp stall samples by reason, with the opcodes that gather most of each, and the executed
instructions and shared-memory wavefronts by opcode.

    python3 scripts/bench/run.py ncu_stalls prof0-sass.csv [more.csv ...]
"""

from __future__ import annotations

import csv
import re
import sys
from collections import Counter, defaultdict


def opcode(source: str) -> str:
    """The opcode of a SASS line, its predicate dropped."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split()[0] if text else "?"


def summarise(path: str, top: int = 12) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    totals: Counter = Counter()
    by_reason: dict[str, Counter] = defaultdict(Counter)
    executed: Counter = Counter()
    wavefronts: Counter = Counter()
    for row in rows[2:]:
        if len(row) < len(header):
            continue
        op = opcode(row[col["Source"]])
        executed[op] += int(row[col["Instructions Executed"]] or 0)
        wavefronts[op] += int(row[col["L1 Wavefronts Shared"]] or 0)
        for reason in reasons:
            n = int(row[col[reason]] or 0)
            totals[reason] += n
            by_reason[reason][op] += n
    samples = sum(totals.values())
    print(f"{path}: {samples} stall samples")
    for reason, n in totals.most_common(10):
        ops = ", ".join(f"{o} {100 * c / samples:.1f}" for o, c in by_reason[reason].most_common(4))
        print(f"  {reason:24s} {100 * n / samples:5.1f} %  top: {ops}")
    print("  executed (warp instructions) and shared wavefronts by opcode:")
    for op, n in executed.most_common(top):
        print(f"    {op:28s} {n:12d} {wavefronts[op]:12d}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        summarise(name)
