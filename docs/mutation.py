"""The mutation record of the core: a seeded sample of mutmut's mutants, scored and committed.

mutmut (pinned in the Makefile) changes one operator, constant or call at a time in the
modules ``[tool.mutmut] only_mutate`` names (pyproject.toml: classification/, headtypes/,
stream/) and runs the fast tests of ``pytest_add_cli_args_test_selection`` that cover the
changed function; a mutant no test fails *survives*. Every mutant of the core takes hours
on two cores, so this script

1. generates all mutants (mutmut's own generation, only lines the selection covers);
2. draws a uniform sample of ``--n`` of them with ``--seed`` (the score's binomial standard
   error is printed beside it);
3. runs ``mutmut run <the sample>``;
4. writes ``docs/mutation.json``: the commit, mutmut's version, the scope and the test
   selection (copied from pyproject.toml, so tests/test_mutation_record.py can tell a
   record of another configuration), the counts by status, the score and every survivor
   with its diff;
5. exits 1 when the score is below ``--threshold`` (0.85).

The score is killed / sampled (the drawn mutants mutmut ran; a stopped run's record,
``--record-only``, names those it did not reach, which are the slowest: mutmut runs the
cheapest first): a timeout counts as killed (the mutant hangs a test), a
mutant no selected test covers and a suspicious one count as survivors. It is scored
before any test it prompts is written: kill tests written afterwards go in
tests/test_mutants.py and the next record scores them.

Run: ``make mutation`` (MUTATION_N=..., MUTATION_SEED=...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "mutation.json"
KILLED = {"killed", "timeout", "caught by type check"}


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def _mutmut(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(exe), *args], cwd=ROOT, text=True, capture_output=True)


def _statuses() -> dict[str, str]:
    """Every generated mutant's name -> its status (``not checked`` before a run)."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    out: dict[str, str] = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        out.update({k: status_by_exit_code[v] for k, v in data.exit_code_by_key.items()})
    return out


def _generate() -> None:
    """mutmut's generation step alone (no test run but the coverage of covered lines)."""
    from mutmut.__main__ import create_mutants, store_lines_covered_by_tests
    from mutmut.mutation.trampoline import set_mutant_under_test
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths

    set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    store_lines_covered_by_tests()
    create_mutants(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="mutants to sample (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=0.85)
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="delete mutants/ first")
    ap.add_argument(
        "--record-only",
        action="store_true",
        help="write the record from the results mutants/ holds (a run stopped part way: "
        "the sample's mutants not run yet are counted and named as not checked)",
    )
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    if args.fresh and Path("mutants").exists():
        shutil.rmtree("mutants")
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, capture_output=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--", "headmech", "tests"],
            cwd=ROOT,
            text=True,
            capture_output=True,
        ).stdout.strip()
    )
    _generate()
    names = sorted(_statuses())
    sample = sorted(random.Random(args.seed).sample(names, min(args.n, len(names))))
    print(f"{len(names)} mutants generated; running a sample of {len(sample)} (seed {args.seed})")
    if not args.record_only:
        run = _mutmut("run", "--max-children", str(args.max_children), *sample)
        if run.returncode != 0:
            # mutmut prints a spinner; its own pytest output is only in a rerun with debug
            print(run.stdout[-2000:], run.stderr[-2000:], sep="\n")
            print(
                "mutmut run failed (often: a test of the selection fails under mutmut; "
                "run the selection's pytest command in mutants/ to see which)",
                file=sys.stderr,
            )
            return 2
    status = {k: v for k, v in _statuses().items() if k in set(sample)}
    unchecked = sorted(k for k, v in status.items() if v == "not checked")
    status = {k: v for k, v in status.items() if v != "not checked"}
    counts = Counter(status.values())
    killed = sum(n for s, n in counts.items() if s in KILLED)
    score = killed / max(len(status), 1)
    se = math.sqrt(score * (1 - score) / max(len(status), 1))
    survivors = [
        {"mutant": k, "status": s, "diff": _mutmut("show", k).stdout.strip()}
        for k, s in sorted(status.items())
        if s not in KILLED
    ]
    cfg = _config()
    record = {
        "commit": commit,
        "dirty": dirty,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "mutmut": version("mutmut"),
        "scope": cfg["only_mutate"],
        "selection": cfg["pytest_add_cli_args_test_selection"],
        "pytest_args": cfg["pytest_add_cli_args"],
        "mutants": len(names),
        "drawn": len(sample),
        "sampled": len(status),
        "not_checked": unchecked,
        "seed": args.seed,
        "counts": dict(sorted(counts.items())),
        "killed": killed,
        "score": round(score, 4),
        "standard_error": round(se, 4),
        "threshold": args.threshold,
        "survivors": survivors,
    }
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"score {score:.1%} ± {se:.1%} ({killed} of {len(status)} sampled killed; "
        f"{len(names)} mutants in all); {len(survivors)} survivors in {RECORD.relative_to(ROOT)}"
    )
    if score < args.threshold:
        print(f"mutation score {score:.1%} is below the threshold {args.threshold:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
