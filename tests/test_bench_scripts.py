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


def _bench_long_copy(tmp_path, monkeypatch, isa: str):
    """A copy of ``bench_long.py`` (and ``common.py``) in ``tmp_path``, imported, as on a
    CPU with vector instructions ``isa``: its figure lands there, not in benchmarks/."""
    import importlib.util

    for name in ("bench_long.py", "common.py"):
        (tmp_path / name).write_text((ROOT / "benchmarks" / name).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location(f"bench_long_{isa}", tmp_path / "bench_long.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "isa", lambda: isa)
    return bench


def test_bench_long_repeats_report_medians_and_each_turns_ratio(tmp_path, monkeypatch, capsys):
    """``bench_long.py --repeats 3`` runs the modes in turn and reports each mode's median
    pass with each turn's own ratio to its bare pass, under a key of its own. The passes
    (each a subprocess loading the model, ~20 s) are given here, so the table, the record
    and the figure are checked in-process; a copy of the script runs, so its figure lands
    in ``tmp_path``."""
    bench = _bench_long_copy(tmp_path, monkeypatch, "avx512")
    seconds = {"bare": iter([50.0, 60.0, 52.0]), "all": iter([65.0, 66.0, 80.0])}
    order = []

    def measure(args, mode, n):
        order.append(mode)
        s = next(seconds[mode])
        return {"mode": mode, "tokens": n - 1, "seconds": s, "cpu_seconds": s, "peak_mb": s * 10}

    results = tmp_path / "results.json"
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "record", lambda key, device, rows: results.write_text(
        json.dumps({"key": key, "rows": rows})))  # fmt: skip
    argv = ["bench_long.py", "--lengths", "8192", "--modes", "bare,all", "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    assert order == ["bare", "all"] * 3  # the modes in turn, not one mode's passes in a row
    data = json.loads(results.read_text())
    assert data["key"] == "bench_long_8192_x3"
    (row,) = data["rows"]
    assert row["values"]["bare"]["seconds"] == 52.0 and row["values"]["all"]["seconds"] == 66.0
    assert len(row["values"]["turns"]) == 3
    # ratio of the medians 66/52, each turn's own: 65/50, 66/60, 80/52, lowest first
    assert "time 1.27x" in row["result"] and "each turn: 1.10x, 1.30x, 1.54x" in row["result"]
    assert row["target"] == "memory <= 1.1x, time <= 1.2x at 8,192" and row["met"] is False
    assert "medians of 3 turns" in row["what"]
    assert capsys.readouterr().out.count("    all ") == 4  # three passes and the median
    assert (tmp_path / "long_8192.png").exists()


def test_bench_long_without_a_bare_pass_records_the_passes_alone(tmp_path, monkeypatch):
    """``--modes all`` (no bare pass to divide by) records the pass's seconds and memory
    with no ratio and no verdict (it raised KeyError at its end, after every pass had
    run), under a key of its own on an AVX2-only CPU."""
    bench = _bench_long_copy(tmp_path, monkeypatch, "avx2")

    def measure(args, mode, n):
        return {
            "mode": mode,
            "tokens": n - 1,
            "seconds": 76.2,
            "cpu_seconds": 76.0,
            "peak_mb": 1080,
        }

    results = tmp_path / "results.json"
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "record", lambda key, device, rows: results.write_text(
        json.dumps({"key": key, "rows": rows})))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["bench_long.py", "--lengths", "8192", "--modes", "all"])
    bench.main()
    data = json.loads(results.read_text())
    assert data["key"] == "bench_long_8192_avx2"  # an AVX2-only CPU's record of its own
    (row,) = data["rows"]
    assert row["result"] == "76.2 s, 1080 MB (no bare pass to compare)"
    assert row["met"] is None and row["target"] == ""
