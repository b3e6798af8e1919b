"""``catalog/README.md``'s writer (:mod:`headmech.publish.markdown`, :func:`headmech.publish.readme`
and the README step of ``python -m headmech.publish``) on small synthetic catalogs: every
cell against the exact text it must hold, computed by hand from the numbers planted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headmech import publish
from headmech.classification.montecarlo import ControlTest
from headmech.classification.records import TypeValidation
from headmech.publish.compare import BEGIN, END, LITERATURE, readme_block
from headmech.publish.markdown import _heads_cell, _validation_cell, readme

SHA = "ab" * 32
ENCODER = "needs a causal (decoder) model"
NOT_APPLICABLE = "not validated: task 'induction' needs a causal (decoder) model"


def _test(p: float, controls: list[float]) -> dict[str, Any]:
    """A Monte Carlo test's record (q = p: a family of one)."""
    return ControlTest(1.0, controls, 0, p, 0.01, "n_max", 99, 5, 100, "u", q=p).to_json()


# validation records as classify writes them
SAME_LAYERS = {
    "validation": "ablation", "primary": "ablation", "claim": "",
    "metric": "next-token loss", "mode": "zero", "n_heads": 2, "effect": 1.5,
    "effect_interval": [1.25, 1.75], "expected": "raise", "control": "same_layers",
    "control_note": "", "random_effects": [0.1, 0.2, 0.3], "random_median": 0.2,
    "random_range": [0.1, 0.3], "test": _test(0.25, [0.1, 0.2, 0.3]),
    "verdict": "inconclusive",
}  # fmt: skip
WIDENED = {
    "validation": "ablation", "primary": "ablation", "claim": "",
    "metric": "1 - cos", "mode": "zero", "n_heads": 1, "effect": 0.016726,
    "effect_interval": [0.015472, 0.017958], "expected": "raise", "control": "layers_within_1",
    "control_note": "only 3 distinct control set(s) exist in the labelled heads' layers: "
    "controls drawn from the eligible heads within 1 layer(s) of them",
    "random_effects": [0.004587, 0.005434, 0.004163, 0.00455, 0.004739],
    "random_median": 0.004587, "random_range": [0.004163, 0.005434],
    "test": _test(1 / 6, [0.004587, 0.005434, 0.004163, 0.00455, 0.004739]),
    "verdict": "inconclusive",
}  # fmt: skip
LOWER_NO_CONTROL = {
    "validation": "direct_path", "primary": "direct_path", "claim": "",
    "metric": "logit difference", "mode": "mean", "n_heads": 1, "effect": -0.5,
    "effect_interval": None, "expected": "lower", "control": "none", "control_note": "",
    "random_effects": [], "random_median": None, "random_range": None, "test": None,
    "verdict": "untestable here",
}  # fmt: skip
NOTED_NO_CONTROL = {**LOWER_NO_CONTROL, "expected": "raise", "effect": 0.25,
                    "effect_interval": [0.125, 0.375],
                    "control_note": "5 of 8 heads are labelled"}  # fmt: skip
NO_HEADS = {"claim": "", "expected": "raise", "metric": "next-token loss", "mode": "mean",
            "n_heads": 0, "effect": 0.0,
            "verdict": "no heads"}  # fmt: skip
NOT_RUN = {"claim": "", "expected": "raise", "metric": "next-token loss", "mode": "zero",
           "n_heads": 1, "effect": None,
           "control_note": NOT_APPLICABLE, "verdict": "untestable here"}  # fmt: skip


# fmt: off
# id, record, (effect cell, control cell)
CELLS = [
    ("none", None, ("not validated", "")),
    ("no-heads", NO_HEADS, ("no labelled heads", "")),
    ("not-applicable", NOT_RUN, ("—", NOT_APPLICABLE)),
    ("same-layers", SAME_LAYERS, ("+1.5 [+1.25, +1.75]", "+0.2 (+0.1 … +0.3; 3 sets, same layers)")),
    ("widened", WIDENED,
     ("+0.0167 [+0.0155, +0.018]", "+0.00459 (+0.00416 … +0.00543; 5 sets, within 1 layer(s))")),
    ("lower-no-control", LOWER_NO_CONTROL, ("-0.5 (expected: lower)", "no control")),
    ("noted-no-control", NOTED_NO_CONTROL, ("+0.25 [+0.125, +0.375]", "5 of 8 heads are labelled")),
]
# fmt: on


