"""What the command line prints beside its files (:mod:`headmech.cli.report`): one line for
every shape of validation record, every type named, and the pruning survival table."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from headmech.classification.classify import classify
from headmech.classification.control_sets import draw_controls
from headmech.classification.records import TypeValidation
from headmech.classification.results import HeadCatalog, TypeResult
from headmech.classification.validation import type_validation, validate_heads
from headmech.cli import report
from headmech.cli.evidence import EVIDENCE_LINES, evidence_lines
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import get_head_type, head_types
from headmech.models import ModelInfo
from headmech.probes import ProbeOptions
from headmech.pruning.result import PruningResult

INFO = ModelInfo("m", 2, 4, 4, 8, 64, True)
METRIC = "next-token loss on the repeated half"
HEAD = f"validation (zero ablation, {METRIC}): "
SMALL = ProbeOptions(n_sequences=4, half_len=6, batch_size=4)


def _record(heads: list[HeadIndex], n_random: int, **over: object) -> TypeValidation:
    """A record shaped as :func:`headmech.classification.classify.validate_heads` writes it, its control
    sets drawn by the real ``draw_controls``; effects 0.5 + 0.1 per set."""
    with warnings.catch_warnings():  # the fallback's warning: tested in test_findings.py
        warnings.simplefilter("ignore")
        controls, kind, note = draw_controls(INFO, heads, n_random, seed=0)
    rand = [0.1 * (i + 1) for i in range(len(controls))]
    v = {
        "claim": "", "metric": METRIC, "mode": "zero", "control": kind, "control_note": note,
        "clean": 3.0, "ablated": 5.5 if heads else 3.0, "effect": 2.5 if heads else 0.0,
        "effect_interval": [2.25, 2.75] if heads else None,
        "control_sets": [[[h.layer, h.head] for h in c] for c in controls],
        "random_effects": rand, "random_mean": sum(rand) / len(rand) if rand else None,
        "random_median": float(torch.tensor(rand).median()) if rand else None,
        "random_range": [min(rand), max(rand)] if rand else None,
        "n_heads": len(heads), "expected": "raise",
    }  # fmt: skip
    return TypeValidation.from_json({**v, **over})


def _catalog(records: dict[str, TypeValidation | None]) -> HeadCatalog:
    types = {}
    for name, v in records.items():
        heads = [HeadIndex(0, 0)] * (v.primary.n_heads if v is not None else 0)
        types[name] = TypeResult(name, "", 0.5, torch.zeros(2, 4), heads, validation=v)
    return HeadCatalog(INFO, types)


ONE_PER_LAYER = [HeadIndex(0, 1), HeadIndex(1, 2)]
LAYER_0 = [HeadIndex(0, h) for h in range(4)]  # layer 0 whole: no other set there
ALL_HEADS = [HeadIndex(la, h) for la in range(2) for h in range(4)]
NOT_APPLICABLE = "not validated: task 'induction' needs a causal (decoder) model"

# fmt: off
# id, record, the exact line printed
SHAPES = [
    ("same-layers", _record(ONE_PER_LAYER, 3),
     HEAD + "labelled heads +2.5000 (95% interval +2.2500 to +2.7500); 3 random sets of 2 from "
     "the same layers: +0.2000 on average (median +0.2000, range +0.1000 to +0.3000)"),
    ("one-set", _record(ONE_PER_LAYER, 1, effect_interval=None),
     HEAD + "labelled heads +2.5000; 1 random set of 2 from the same layers: +0.1000 on average "
     "(median +0.1000, range +0.1000 to +0.1000)"),
    ("controls-widened", _record(LAYER_0, 2),
     HEAD + "labelled heads +2.5000 (95% interval +2.2500 to +2.7500); 2 random sets of 4 from "
     "within 1 layer(s) of the labelled ones: +0.1500 on average (median +0.1000, range +0.1000 "
     "to +0.2000); only 0 distinct control set(s) exist in the labelled heads' layers: controls "
     "drawn from the eligible heads within 1 layer(s) of them"),
    ("no-control-possible", _record(ALL_HEADS, 5),
     HEAD + "labelled heads +2.5000 (95% interval +2.2500 to +2.7500); no control possible: 8 "
     "of 8 heads are labelled: no other set of as many heads exists"),
    ("effect-only", _record(ONE_PER_LAYER, 0),
     HEAD + "labelled heads +2.5000 (95% interval +2.2500 to +2.7500); no control possible "
     "(n_random is 0)"),
    ("no-labelled-heads", _record([], 5), HEAD + "no labelled heads, nothing to ablate"),
    ("not-applicable", _record(ONE_PER_LAYER, 0, effect=None, control_note=NOT_APPLICABLE),
     "validation: " + NOT_APPLICABLE),
    ("not-applicable-no-heads", _record([], 0, effect=None, control_note=NOT_APPLICABLE),
     "validation: " + NOT_APPLICABLE),
]
# fmt: on


@pytest.mark.parametrize(("v", "line"), [pytest.param(*r[1:], id=r[0]) for r in SHAPES])
def test_every_validation_shape_has_its_line(v, line):
    assert report.validation_line(v) == line


def test_no_record_no_line():
    assert report.validation_line(None) is None


def test_evidence_names_every_validated_type(capsys):
    """Every type and its validation result, in catalog order, none lost: the real types'
    own report lines (none for these) and custom types the registry does not know."""
    names = ["induction", "attention_sink", "previous_token", "custom_one", "custom_two",
             "duplicate_token", "retrieval", "custom_three"]  # fmt: skip
    catalog = _catalog({n: r[1] for n, r in zip(names, SHAPES, strict=True)})
    report.evidence(catalog)
    blocks = [f"\n{n}:\n  {r[2]}\n" for n, r in zip(names, SHAPES, strict=True)]
    assert capsys.readouterr().out == "".join(blocks)


def test_evidence_leaves_out_types_with_nothing_to_say(capsys):
    report.evidence(_catalog({"induction": None, "custom": None}))
    assert capsys.readouterr().out == ""


def test_evidence_prints_a_catalog_read_back_from_json(tmp_path, capsys):
    """What ``--catalog`` / ``HeadCatalog.load`` gives back prints as the run did."""
    catalog = _catalog({"attention_sink": SHAPES[3][1], "induction": SHAPES[0][1]})
    catalog.save(tmp_path / "catalog.json")
    report.evidence(HeadCatalog.load(tmp_path / "catalog.json"))
    assert capsys.readouterr().out == (
        f"\nattention_sink:\n  {SHAPES[3][2]}\n\ninduction:\n  {SHAPES[0][2]}\n"
    )


def test_real_records_of_every_shape_print(tiny_models):
    """The records validate_heads and type_validation really write (a tiny LLaMA and BERT)."""
    llama, t = tiny_models["llama"], get_head_type("induction")(threshold=0.0)
    real = {
        "same_layers": validate_heads(llama, t, ONE_PER_LAYER, SMALL, n_random=2),
        "widened": validate_heads(llama, t, LAYER_0, SMALL, n_random=2),
        "none": validate_heads(llama, t, ALL_HEADS, SMALL, n_random=2),
        "n_random 0": validate_heads(llama, t, ONE_PER_LAYER, SMALL, n_random=0),
        "no heads": validate_heads(llama, t, [], SMALL, n_random=2),
        "encoder": type_validation(tiny_models["bert"], t, ONE_PER_LAYER, SMALL, 2),
    }
    lines = {k: report.validation_line(v) for k, v in real.items()}
    v = real["same_layers"].primary
    assert lines["same_layers"] == (
        f"validation (zero ablation, {v.metric}): labelled heads {v.effect:+.4f} (95% "
        f"interval {v.effect_interval[0]:+.4f} to {v.effect_interval[1]:+.4f}); 2 random "
        f"sets of 2 from the same layers: {v.random_mean:+.4f} on average (median "
        f"{v.random_median:+.4f}, range {v.random_range[0]:+.4f} to "
        f"{v.random_range[1]:+.4f}); p {v.test.p:.2g}, n 2, p >= 0.33 at best; verdict: "
        "inconclusive"  # 2 sets asked for: p = 1/3 at best, and the line says so
    )
    assert "2 random sets of 4 from within 1 layer(s) of the labelled ones" in lines["widened"]
    assert "controls drawn from the eligible heads within 1 layer(s)" in lines["widened"]
    assert lines["none"].startswith("validation (zero ablation, ")
    assert "no control possible: 8 of 8 heads are labelled: no other set" in lines["none"]
    assert lines["none"].endswith("verdict: untestable here")
    assert "no control possible (n_random is 0)" in lines["n_random 0"]
    assert lines["no heads"].endswith("no labelled heads, nothing to ablate")
    assert lines["encoder"] == "validation: " + NOT_APPLICABLE


# --- pruning ---------------------------------------------------------------------------


def _steps(kept: list[list[tuple[int, int]]], metrics: list[float]) -> list[dict]:
    return [
        {"n_kept": len(k), "heads_kept": k, "metric": m} for k, m in zip(kept, metrics, strict=True)
    ]


ALL = [(la, h) for la in range(2) for h in range(4)]


def _pruning_catalog() -> HeadCatalog:
    types = {
        "induction": TypeResult("induction", "", 0.4, torch.zeros(2, 4), [HeadIndex(1, 0)]),
        "previous_token": TypeResult(
            "previous_token", "", 0.4, torch.zeros(2, 4), [HeadIndex(0, 0), HeadIndex(0, 1)]
        ),
        "retrieval": TypeResult("retrieval", "", 0.4, torch.zeros(2, 4), []),
    }
    return HeadCatalog(INFO, types)


def test_pruning_with_a_catalog(capsys):
    from headmech.pruning.survival import survival

    kept = [ALL, ALL[1:], [(0, 2), (0, 3), (1, 0), (1, 1)], [(1, 0), (1, 1)]]
    catalog = _pruning_catalog()
    result = PruningResult(
        "michel", "induction", _steps(kept, [1.0, 1.01, 1.2, 2.0]),
        survival=survival(kept, catalog), n_heads_total=8,
    )  # fmt: skip
    report.pruning(result, catalog)
    assert capsys.readouterr().out == (
        "types by when pruning removed half their heads (heads kept then):\n"
        "  previous_token: 7\n"
        "  induction: kept at least half to the end\n"
        "enrichment of catalogued heads among the 4 kept: 0.6667\n"
        "     8 heads kept: 1.0000\n"
        "     7 heads kept: 1.0100\n"
        "     4 heads kept: 1.2000\n"
        "     2 heads kept: 2.0000\n"
        "michel / induction: 12% of heads removable at <= 5% metric loss\n"
    )


def test_pruning_with_a_catalog_that_labels_nothing(capsys):
    empty = HeadCatalog(
        INFO, {"retrieval": TypeResult("retrieval", "", 0.4, torch.zeros(2, 4), [])}
    )
    kept = [ALL, ALL[:4]]
    result = PruningResult("l0", "lm", _steps(kept, [1.0, 3.0]), n_heads_total=8)
    result.steps[1]["lambda"] = 0.5
    report.pruning(result, empty)
    assert capsys.readouterr().out == (
        "no catalogued type has labelled heads: no survival to report\n"
        "enrichment of catalogued heads among the 4 kept: none (no catalogued or no kept heads)\n"
        "     8 heads kept: 1.0000\n"
        "     4 heads kept: 3.0000  (lambda 0.5)\n"
        "l0 / lm: 0% of heads removable at <= 5% metric loss\n"
    )


# --- the types' own evidence lines -------------------------------------------------------

# fmt: off
# type, details as the type's details() writes them, the exact lines of its report()
TYPE_LINES = [
    ("copy_suppression", {"suppressed_share": {"L10H7": 0.4567, "L0H0": 0.05}, "best_head": [10, 7]},
     ["L10H7: suppresses its own token for 46% of tokens",
      "L0H0: suppresses its own token for 5% of tokens"]),
    ("function_vector",  # the top 5 of the (best-first) top 10; a head with no mass reads 0
     {"aie": {"L1H2": 0.0312, "L2H0": 0.002, "L3H3": 0.0019, "L1H1": 0.0011, "L0H0": 0.001,
              "L0H1": -0.0042},
      "label_mass": {"L1H2": 0.456, "L0H1": 0.1, "L2H0": 0.2, "L3H3": 0.3, "L0H0": 0.9}},
     ["L1H2: AIE +0.031, attention on the examples' answers 0.46",
      "L2H0: AIE +0.002, attention on the examples' answers 0.20",
      "L3H3: AIE +0.002, attention on the examples' answers 0.30",
      "L1H1: AIE +0.001, attention on the examples' answers 0.00",
      "L0H0: AIE +0.001, attention on the examples' answers 0.90"]),
    ("name_mover", {"io_mass": {"L9H6": 0.614, "L9H9": 0.5}, "copy_score": {"L9H6": 0.87},
                    "negative_copy_score": {"L9H9": 0.12}},
     ["L9H6: IO mass 0.61, copy 0.87, negative copy 0.00",
      "L9H9: IO mass 0.50, copy 0.00, negative copy 0.12"]),
    ("negative_name_mover", {"io_mass": {"L24H4": 0.33}, "copy_score": {"L24H4": 0.01},
                             "negative_copy_score": {"L24H4": 0.95}},
     ["L24H4: IO mass 0.33, copy 0.01, negative copy 0.95"]),
    ("s_inhibition", {"s2_mass": {"L7H3": 0.41, "L8H6": 0.333}, "io_mass": {"L7H3": 0.05},
                      "above_name_movers": [[8, 6]]},
     ["L7H3: S2 mass 0.41, IO mass 0.05",
      "L8H6: S2 mass 0.33, IO mass 0.00 (not below the name movers)"]),
    ("successor", {"succession_score": {"L9H1": 0.8125, "L4H0": 0.5}},
     ["L9H1: succession 0.81", "L4H0: succession 0.50"]),
    ("positional", {"offset": {"L0H2": -1, "L1H8": 1}, "fraction": {"L0H2": 0.993, "L1H8": 0.9512}},
     ["L0H2: offset -1, 0.99 of queries", "L1H8: offset +1, 0.95 of queries"]),
    ("syntactic", {"relations": {
        "det": {"dep_to_head": {"head": [2, 5], "accuracy": 0.914, "baseline": 0.55,
                                "baseline_offset": 1, "count": 140, "syntactic": True}},
        "amod": {"head_to_dep": {"head": None, "accuracy": 0.3, "baseline": 0.4,
                                 "baseline_offset": -1, "count": 12}}}},
     ["relation  direction     best head  accuracy  baseline (offset)  cases",
      "det       dep_to_head   L2H5           0.91      0.55 (+1)      140 *",
      "amod      head_to_dep   -              0.30      0.40 (-1)       12"]),
]
# fmt: on


@pytest.mark.parametrize(
    ("name", "details", "lines"), [pytest.param(*r, id=r[0]) for r in TYPE_LINES]
)
def test_type_report_lines(name, details, lines):
    assert get_head_type(name).name == name
    assert evidence_lines(name, details) == lines
    assert evidence_lines(name, {}) == ([] if name != "syntactic" else lines[:1])


def test_evidence_lines_are_registered_under_type_names():
    """Every entry of EVIDENCE_LINES names a registered type; a type without one prints
    no lines of its own."""
    assert set(EVIDENCE_LINES) <= set(head_types()), sorted(set(EVIDENCE_LINES) - set(head_types()))
    assert evidence_lines("previous_token", {"anything": 1}) == []


def test_evidence_prints_each_types_lines_before_its_validation(capsys):
    records = {"positional": SHAPES[0][1], "successor": None}
    catalog = _catalog(records)
    catalog.types["positional"].details.update(TYPE_LINES[6][1])
    catalog.types["successor"].details.update(TYPE_LINES[5][1])
    report.evidence(catalog)
    assert capsys.readouterr().out == (
        "\npositional:\n  L0H2: offset -1, 0.99 of queries\n  L1H8: offset +1, 0.95 of queries\n"
        f"  {SHAPES[0][2]}\n"
        "\nsuccessor:\n  L9H1: succession 0.81\n  L4H0: succession 0.50\n"
    )


REPORTING = ["copy_suppression", "function_vector", "name_mover", "negative_name_mover",
             "s_inhibition", "successor", "positional"]  # fmt: skip


def test_real_details_with_labelled_heads_print_every_head(tiny_models, tmp_path, capsys):
    """Every type with evidence lines, classified on the tiny LLaMA with every head
    labelled (the threshold at the low end of its score's range), saved and read back as ``--catalog`` does: each type prints
    one line per head its details list (function vectors: the five largest AIEs), with the
    number the score tensor gives."""
    model = tiny_models["llama"]

    def lowest(name: str) -> float:
        T = get_head_type(name)
        return (T.threshold_range or T.score_range)[0]

    types = [get_head_type(n)(lowest(n)) for n in REPORTING]
    types[0] = get_head_type("copy_suppression")(lowest("copy_suppression"), n_tokens=50)
    cat = classify(model, types, n_sentences=8, n_sequences=6, n_boot=0)
    cat.save(tmp_path)
    report.evidence(HeadCatalog.load(tmp_path / "catalog.json"))
    out = capsys.readouterr().out
    assert out.startswith("\n")
    blocks = dict(b.split(":\n", 1) for b in out[1:].split("\n\n"))  # type -> its lines
    assert sorted(blocks) == sorted(REPORTING)
    every = {f"L{la}H{h}" for la in range(2) for h in range(4)}
    for name, text in blocks.items():
        score = cat[name].score
        lines = {}  # head -> its line
        for line in text.rstrip("\n").split("\n"):
            # at the low end of the range, failing a further criterion (heads that fail the
            # same one share a line)
            rejected = re.fullmatch(r"  not labelled ((?:L\d+H\d+ [-.\d]+(?:, )?)+): (.+)", line)
            if rejected is not None:
                for h in re.findall(r"L\d+H\d+", rejected[1]):
                    assert h not in {str(x) for x in cat[name].heads}, (name, line)
                    assert h in {e["head"] for e in cat[name].not_labelled}, (name, line)
                continue
            head = re.fullmatch(r"  (L\d+H\d+): .*", line)
            assert head is not None and head[1] not in lines, (name, line)
            lines[head[1]] = line[2:]
        if name == "function_vector":  # the five largest AIEs (as the details round them)
            rounded = {h: round(float(score[int(h[1]), int(h[3])]), 4) for h in every}
            assert len(lines) == 5
            assert min(rounded[h] for h in lines) >= max(rounded[h] for h in every - set(lines))
        else:
            assert set(lines) == every, name  # every head is labelled (or over the mass cut)
        for h, line in lines.items():
            v = float(score[int(h[1]), int(h[3])])
            want = {
                "copy_suppression": f"{h}: suppresses its own token for {v:.0%} of tokens",
                "function_vector": f"{h}: AIE {round(v, 4):+.3f}, attention on the examples'",
                "name_mover": f"{h}: IO mass {v:.2f}, copy ",
                "negative_name_mover": f"{h}: IO mass {v:.2f}, copy ",
                "s_inhibition": f"{h}: S2 mass {v:.2f}, IO mass ",
                "successor": f"{h}: succession {v:.2f}",
                "positional": f"{h}: offset ",
            }[name]
            assert line.startswith(want), (name, line, want)
            if name == "positional":
                assert re.fullmatch(rf"{h}: offset [+-][1-4], {v:.2f} of queries", line), line


def test_function_vector_report_is_best_first_after_a_json_round_trip(tmp_path):
    """catalog.json sorts keys, so the details read back list heads by name: the report
    still prints the five largest AIEs, largest first (it printed the first five names)."""
    from headmech.runs.provenance import dumps

    details = {
        "aie": {"L3H3": 0.0019, "L1H2": 0.0312, "L0H1": -0.0042, "L2H0": 0.002, "L0H0": 0.001,
                "L1H1": 0.0011},
        "label_mass": {"L1H2": 0.456, "L0H1": 0.1, "L2H0": 0.2, "L3H3": 0.3, "L0H0": 0.9},
    }  # fmt: skip
    back = json.loads(dumps(details))
    assert list(back["aie"])[:2] == ["L0H0", "L0H1"]  # by name: the worst head second
    want = [
        "L1H2: AIE +0.031, attention on the examples' answers 0.46",
        "L2H0: AIE +0.002, attention on the examples' answers 0.20",
        "L3H3: AIE +0.002, attention on the examples' answers 0.30",
        "L1H1: AIE +0.001, attention on the examples' answers 0.00",
        "L0H0: AIE +0.001, attention on the examples' answers 0.90",
    ]
    lines = evidence_lines("function_vector", back)
    assert lines == want and evidence_lines("function_vector", details) == want
