"""The coverage floor CI enforces (``make test COVERAGE=1``): lines and branches of
``headmech/`` separately, from coverage.py's JSON report. Exit 1, in one line, below it.

Measured when the floor was set (2026-11-27, 1,317 tests, a fresh clone's ``.ci/run``):
96.0% of lines and 87.6% of branches, the processes the tests start included (coverage's
``patch = subprocess``: torchrun ranks, ``python -m headmech``; not the notebook kernels).
The floor sits half a point under, so a change that leaves new code untested fails CI;
raise it as tests reach more.

Usage: ``python tests/coverage_floor.py coverage.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LINES = 95.5  # percent of statements
BRANCHES = 87.1  # percent of branch destinations


def main(path: str) -> int:
    totals = json.loads(Path(path).read_text())["totals"]
    lines = 100.0 * totals["covered_lines"] / max(totals["num_statements"], 1)
    branches = 100.0 * totals["covered_branches"] / max(totals["num_branches"], 1)
    print(
        f"coverage of headmech/: lines {lines:.1f}% (floor {LINES:g}%), "
        f"branches {branches:.1f}% (floor {BRANCHES:g}%)"
    )
    low = [
        f"{what} {got:.1f}% < {floor:g}%"
        for what, got, floor in (("lines", lines, LINES), ("branches", branches, BRANCHES))
        if got < floor
    ]
    if low:
        print(f"coverage below the floor: {', '.join(low)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "coverage.json"))
