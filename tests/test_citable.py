"""headmech can be cited: a licence, CITATION.cff, and the git commit in every result."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import tomllib
import yaml

import headmech
from headmech.runs import provenance

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_the_declared_one():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "MIT" and text.startswith("MIT License")
    assert "headmech contributors" in text


def test_citation_cff_is_valid_and_current():
    """The fields CFF 1.2.0 requires, the package's version, a real date."""
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert {"message", "title", "authors"} <= set(cff)
    assert cff["authors"] == [{"name": "headmech contributors"}]
    assert cff["version"] == headmech.__version__
    assert datetime.date.fromisoformat(cff["date-released"]) <= datetime.date.today()
    assert cff["license"] == "MIT"


def test_git_commit_is_this_checkout():
    record = provenance.git_commit()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert record is not None and record["commit"] == head and len(head) == 40
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", "headmech"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert record["dirty"] == (status.strip() != "")


def test_git_commit_is_null_without_git(monkeypatch):
    provenance.git_commit.cache_clear()
    monkeypatch.setenv("PATH", "")  # no git executable: None, not an error
    try:
        assert provenance.git_commit() is None
    finally:
        provenance.git_commit.cache_clear()


def test_git_commit_is_null_outside_a_checkout(monkeypatch):
    """A repository that merely contains the package (a venv inside a project) is not
    headmech's checkout."""

    def elsewhere(args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout="/some/other/repo\n", stderr="")

    provenance.git_commit.cache_clear()
    monkeypatch.setattr(provenance.subprocess, "run", elsewhere)
    try:
        assert provenance.git_commit() is None
    finally:
        provenance.git_commit.cache_clear()


def test_every_provenance_records_the_commit(tiny_models):
    model = next(iter(tiny_models.values()))
    record = provenance.provenance(model)
    assert record["versions"]["headmech_git"] == provenance.git_commit()
    assert record["versions"]["headmech_git"]["commit"]  # this suite runs from a checkout