@pytest.mark.parametrize(("v", "want"), [pytest.param(*c[1:], id=c[0]) for c in CELLS])
def test_validation_cell(v, want):
    t = None if v is None else TypeValidation.from_json(v)
    c = (t.primary, t.controls.kind, t.controls.note) if t is not None else (None,)
    assert _validation_cell(*c) == want


def test_heads_cell_best_first_and_cut_after_twelve():
    score = [[round(0.01 * (10 * la + h), 2) for h in range(4)] for la in range(4)]
    t = {"score": score, "heads": [[3, 3], [0, 1], [1, 2]]}
    assert _heads_cell(t) == "L3H3 0.33, L0H1 0.01, L1H2 0.12"  # the catalog's order
    many = {"score": score, "heads": [[la, h] for la in range(4) for h in range(4)][:14]}
    cell = _heads_cell(many)
    assert cell.startswith("L0H0 0.00, L0H1 0.01, ") and cell.endswith("L2H3 0.23, … (+2)")
    assert cell.count("L") == 12
    assert _heads_cell({**many, "heads": many["heads"][:12]}).endswith("L2H3 0.23")
    # no labelled head: the best unlabelled one, a missing score (None) never best
    assert _heads_cell({"score": [[None, 0.45], [0.3, None]], "heads": []}) == (
        "none (best L0H1 0.45)"
    )
    assert _heads_cell({"score": [[None, None]], "heads": []}) == "none"


PER_HEAD = {
    "L1H0": {"effect": 1.0, "interval": [0.5, 1.5], "labelled": True, "broad_share": 0.6,
             "broad_share_4x": 0.7, "narrow": False},
    "L1H1": {"effect": 0.25, "interval": None, "labelled": True, "broad_share": 0.2,
             "broad_share_4x": 0.3, "narrow": True},
    "L0H1": {"effect": 0.05, "interval": [-0.1, 0.2], "labelled": False},
}  # fmt: skip


def _model(root: Path, name: str, shape: tuple[int, int], types: dict, run: dict) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    data = {
        "headmech_version": "0.1.0", "schema_version": "2",
        "model": {"name": name, "n_layers": shape[0], "n_heads": shape[1]},
        "provenance": {"model": {"weights_sha256": SHA}}, "types": types,
    }  # fmt: skip
    (folder / "catalog.json").write_text(json.dumps(data))
    (folder / "run.json").write_text(json.dumps({"threads": 2, **run}))


def _type(threshold: float, score: list, heads: list, v: dict | None = None) -> dict[str, Any]:
    return {"threshold": threshold, "score": score, "heads": heads,
            "details": {} if v is None else {"validation": v}}  # fmt: skip


