"""The committed mutation record (docs/mutation.json, written by docs/mutation.py) is a record
of today's configuration and reaches its threshold.

The record is measured by ``make mutation`` (about an hour), not here; these tests fail when
the record is missing, was measured on another scope or test selection than pyproject.toml's
``[tool.mutmut]``, is below the 85% the core must reach, or does not add up.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "docs" / "mutation.json").read_text())
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
CORE = {"headmech/classification/*", "headmech/headtypes/*", "headmech/stream/*"}


def test_the_record_is_of_this_configuration() -> None:
    assert RECORD["scope"] == CONFIG["only_mutate"]
    assert RECORD["selection"] == CONFIG["pytest_add_cli_args_test_selection"]
    assert RECORD["pytest_args"] == CONFIG["pytest_add_cli_args"]
    assert set(CONFIG["only_mutate"]) >= CORE  # the core is in scope
    for test_file in RECORD["selection"]:
        assert (ROOT / test_file).is_file(), test_file
    assert re.fullmatch(r"[0-9a-f]{40}", RECORD["commit"])


def test_mutmut_is_pinned_to_the_recorded_version() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert f'"mutmut=={RECORD["mutmut"]}"' in makefile
    assert "|| true" not in makefile.split("\nmutation:")[1].split("\n\n")[0]


def test_the_score_reaches_the_threshold_and_adds_up() -> None:
    assert RECORD["threshold"] >= 0.85
    assert RECORD["sampled"] >= 200 and RECORD["drawn"] <= RECORD["mutants"]
    assert RECORD["sampled"] + len(RECORD["not_checked"]) == RECORD["drawn"]
    assert sum(RECORD["counts"].values()) == RECORD["sampled"]
    killed = sum(
        n for s, n in RECORD["counts"].items() if s in {"killed", "timeout", "caught by type check"}
    )
    assert killed == RECORD["killed"]
    assert len(RECORD["survivors"]) == RECORD["sampled"] - killed
    assert abs(RECORD["score"] - killed / RECORD["sampled"]) < 1e-4
    assert RECORD["score"] >= RECORD["threshold"]
    for s in RECORD["survivors"]:  # each survivor is listed with the change it made
        assert s["mutant"].startswith("headmech.") and s["diff"], s
