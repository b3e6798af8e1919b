"""The headmech command: outputs, files and one-line errors with non-zero exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from headmech.classification.claims import control_space
from headmech.classification.records import TypeValidation
from headmech.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_models_and_types(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "minilm-l6" in out and "smollm2-135m" in out and "toy-induction" in out
    code, out, _ = run(capsys, "types")
    assert code == 0 and "previous_token" in out and "Olsson et al. 2022" in out


def test_classify_writes_catalog_and_heatmap(capsys, tiny_dirs, tmp_path):
    code, out, _ = run(
        capsys,
        "classify",
        str(tiny_dirs["llama"]),
        "--types",
        "previous_token",
        "--out",
        str(tmp_path),
        "--n-sentences",
        "12",
        "--batch-size",
        "4",
    )
    assert code == 0, out
    data = json.loads((tmp_path / "catalog.json").read_text())
    assert data["model"] == {"name": "tiny-llama", "n_layers": 2, "n_heads": 4}
    t = data["types"]["previous_token"]
    assert len(t["score"]) == 2 and all(len(row) == 4 for row in t["score"])
    assert all(0.0 <= v <= 1.0 for row in t["score"] for v in row)
    assert t["threshold"] == 0.5 and isinstance(t["heads"], list)
    assert (tmp_path / "heatmap.png").stat().st_size > 1000
    assert "previous_token" in out


def test_classify_takes_a_threshold_per_type(capsys, tmp_path):
    """``--threshold TYPE=VALUE``, repeatable or comma-separated, as ``thresholds=`` in
    Python; recorded in the catalog's provenance. On the toy, previous_token (measured on
    prose) is skipped by default, and so is its threshold."""
    from headmech.classification.spec import PARAMETERS

    def _thresholds(values, _):
        return PARAMETERS["thresholds"].parse(values, "--threshold")

    code, out, err = run(
        capsys, "classify", "toy-induction", "--n-sequences", "4", "--out", str(tmp_path),
        "--threshold", "induction=0.3", "--threshold", "previous_token=0.2",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads((tmp_path / "catalog.json").read_text())
    assert data["types"]["induction"]["threshold"] == 0.3
    assert data["types"]["duplicate_token"]["threshold"] == 0.4  # its default
    assert data["provenance"]["settings"]["thresholds"] == {"induction": 0.3}
    assert re.search(r"^skipped (\d+ types \(.*)?previous_token", out, re.M), out[-400:]
    both = {"induction": 0.3, "duplicate_token": 0.5}
    assert _thresholds(["induction=0.3,duplicate_token=0.5"], None) == both
    assert _thresholds(["induction=0.3", " duplicate_token = 0.5 "], None) == both


def test_help_everywhere():
    for argv in (["--help"], ["classify", "--help"], ["models", "--help"], ["types", "--help"]):
        r = subprocess.run(
            [sys.executable, "-m", "headmech.cli", *argv], capture_output=True, text=True
        )
        assert r.returncode == 0 and "usage: headmech" in r.stdout


@pytest.mark.parametrize("model", ["bert", "toy-induction"])
def test_classify_validate_and_evidence(capsys, tiny_dirs, tmp_path, model):
    """--validate on an encoder (random tiny BERT: no labelled heads, the clean distortion
    is 0) and on the trained toy decoder, whose induction and duplicate-token heads are
    labelled (its duplicate-token heads are not): each labelled set gets control sets from the same layers (relabellings: never the set itself, never a head that may be of the type), and the
    printed evidence shows each type's validation line."""
    from headmech.cli.report import validation_line

    if model == "bert":
        argv = [
            str(tiny_dirs["bert"]),
            "--types",
            "syntactic,previous_token",
            "--n-sentences",
            "24",
        ]
    else:
        argv = [model, "--types", "induction,duplicate_token", "--n-sequences", "8"]
    argv += ["--out", str(tmp_path), "--validate", "--n-random", "2", "--seed", "1"]
    code, out, _ = run(capsys, "classify", *argv)
    assert code == 0, out
    data = json.loads((tmp_path / "catalog.json").read_text())
    if model == "bert":
        assert "relation  direction" in out  # syntactic's per-relation table vs baseline
    else:  # the toy's induction heads are labelled, its duplicate-token heads are not
        assert data["types"]["induction"]["heads"] and not data["types"]["duplicate_token"]["heads"]
    for name, t in data["types"].items():
        v = t["details"]["validation"]
        if model == "bert" and t["heads"]:
            assert v["clean"] == 0.0  # encoder: embedding distortion against itself
        m = data["model"]
        _, possible = control_space(
            t["heads"],
            m["n_layers"],
            m["n_heads"],
            v["control"],
            v.get("excluded_from_controls", []),
        )
        assert len(v["random_effects"]) == (min(2, possible) if t["heads"] else 0)
        # the toy labels every head of its layer 1: no other same-layer set exists, so the
        # controls widen to both layers, and the record says so
        fallback = model == "toy-induction" and name == "induction"
        want = "layers_within_1" if fallback else "same_layers" if t["heads"] else "none"
        assert v["control"] == want and (not fallback or v["control_note"])
        banned = {tuple(h) for h in v.get("excluded_from_controls", [])}
        for control in v["control_sets"]:  # recorded relabellings, matched layer by layer
            layers = sorted(layer for layer, _ in control)
            assert fallback or layers == sorted(layer for layer, _ in t["heads"])
            assert len(control) == len(t["heads"])
            assert {tuple(h) for h in control} != {tuple(h) for h in t["heads"]}
            assert not {tuple(h) for h in control} & banned
        assert (
            f"\n{name}:\n" in out
            and validation_line(TypeValidation.from_json(v)).split(":")[0] in out
        )


def test_python_dash_m_headmech_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "headmech", "types"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "previous_token" in out.stdout


def test_the_spec_is_what_was_parsed_and_leaves_the_arguments_alone():
    """The command line's flags become one checked ClassifySpec (the same object Python's
    keywords make) rather than being written into the parsed arguments: what was typed
    stays what was typed."""
    import copy

    from headmech.classification.spec import ClassifySpec, ValidationOptions
    from headmech.cli import build_parser

    args = build_parser().parse_args(
        ["classify", "toy-induction", "--types", "induction,duplicate_token", "--validate",
         "--threshold", "induction=0.5", "--alone", "2,1", "--out", "unused"]
    )  # fmt: skip
    before = copy.deepcopy(vars(args))
    spec = ClassifySpec.from_args(args)
    assert vars(args) == before
    assert [t.name for t in spec.types] == ["induction", "duplicate_token"]
    assert spec.types[0].threshold == 0.5 and spec.named
    assert spec.validation == ValidationOptions(99, 0, (2, 1))
    same = ClassifySpec.create(
        types=["induction", "duplicate_token"], validate=True, thresholds={"induction": 0.5},
        alone=(2, 1),
    )  # fmt: skip
    assert same.to_json() == spec.to_json()