@pytest.fixture
def root(tmp_path) -> Path:
    """A decoder (smollm2-135m), an encoder (minilm-l6) and the toy, 2 x 2 (toy 2 x 4)."""
    _model(
        tmp_path,
        "smollm2-135m",
        (2, 2),
        {
            "induction": _type(0.4, [[0.1, 0.45], [0.9, 0.5]], [[1, 0], [1, 1]], SAME_LAYERS)
            | {
                "not_labelled": [
                    {"head": "L0H1", "score": 0.45, "reason": "copying score -0.20 < 0"}
                ],
                "per_head": PER_HEAD,
            },  # fmt: skip
            "negative_name_mover": _type(
                0.25, [[0.0, -0.3333], [0.2, 0.1]], [[0, 1]], LOWER_NO_CONTROL
            ),
            "attention_sink": _type(0.5, [[0.3, 0.45], [None, 0.1]], [], NO_HEADS),
            "retrieval": _type(0.1, [[None, None], [None, None]], []),
        },
        {
            "command": "headmech classify smollm2-135m --validate",
            "cpu_seconds": 5000.4,
            "seconds": {"load": 10.0, "classify": 3000.0, "check": 50.0},
            "skipped": {},
        },
    )
    _model(
        tmp_path,
        "minilm-l6",
        (2, 2),
        {
            "positional": _type(0.9, [[0.2, 0.95], [0.1, 0.3]], [[0, 1]], WIDENED),
            "duplicate_token": _type(0.5, [[0.0, 0.0], [0.7, 0.0]], [[1, 0]], NOT_RUN),
        },
        {
            "command": "headmech classify minilm-l6 --validate",
            "cpu_seconds": 230.9,
            "seconds": {"load": 6.3, "classify": 329.6, "check": 21.3},
            "skipped": {
                "induction": f"head type 'induction' {ENCODER}",
                "retrieval": f"head type 'retrieval' {ENCODER}",
                "successor": "its probe 'ordinal' does not fit the model: no numbers",
            },
        },
    )
    _model(tmp_path, "toy-induction", (2, 4), {
        "induction": _type(0.4, [[0.0] * 4, [0.0, 0.0, 0.8, 0.0]], [[1, 2]],
                           {**SAME_LAYERS, "n_heads": 1, "effect": 2.0, "effect_interval": None,
                            "random_effects": [0.01, 0.05, 0.1], "random_median": 0.05,
                            "random_range": [0.01, 0.1], "verdict": "not validated",
                            "test": _test(0.25, [0.01, 0.05, 0.1])}),
    }, {"command": "headmech classify toy-induction --validate", "cpu_seconds": 60.0,
        "seconds": {"load": 1.0, "classify": 20.0, "check": 2.0}, "skipped": {}})  # fmt: skip
    return tmp_path


