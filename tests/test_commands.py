"""Every command end to end on every bundled model: the ``headmech`` command line as a
user runs it (``main(argv)`` in this process), at tiny sizes, asserting the exit status,
the files written and that the printed report names every type and every validation
result.

The matrix: the rows of :data:`COMMANDS` (classify with validation, importance, circuit,
prune with ``--catalog``, discover, kv-plan) for each of the five bundled models, the
encoder (MiniLM) beside the decoders; then the option combinations that change code paths:
validation with and without a possible control (the sink labels most heads), ``--dtype
bfloat16``, ``--force`` over an earlier result and ``--resume`` of a stopped run. Each
bundled model loads once (``load_model`` is remembered per arguments for this module, so a
float32 load is the session's). torchrun with two processes runs the same commands in
tests/test_distributed.py; the resume byte-identity of classify, importance, prune and
``make catalog`` in tests/test_resume.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import headmech
import headmech.models  # the fixture patches its load_model (imported here, not by chance)
from headmech.classification.claims import control_space
from headmech.classification.records import TypeValidation, validation_of
from headmech.cli import main
from headmech.cli.report import validation_line

pytestmark = pytest.mark.slow  # the bundled real models and the toy

MODELS = ("toy-induction", "minilm-l6", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
DECODERS = ("toy-induction", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")

# per model: classify's types (one whose control sets can be drawn, the sink, tested by its
# dose-response on decoders) and sizes
CLASSIFY = {
    "toy-induction": ["--types", "induction,duplicate_token", "--n-sequences", "8"],
    "minilm-l6": ["--types", "positional,attention_sink", "--n-sentences", "16"],
    # the command of the "nothing lost" issue, which crashed printing the sink's evidence,
    # at 8 sentences (the 32 cost 22 s more CPU on one thread: the sink's validation
    # ablates its ~220 labelled heads, and 24 alone, on every sentence; the sink labels 221
    # of 270 heads at 8, 219 at 32: no equal-sized control either way, so its dose test)
    "smollm2-135m": ["--types", "induction,attention_sink", "--n-sequences", "8",
                     "--n-sentences", "8", "--no-broad"],
    # 4 sentences: the sink still labels 63 of 72 heads (62 with 8), 16% less CPU; the one
    # real model whose heads are also read on ordinary text here (the broad windows)
    "gemma3-270m": ["--types", "induction,attention_sink", "--n-sequences", "4",
                    "--n-sentences", "4"],
    # 2 and 2: the sink labels 246 of 336 heads, induction 9 (controls drawn); without
    # --no-broad, 32 s of its 85 s of CPU (one thread) were the broad-behaviour windows
    "qwen2.5-coder-0.5b": ["--types", "induction,attention_sink", "--n-sequences", "2",
                           "--n-sentences", "2", "--alone", "2,1", "--no-broad"],
}  # fmt: skip

RESULTS = {
    "classify": ("catalog.json", "heatmap.png"),
    "importance": ("importance.json", "importance.png"),
    "circuit": ("circuit.json", "circuit.graphml", "circuit.png"),
    "prune": ("pruning.json", "pruning.png"),
    "discover": ("discovery.json", "discovery.png"),
    "kv-plan": ("plan.json",),
}


@pytest.fixture(scope="module")
def loads(request):
    """``load_model`` remembered per arguments (the session's model for a float32 load)."""
    real = headmech.models.load_model
    session = {
        "smollm2-135m": "smollm2",
        "gemma3-270m": "gemma3",
        "qwen2.5-coder-0.5b": "qwen25",
        "minilm-l6": "minilm",
    }
    seen: dict = {}
    loading: set = set()  # session fixtures being set up: they call load_model themselves

    def load(name, device=None, dtype=None, **where):
        key = (str(name), str(device), str(dtype), tuple(sorted(where.items())))
        if key not in seen:
            plain = device is None and dtype is None and not any(where.values())
            if plain and name in session and name not in loading:
                loading.add(name)  # the first file to ask for it: the fixture loads it
                try:
                    seen[key] = request.getfixturevalue(session[name])
                finally:
                    loading.discard(name)
            else:
                seen[key] = real(name, device=device, dtype=dtype, **where)
        return seen[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(headmech.models, "load_model", load)
    yield seen
    mp.undo()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("commands")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _shape(text: str) -> str:
    return re.sub(r"[-+]?\d+(\.\d+)?", "#", text)


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", text)]


def _files(folder: Path, command: str) -> None:
    for name in RESULTS[command]:
        path = folder / name
        assert path.is_file() and path.stat().st_size > 0, f"{command} wrote no {name}"
    assert not (folder / ".headmech-partial").exists()  # staging gone once written


def _classified(loads, outputs, capsys, model: str) -> dict:
    """classify --validate once per model (the other commands read its catalog)."""
    out = outputs / model / "classify"
    if not (out / "catalog.json").exists():
        argv = ["classify", model, *CLASSIFY[model], "--validate", "--n-random", "2"]
        code, printed, err = run(capsys, *argv, "--out", out)
        assert code == 0, err[-2000:]
        (out / "printed.txt").write_text(printed)
    return json.loads((out / "catalog.json").read_text())


@pytest.mark.parametrize("model", MODELS)
def test_classify_validate_prints_every_type_and_validation(loads, outputs, capsys, model):
    catalog = _classified(loads, outputs, capsys, model)
    folder = outputs / model / "classify"
    _files(folder, "classify")
    printed = (folder / "printed.txt").read_text()
    asked = CLASSIFY[model][1].split(",")
    assert sorted(catalog["types"]) == sorted(asked)
    for name, t in catalog["types"].items():
        assert name in printed
        line = validation_line(validation_of(t))
        assert line is not None, name
        # the same line, up to the last digit (the catalog keeps 4 decimals)
        assert _shape(line) in _shape(printed), (name, line)
        section = printed.split(f"\n{name}:\n", 1)[1]
        shown = next(x for x in section.splitlines() if x.strip().startswith("validation"))
        assert _numbers(shown) == pytest.approx(_numbers(line), abs=2e-4), (name, line)
    if model in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"):  # sink: most heads
        sink = catalog["types"]["attention_sink"]["details"]["validation"]
        # no equal-sized set of non-sinks: the dose-response over sink-score bins, two sets a
        # bin at --n-random 2, its p by 999 permutations
        assert sink["validation"] == "sink_dose" and len(sink["dose"]) == 10
        assert "999 permutations" in validation_line(TypeValidation.from_json(sink))
    if model == "minilm-l6":  # BERT's bridge ignores pattern edits: the sink is untestable
        sink = catalog["types"]["attention_sink"]["details"]["validation"]
        assert sink["verdict"] == "untestable here" and "pattern edits" in sink["control_note"]
    skipped = "--no-broad" in CLASSIFY[model]  # read on ordinary text, or said not to be
    for t in catalog["types"].values():
        note = t["details"].get("broad", {}).get("note", "")
        assert ("--no-broad" in note) == skipped, (model, note)
    assert catalog["provenance"]["settings"].get("broad", True) is not skipped
    if "--alone" in CLASSIFY[model]:  # at most 2 labelled heads ablated alone, said
        t = catalog["types"]["induction"]
        alone = [h for h, e in t["per_head"].items() if "effect" in e and e["labelled"]]
        assert len(alone) == 2 and t["details"]["validation"]["per_head_note"].startswith("2 of")
        assert catalog["provenance"]["settings"]["alone"] == [2, 1]
    if model != "minilm-l6":  # induction labelled, with controls drawn
        v = catalog["types"]["induction"]["details"]["validation"]
        heads = catalog["types"]["induction"]["heads"]
        m = catalog["model"]
        _, possible = control_space(
            heads, m["n_layers"], m["n_heads"], v["control"], v.get("excluded_from_controls", [])
        )
        assert heads and len(v["random_effects"]) == min(2, possible)  # distinct sets
        assert v["verdict"] == "inconclusive" and "p >= 0.33 at best" in validation_line(
            TypeValidation.from_json(v)
        )
        assert v["test"]["p_min"] == pytest.approx(1 / 3)
    if model == "smollm2-135m":  # the command that crashed printing the sink's evidence
        assert v["control"] == "same_layers"
        assert len(catalog["types"]["attention_sink"]["heads"]) > 0.6 * 270  # Gu et al.'s ε 0.3
        assert f"; 2 random sets of {v['n_heads']} from the same layers: " in printed


IMPORTANCE = {
    "toy-induction": ["--method", "zero"],
    "minilm-l6": ["--method", "zero", "--n-sentences", "4"],
    "smollm2-135m": ["--method", "dla", "--n-sentences", "4"],
    # DLA: post-attention norms. The induction task scores 7 tokens a sequence, where the
    # language-model task scores every token through the 262k-token unembedding (28 s of
    # CPU, 20 s with this task: the rest is the 72 heads' suffix passes)
    "gemma3-270m": ["--method", "zero", "--task", "induction", "--n-sequences", "2",
                    "--half-len", "8"],
    "qwen2.5-coder-0.5b": ["--method", "dla", "--n-sentences", "4"],
}  # fmt: skip


@pytest.mark.parametrize("model", MODELS)
def test_importance(loads, outputs, capsys, model):
    out = outputs / model / "importance"
    code, printed, err = run(capsys, "importance", model, *IMPORTANCE[model], "--out", out)
    assert code == 0, err[-2000:]
    _files(out, "importance")
    data = json.loads((out / "importance.json").read_text())
    n_layers, n_heads = data["score"] and (len(data["score"]), len(data["score"][0]))
    model_cfg = loads_cfg(loads, model)
    assert (n_layers, n_heads) == model_cfg
    assert IMPORTANCE[model][1] in printed


def loads_cfg(loads, model: str) -> tuple[int, int]:
    m = headmech.models.load_model(model)
    return int(m.cfg.n_layers), int(m.cfg.n_heads)


@pytest.mark.parametrize("model", MODELS)
def test_circuit_of_the_catalog(loads, outputs, capsys, model):
    catalog = _classified(loads, outputs, capsys, model)
    out = outputs / model / "circuit"
    types = "positional" if model == "minilm-l6" else "induction"  # a few receivers
    argv = ["circuit", model, "--catalog", outputs / model / "classify", "--types", types]
    argv += ["--out", out]
    code, printed, err = run(capsys, *argv)
    assert code == 0, err[-2000:]
    _files(out, "circuit")
    data = json.loads((out / "circuit.json").read_text())
    labelled = {f"L{la}H{h}" for la, h in catalog["types"][types]["heads"]}
    receivers = {e["target"] for e in data["edges"]}
    assert receivers and receivers <= labelled  # the catalog's heads receive, none other
    assert data["graph"]["provenance"]["catalog"] == catalog["provenance"]  # read, not rerun
    assert f"{len(data['nodes'])} heads, {len(data['edges'])} edges" in printed


@pytest.mark.parametrize("model", MODELS)
def test_prune_reports_which_catalogued_heads_survive(loads, outputs, capsys, model):
    _classified(loads, outputs, capsys, model)
    out = outputs / model / "prune"
    argv = ["prune", model, "--method", "michel", "--steps", "1", "--n-sentences", "4",
            "--n-sequences", "4", "--catalog", outputs / model / "classify" / "catalog.json"]  # fmt: skip
    code, printed, err = run(capsys, *argv, "--out", out)
    assert code == 0, err[-2000:]
    _files(out, "prune")
    catalog = json.loads((outputs / model / "classify" / "catalog.json").read_text())
    for name, t in catalog["types"].items():
        if t["heads"]:
            assert name in printed, name  # the --catalog branch of the report


# discover's sizes where a model needs fewer (Qwen: 35 s of CPU at the others', 22 s here)
DISCOVER = {"qwen2.5-coder-0.5b": ["--n-sentences", "4", "--n-sequences", "2"]}


@pytest.mark.parametrize("model", MODELS)
def test_discover(loads, outputs, capsys, model):
    out = outputs / model / "discover"
    # on the real decoders, types read from attention alone: induction's copying test ablates
    # each candidate head (17 s of Qwen2.5's 43 s), which the classify row already runs
    types = {"minilm-l6": "positional,previous_token", "toy-induction": "duplicate_token,induction"}
    types = types.get(model, "previous_token,duplicate_token")
    sizes = DISCOVER.get(model, ["--n-sentences", "8", "--n-sequences", "4"])
    argv = ["discover", model, "--types", types, *sizes, "--clusters", "2"]
    code, printed, err = run(capsys, *argv, "--out", out)
    assert code == 0, err[-2000:]
    _files(out, "discover")
    assert "cluster" in printed


@pytest.mark.parametrize("model", DECODERS)
def test_kv_plan_from_the_catalog(loads, outputs, capsys, model):
    _classified(loads, outputs, capsys, model)
    out = outputs / model / "kv"
    argv = ["kv-plan", model, "--catalog", outputs / model / "classify", "--types", "induction"]
    code, printed, err = run(capsys, *argv, "--out", out)
    assert code == 0, err[-2000:]
    _files(out, "kv-plan")
    plan = json.loads((out / "plan.json").read_text())
    catalog = json.loads((outputs / model / "classify" / "catalog.json").read_text())
    assert catalog["types"]["induction"]["heads"] and plan


def test_kv_plan_refuses_the_encoder(loads, outputs, capsys):
    code, _, err = run(capsys, "kv-plan", "minilm-l6", "--heads", "L0H0", "--out", outputs / "x")
    assert code == 2 and err.count("headmech: error:") == 1 and "Traceback" not in err
    assert "minilm-l6 is an encoder" in err and "loading" not in err  # before loading
    from headmech.kv import KVPlan

    with pytest.raises(headmech.core.errors.InputError, match="is an encoder"):
        KVPlan.windowed(headmech.models.load_model("minilm-l6"))


def test_bfloat16_classify(loads, outputs, capsys):
    out = outputs / "bf16"
    argv = ["classify", "smollm2-135m", "--dtype", "bfloat16", "--types", "induction",
            "--n-sequences", "4", "--out", out]  # fmt: skip
    code, printed, err = run(capsys, *argv)
    assert code == 0, err[-2000:]
    data = json.loads((out / "catalog.json").read_text())
    assert data["provenance"]["model"]["dtype"] == "bfloat16"  # where provenance records it
    assert data["types"]["induction"]["heads"]  # bf16 weights still find induction heads


def test_force_replaces_and_plain_rerun_refuses(loads, outputs, capsys):
    out = outputs / "force"
    argv = ["importance", "toy-induction", "--method", "zero", "--out", out]
    assert run(capsys, *argv)[0] == 0
    first = (out / "importance.json").read_bytes()
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--force" in err and "Traceback" not in err
    code, _, err = run(capsys, *argv, "--force")
    assert code == 0, err[-2000:]
    assert (out / "importance.json").read_bytes() == first  # same run, same bytes
