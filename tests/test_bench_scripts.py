"""The benchmark scripts that the GPU machine runs, run end to end on the CPU first.

Device time is scarce (minutes a session, not every session): a script that crashes
after the model is built wastes it. ``benchmarks/bench_call.py`` builds a random-weight
model of SmolLM2's shape, checks the point, row and maxima routes against the eager
weights, then times each mode; here at short lengths, into a results file of the test's
own (``$HEADMECH_BENCH_RESULTS``), and its agreement figures must hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_call_runs_and_its_routes_agree(tmp_path):
    results = tmp_path / "results.json"
    env = {**os.environ, "HEADMECH_BENCH_RESULTS": str(results)}
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_call.py"), "--threads", "1",
        "--check-length", "65", "--lengths", "129", "--modes", "bare,all,maxima",
        "--init", "0.1",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(results.read_text())
    (key,) = [k for k in data["runs"] if k.startswith("bench_call_smollm2-135m_cpu")]
    rows = data["runs"][key]["rows"]
    assert {r["values"]["tokens"] for r in rows} == {129}
    assert {m for r in rows for m in ("all", "maxima") if m in r["values"]} == {"all", "maxima"}
    agreement = rows[0]["values"]["agreement"]
    # each route against the eager attention weights and against each other
    assert agreement["points-eager induction.mass"] < 1e-4
    assert agreement["points-eager duplicate.mass"] < 1e-4
    assert agreement["rows-eager confidence.max"] < 1e-4
    assert agreement["maxima-eager confidence.max"] < 1e-4
    assert agreement["all statistics"] > 10
    assert max(v for k, v in agreement.items() if k.startswith("points-blocks")) < 1e-4