SMOLLM2_SECTION = [
    "## smollm2-135m (2 layers x 2 heads)",
    "",
    "`headmech classify smollm2-135m --validate` (headmech 0.1.0, weights SHA-256 `abababababababab…`): load 10 s, classify and validate 3000 s, check size 50 s of wall time; 5000 CPU seconds on 2 threads. [catalog.json](smollm2-135m/catalog.json), [heatmaps](smollm2-135m/heatmaps/).",
    "",
    "| type | threshold | heads | labelled heads (score), best first | primary claim: effect [95% CI] | controls: median (range) | test | verdict | metric |",
    "|---|---|---|---|---|---|---|---|---|",
    "| [`induction`](smollm2-135m/heatmaps/induction.png) | 0.4 | 2 | L1H0 0.90, L1H1 0.50 | +1.5 [+1.25, +1.75] | +0.2 (+0.1 … +0.3; 3 sets, same layers) | p 0.25, q 0.25, n 3 | inconclusive | next-token loss (zero) |",
    "| [`negative_name_mover`](smollm2-135m/heatmaps/negative_name_mover.png) | 0.25 | 1 | L0H1 -0.33 | -0.5 (expected: lower) | no control |  | untestable here | logit difference (mean) |",
    "| [`attention_sink`](smollm2-135m/heatmaps/attention_sink.png) | 0.5 | 0 | none (best L0H1 0.45) | no labelled heads |  |  |  | next-token loss (mean) |",
    "| [`retrieval`](smollm2-135m/heatmaps/retrieval.png) | 0.1 | 0 | none | not validated |  |  |  |  |",
    "",
    "Validation verdicts (smollm2-135m): each claim is a Monte Carlo test of the labelled set against up to 99 random control sets (random relabellings of the labelled heads' layers, never a head of the type or its circuit), stopped after 5 controls at least as extreme; p = (1 + exceedances) / (1 + n), q by Benjamini-Hochberg across every claim of the catalog. *validated*: q <= 0.05 and the effect's 95% interval excludes 0; *inconclusive*: fewer control sets were drawn than p <= 0.05 needs; *untestable here*: the model holds too few distinct control sets. The primary claim (the paper's own) comes first.",
    "",
    "| type | claim | validated on | effect [95% CI] | controls: median (range) | test | verdict |",
    "|---|---|---|---|---|---|---|",
    "| `induction` | ablation | next-token loss (zero ablation) | +1.5 [+1.25, +1.75] | +0.2 (+0.1 … +0.3; 3 sets, same layers) | p 0.25, q 0.25, n 3 | **inconclusive** |",
    "| `negative_name_mover` | direct_path | logit difference | -0.5 (expected: lower) | no control | – | **untestable here** |",
    "| `attention_sink` | ablation | next-token loss (mean ablation) | no labelled heads |  | – | **no heads** |",
    "",
    "Heads at or above a threshold that are not labelled (the type's further criterion rejected them), with their own effect on the type's task (ablated alone):",
    "",
    "| type | head | score | why not labelled | own effect [95% CI] |",
    "|---|---|---|---|---|",
    "| `induction` | L0H1 | 0.450 | copying score -0.20 < 0 | +0.05 [-0.1, +0.2] |",
    "",
    "Each labelled head alone: its own effect on the type's task [95% CI], and the share of its attention on ordinary text (five domains, 64 / 256 tokens) that the type's pattern takes (**narrow**: under half at both lengths; – : the type has no pattern outside its probe). Redundancy: the set's effect over the sum of its heads' own (> 1: they back each other up).",
    "",
    "| type | head: own effect, share on ordinary text | redundancy |",
    "|---|---|---|",
    "| `induction` | L1H0 +1 [+0.5, +1.5], 0.60 / 0.70; L1H1 +0.25, 0.20 / 0.30 **narrow** | – |",
    "",
]
MINILM_SECTION = [
    "## minilm-l6 (2 layers x 2 heads)",
    "",
    "`headmech classify minilm-l6 --validate` (headmech 0.1.0, weights SHA-256 `abababababababab…`): load 6 s, classify and validate 330 s, check size 21 s of wall time; 231 CPU seconds on 2 threads. [catalog.json](minilm-l6/catalog.json), [heatmaps](minilm-l6/heatmaps/).",
    "",
    "| type | threshold | heads | labelled heads (score), best first | primary claim: effect [95% CI] | controls: median (range) | test | verdict | metric |",
    "|---|---|---|---|---|---|---|---|---|",
    "| [`positional`](minilm-l6/heatmaps/positional.png) | 0.9 | 1 | L0H1 0.95 | +0.0167 [+0.0155, +0.018] | +0.00459 (+0.00416 … +0.00543; 5 sets, within 1 layer(s)) | p 0.17, q 0.17, n 5 | inconclusive | 1 - cos (zero) |",
    "| [`duplicate_token`](minilm-l6/heatmaps/duplicate_token.png) | 0.5 | 1 | L1H0 0.70 | — | not validated: task 'induction' needs a causal (decoder) model |  | untestable here | next-token loss (zero) |",
    "",
    "Validation verdicts (minilm-l6): each claim is a Monte Carlo test of the labelled set against up to 99 random control sets (random relabellings of the labelled heads' layers, never a head of the type or its circuit), stopped after 5 controls at least as extreme; p = (1 + exceedances) / (1 + n), q by Benjamini-Hochberg across every claim of the catalog. *validated*: q <= 0.05 and the effect's 95% interval excludes 0; *inconclusive*: fewer control sets were drawn than p <= 0.05 needs; *untestable here*: the model holds too few distinct control sets. The primary claim (the paper's own) comes first.",
    "",
    "| type | claim | validated on | effect [95% CI] | controls: median (range) | test | verdict |",
    "|---|---|---|---|---|---|---|",
    "| `positional` | ablation | 1 - cos (zero ablation) | +0.0167 [+0.0155, +0.018] | +0.00459 (+0.00416 … +0.00543; 5 sets, within 1 layer(s)) | p 0.17, q 0.17, n 5 | **inconclusive** |",
    "| `duplicate_token` | ablation | next-token loss (zero ablation) | — | not validated: task 'induction' needs a causal (decoder) model | – | **untestable here** |",
    "",
    "- `positional`: inconclusive: only 3 distinct control set(s) exist in the labelled heads' layers: controls drawn from the eligible heads within 1 layer(s) of them.",
    "",
    "Every head at or above a threshold is labelled.",
    "",
    "Not applicable:",
    "",
    "- `induction`, `retrieval`: needs a causal (decoder) model.",
    "- `successor`: its probe 'ordinal' does not fit the model: no numbers.",
    "",
]
TOY_SECTION = [
    "## toy-induction (2 layers x 4 heads)",
    "",
    "`headmech classify toy-induction --validate` (headmech 0.1.0, weights SHA-256 `abababababababab…`): load 1 s, classify and validate 20 s, check size 2 s of wall time; 60 CPU seconds on 2 threads. [catalog.json](toy-induction/catalog.json), [heatmaps](toy-induction/heatmaps/).",
    "",
    "| type | threshold | heads | labelled heads (score), best first | primary claim: effect [95% CI] | controls: median (range) | test | verdict | metric |",
    "|---|---|---|---|---|---|---|---|---|",
    "| [`induction`](toy-induction/heatmaps/induction.png) | 0.4 | 1 | L1H2 0.80 | +2 | +0.05 (+0.01 … +0.1; 3 sets, same layers) | p 0.25, q 0.25, n 3 | not validated | next-token loss (zero) |",
    "",
    "Validation verdicts (toy-induction): each claim is a Monte Carlo test of the labelled set against up to 99 random control sets (random relabellings of the labelled heads' layers, never a head of the type or its circuit), stopped after 5 controls at least as extreme; p = (1 + exceedances) / (1 + n), q by Benjamini-Hochberg across every claim of the catalog. *validated*: q <= 0.05 and the effect's 95% interval excludes 0; *inconclusive*: fewer control sets were drawn than p <= 0.05 needs; *untestable here*: the model holds too few distinct control sets. The primary claim (the paper's own) comes first.",
    "",
    "| type | claim | validated on | effect [95% CI] | controls: median (range) | test | verdict |",
    "|---|---|---|---|---|---|---|",
    "| `induction` | ablation | next-token loss (zero ablation) | +2 | +0.05 (+0.01 … +0.1; 3 sets, same layers) | p 0.25, q 0.25, n 3 | **not validated** |",
    "",
    "Every head at or above a threshold is labelled.",
    "",
]


