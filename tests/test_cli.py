"""The headmech command: outputs, files and one-line errors with non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["classify", "no-such-model"], "unknown model"),
        (["classify", "TINY", "--types", "nope"], "unknown head type"),
        (["classify", "TINY", "--corpus", "MISSING"], ""),
        (["classify", "TINY", "--corpus", "EMPTY"], ""),
        (["classify", "TINY", "--corpus", "LONG", "--types", "previous_token"], "context"),
    ],
    ids=["model", "type", "missing-corpus", "empty-corpus", "too-long"],
)
def test_bad_input_is_one_line_and_nonzero(capsys, tiny_dirs, tmp_path, argv, needle):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    long = tmp_path / "long.txt"
    long.write_text(("This sentence goes on " + " and on" * 60 + ".\n") * 8)  # 8: not too few
    subst = {
        "TINY": str(tiny_dirs["gpt2"]),
        "MISSING": str(tmp_path / "nope.txt"),
        "EMPTY": str(empty),
        "LONG": str(long),
    }
    argv = [subst.get(a, a) for a in argv] + ["--out", str(tmp_path / "o")]
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("headmech: error:")]
    assert len(lines) == 1 and needle in lines[0]
    assert "Traceback" not in err


def test_help_everywhere():
    for argv in (["--help"], ["classify", "--help"], ["models", "--help"], ["types", "--help"]):
        r = subprocess.run(
            [sys.executable, "-m", "headmech.cli", *argv], capture_output=True, text=True
        )
        assert r.returncode == 0 and "usage: headmech" in r.stdout


def test_classify_validate_and_evidence(capsys, tiny_dirs, tmp_path):
    code, out, _ = run(
        capsys,
        "classify",
        str(tiny_dirs["bert"]),
        "--types",
        "syntactic,previous_token",
        "--out",
        str(tmp_path),
        "--n-sentences",
        "24",
        "--validate",
        "--n-random",
        "2",
        "--seed",
        "1",
    )
    assert code == 0, out
    assert "relation  direction" in out  # syntactic's per-relation table, best head vs baseline
    data = json.loads((tmp_path / "catalog.json").read_text())
    for t in data["types"].values():
        v = t["details"]["validation"]
        assert v["clean"] == 0.0  # encoder: embedding distortion against itself
        assert len(v["random_effects"]) == (2 if t["heads"] else 0)
        assert v["control"] == ("same_layers" if t["heads"] else "none")
        for control in v["control_sets"]:  # recorded, and matched layer by layer
            layers = sorted(layer for layer, _ in control)
            assert layers == sorted(layer for layer, _ in t["heads"])
            assert not {tuple(h) for h in control} & {tuple(h) for h in t["heads"]}


def test_python_dash_m_headmech_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "headmech", "types"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "previous_token" in out.stdout