def _section(text: str, name: str) -> list[str]:
    """The lines of one model's section: from its heading to the next (or the end)."""
    lines = text.split("\n")
    start = lines.index(next(line for line in lines if line.startswith(f"## {name} (")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    return lines[start:end]


def test_readme_model_sections_are_exact(root):
    text = readme(root, ["smollm2-135m", "minilm-l6"])
    assert _section(text, "smollm2-135m") == SMOLLM2_SECTION
    assert _section(text, "minilm-l6") == MINILM_SECTION  # the last: to the end
    assert text.endswith("\n".join(MINILM_SECTION))
    # the models in the order asked, after the intro and the cross-model section
    assert (
        text.index("## Across models") < text.index("## smollm2-135m") < text.index("## minilm-l6")
    )
    assert "## toy-induction" not in text  # not asked for
    # the intro's time: (10 + 3000 + 50 + 6.3 + 329.6 + 21.3) s = 56.95 minutes
    assert text.startswith("# Published head catalogs\n")
    assert "(`python -m headmech.publish`; about 57 minutes on 2 CPU cores)" in text


def test_readme_cross_model_section(root):
    text = readme(root, ["smollm2-135m", "minilm-l6"])
    lines = text.split("\n")
    assert "| type | `smollm2-135m` | `minilm-l6` | literature |" in lines
    lit = LITERATURE
    rows = {
        "induction": f"| `induction` | 2 (50.0%), depth 1.00; +1.5 vs +0.2 (p 0.25, q 0.25, n 3): "
        f"**inconclusive**; 1 above the threshold not labelled | n/a (encoder) | {lit['induction']} |",
        "negative_name_mover": "| `negative_name_mover` | 1 (25.0%), depth 0.00; -0.5 vs no "
        f"control: **untestable here** | n/a (not published) | {lit['negative_name_mover']} |",
        "attention_sink": f"| `attention_sink` | none | n/a (not published) | "
        f"{lit['attention_sink']} |",
        "positional": f"| `positional` | n/a (not published) | 1 (25.0%), depth 0.00; +0.0167 vs "
        f"+0.00459 (p 0.17, q 0.17, n 5): **inconclusive** | {lit['positional']} |",
        "duplicate_token": f"| `duplicate_token` | n/a (not published) | 1 (25.0%), depth 1.00: "
        f"**untestable here** | {lit['duplicate_token']} |",
        "successor": f"| `successor` | n/a (not published) | n/a (its probe 'ordinal' does not fit "
        f"the model) | {lit['successor']} |",
    }
    for name, row in rows.items():
        assert row in lines, (name, [line for line in lines if f"`{name}`" in line])
    # every type, published or in the literature, has a row, in name order
    across = text.split("\n## smollm2-135m")[0].split("\n")  # not the verdict tables below
    table = [line.split(" | ")[0][3:-1] for line in across if line.startswith("| `")]
    assert table == sorted(set(LITERATURE) | set(rows))
    assert (
        "Types with labelled heads in every decoder (smollm2-135m): `induction`, "
        "`negative_name_mover`." in lines
    )


def test_publish_readme_covers_the_published_models_in_order(root):
    """publish.readme: every model of publish.MODELS that has a catalog (gemma3-270m has
    none here), in that order; the toy has a section but no column in the cross-model
    table."""
    assert publish.MODELS == (
        "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "minilm-l6",
        "toy-induction",
    )  # fmt: skip
    text = publish.readme(root)
    assert _section(text, "smollm2-135m") == SMOLLM2_SECTION
    assert _section(text, "minilm-l6") == MINILM_SECTION
    assert _section(text, "toy-induction") == TOY_SECTION
    assert "gemma3-270m" not in text and "qwen2.5" not in text
    assert "| type | `smollm2-135m` | `minilm-l6` | literature |" in text.split("\n")
    # (3417.2 + 23) s = 57.3 minutes
    assert "about 57 minutes on 2 CPU cores" in text


def test_publish_main_writes_both_readmes(root, monkeypatch, capsys):
    """The last step of ``python -m headmech.publish``: catalog/README.md from the folders,
    and the project README's cross-model block replaced (the text around it kept)."""
    catalog = root / "catalog"
    done = []

    def fake_publish(name, out, **kw):  # what publish_model leaves: the model's folder
        (out / name).parent.mkdir(exist_ok=True)
        (root / name).rename(out / name)
        done.append(name)
        return {"seconds": {}}

    monkeypatch.setattr(publish, "_store", lambda *a, **k: None)
    monkeypatch.setattr(publish, "publish_model", fake_publish)
    (root / "README.md").write_text(f"# headmech\n\nintro\n{BEGIN}\nstale table\n{END}\ntail\n")
    assert publish.main(["--models", "smollm2-135m,minilm-l6", "--out", str(catalog)]) == 0
    assert done == ["smollm2-135m", "minilm-l6"]
    text = (catalog / "README.md").read_text()
    assert _section(text, "smollm2-135m") == SMOLLM2_SECTION
    assert _section(text, "minilm-l6") == MINILM_SECTION
    front = (root / "README.md").read_text()
    block = readme_block(catalog)
    assert front == f"# headmech\n\nintro\n{block}\ntail\n"
    assert "stale table" not in front and "| `induction` | 2 (50.0%), depth 1.00;" in block
    # the findings the decoders are compared on, one line each, from the same cells
    lines = block.split("\n")
    assert "The decoders compared:" in lines
    assert any(
        line.startswith("- induction heads: smollm2-135m 2 (50.0%) at depth 1.00") for line in lines
    )
    assert "- attention sinks: smollm2-135m none." in lines
    err = capsys.readouterr().err
    assert f"wrote {catalog}/README.md" in err and "updated the cross-model table" in err
