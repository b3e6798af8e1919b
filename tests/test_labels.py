"""Labels a reader can trust: every head at or above a threshold is labelled or listed with
the criterion it failed; controls hold no head of the type; every labelled head (and every
rejected one) has its own effect.

On the trained toy (2 layers x 4 heads; its four layer-1 heads are induction heads, each
of whose removal alone raises the repeated half's loss by 0.09-0.14 nats), a copying
threshold of 0.104 nats (the lower end of a head's own effect must exceed it) labels L1H3
alone and rejects the three other induction heads for their measured copying: the case
of Qwen2.5's L23H2 and L9H10 (prefix matching, no copying), on a model small enough for
every check.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import headmech
from headmech.classification.classify import validate_heads
from headmech.classification.results import HeadCatalog
from headmech.core.head_index import HeadIndex
from headmech.headtypes.induction import InductionHead
from headmech.probes import ProbeOptions

SIZE = {"n_sequences": 8}
# between the lower ends of the heads' own effects (8 sequences): L1H3's (0.108) and the
# next, L1H1's (0.100)
COPYING = 0.104


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model("toy-induction")


@pytest.fixture(scope="module")
def strict(toy):
    """Induction on the toy with a copying threshold between its heads' own effects."""
    return headmech.classify(
        toy, [InductionHead(copying_threshold=COPYING)], validate=True, n_random=3, **SIZE
    )


def test_every_head_above_the_threshold_is_labelled_or_listed_with_its_reason(strict):
    r = strict["induction"]
    copying = r.details["copying_effect"]  # [effect, low, high] of each head ablated alone
    assert r.heads == [HeadIndex(1, 3)] and copying["L1H3"][1] > COPYING
    above = {str(h) for h in r.heads} | {e["head"] for e in r.not_labelled}
    want = {f"L{a}H{b}" for a, b in (r.score >= r.threshold).nonzero().tolist()}
    assert above == want == {"L1H0", "L1H1", "L1H2", "L1H3"}
    for e in r.not_labelled:
        assert e["score"] == pytest.approx(float(r.score[HeadIndex.parse(e["head"])]), abs=1e-6)
        effect, low, high = copying[e["head"]]
        said = re.match(
            r"own effect (\S+) nats \[(\S+), (\S+)\], not above 0.104: copying not measured",
            e["reason"],
        )
        assert said and low <= COPYING, e["reason"]
        assert [float(x) for x in said.groups()] == pytest.approx([effect, low, high], abs=6e-4)
        # the same measurement as the validation's: each head ablated alone
        assert r.per_head[e["head"]].effect == pytest.approx(effect, abs=6e-5)
    assert [e["score"] for e in r.not_labelled] == sorted(
        (e["score"] for e in r.not_labelled), reverse=True
    )
    # a head the type's own test rejects is never "borderline"
    assert not {str(h) for h in r.borderline} & {e["head"] for e in r.not_labelled}


def test_no_control_set_holds_a_head_of_the_type(strict):
    """The three rejected induction heads share the labelled head's layer: with them kept
    out, layer 1 holds no other set, and the controls come from within one layer (saying
    so): the labelled head and layer 0's four, never the labelled set itself."""
    r = strict["induction"]
    v = r.validation.to_json()
    assert sorted(map(tuple, v["excluded_from_controls"])) == [(1, 0), (1, 1), (1, 2)]
    assert v["control"] == "layers_within_1" and "only 0 distinct control set" in v["control_note"]
    assert (v["control_pool"], v["n_possible_sets"]) == (5, 4)
    drawn = {tuple(h) for s in v["control_sets"] for h in s}
    assert len(drawn) == 3 and all(layer == 0 for layer, _ in drawn)


def test_each_head_alone_is_the_effect_of_ablating_it_alone(toy, strict):
    """``per_head``: the labelled head and the three rejected ones, each ablated alone,
    against validate_heads on that head alone (same batches, same metric)."""
    r = strict["induction"]
    assert set(r.per_head) == {"L1H0", "L1H1", "L1H2", "L1H3"}
    assert r.per_head["L1H3"].labelled and not r.per_head["L1H0"].labelled
    t = InductionHead(copying_threshold=COPYING)
    for name in ("L1H0", "L1H3"):
        alone = validate_heads(toy, t, [HeadIndex.parse(name)], ProbeOptions(**SIZE), n_random=0)
        assert r.per_head[name].effect == pytest.approx(alone.primary.effect, rel=1e-4, abs=1e-6)
        lo, hi = r.per_head[name].interval
        assert lo <= r.per_head[name].effect <= hi
    red = r.validation.to_json()["redundancy"]  # the one labelled head: the set is the head
    assert red["ratio"] == pytest.approx(1.0, rel=1e-4)


def test_the_whole_set_against_its_heads_alone_on_the_toy(toy):
    """The toy's four induction heads: each alone costs little, together they cost the
    task (they back each other up), so the set's effect exceeds the sum of their own."""
    cat = headmech.classify(toy, ["induction"], validate=True, n_random=1, **SIZE)
    r = cat["induction"]
    assert len(r.heads) == 4 and r.not_labelled == []
    red = r.validation.to_json()["redundancy"]
    assert red["sum_of_own_effects"] == pytest.approx(sum(e.effect for e in r.per_head.values()))
    assert red["ratio"] > 2


def test_not_labelled_and_per_head_round_trip_and_are_checked(strict, tmp_path):
    strict.save(tmp_path)
    data = json.loads((tmp_path / "catalog.json").read_text())
    entry = data["types"]["induction"]
    assert entry["not_labelled"] == strict["induction"].not_labelled
    assert set(entry["per_head"]) == set(strict["induction"].per_head)
    back = HeadCatalog.load(tmp_path / "catalog.json")
    assert back["induction"].not_labelled == strict["induction"].not_labelled
    entry["not_labelled"][0]["head"] = "L7H0"  # outside the 2-layer toy
    (tmp_path / "catalog.json").write_text(json.dumps(data))
    with pytest.raises(headmech.core.errors.CatalogFileError, match="not_labelled names head"):
        HeadCatalog.load(tmp_path / "catalog.json")


def test_a_head_parses_from_its_name():
    assert HeadIndex.parse("L18H6") == HeadIndex(18, 6) == HeadIndex.parse(" l18h6 ")
    with pytest.raises(headmech.core.errors.HeadIndexError, match="write it as L<layer>H<head>"):
        HeadIndex.parse("18.6")


def test_every_type_says_what_its_threshold_means_and_the_null_it_beats():
    for name, cls in headmech.head_types().items():
        note = cls.threshold_note
        assert note and "docstring" not in note, name
        assert "null" in note, name  # the baseline the threshold is set against
        low, high = cls.threshold_range or cls.score_range
        assert low <= cls.default_threshold <= high, name


class _Stats:
    """The share of each pair's cases both the head and the baseline get right."""

    def __init__(self, both):
        self.both = both

    def mean(self, key):
        return self.both


def test_syntactic_significance_is_the_exact_sign_test_then_benjamini_hochberg(monkeypatch):
    """Two heads on one pair of 100 cases, baseline 0.40: head A right on 0.60 (0.35
    jointly with the baseline: n10 = 25, n01 = 5), head B right on 0.52 (0.20 jointly:
    n10 = 32, n01 = 20) -- then q over the two tests. B is 12 points above the baseline,
    past the threshold, but not significantly: rejected, with its q."""
    from scipy.stats import binomtest, false_discovery_control

    from headmech.headtypes.syntactic import SyntacticHead

    t = SyntacticHead(relations=("nsubj",))
    acc = torch.tensor([[[0.60, 0.52]], [[0.0, 0.0]]])  # [n_pairs, 1 layer, 2 heads]
    table = (acc, torch.tensor([0.40, 0.0]), torch.tensor([-1, 1]), torch.tensor([100, 5]))
    monkeypatch.setattr(SyntacticHead, "_table", lambda self, stats: table)
    both = torch.tensor([[0.35, 0.20]])
    p, q = t.significance(_Stats(both))
    want = [binomtest(25, 30, 0.5, alternative="greater").pvalue,
            binomtest(32, 52, 0.5, alternative="greater").pvalue]  # fmt: skip
    assert p[0, 0].tolist() == pytest.approx(want, rel=1e-5)
    assert q[0, 0].tolist() == pytest.approx(list(false_discovery_control(want)), rel=1e-5)
    assert p[1].eq(1).all() and q[1].eq(1).all()  # 5 cases < min_cases: not tested
    score = acc[0] - 0.40
    rejected = t.rejected(score, _Stats(both))
    assert HeadIndex(0, 0) not in rejected  # +0.20, q = 2e-4: labelled
    assert q[0, 0, 1] > 0.05 and list(rejected) == [HeadIndex(0, 1)]
    assert f"best q {float(q[0, 0, 1]):.3f}" in rejected[HeadIndex(0, 1)]


def test_the_command_lines_table_and_report_name_the_heads_not_labelled(toy, strict, capsys):
    """`headmech classify` prints the table and the evidence: the rejected heads appear in
    both, with the criterion they failed and (validated) their own effect."""
    from headmech.cli import report

    table = strict.table()
    row = next(line for line in table.splitlines() if line.startswith("induction"))
    assert " L1H3 0.98; not labelled: " in row and "none (best" not in row
    # a type that labels no head names its best-scoring one instead
    nothing = headmech.classify(toy, ["induction"], thresholds={"induction": 1.0}, **SIZE)
    r = nothing["induction"]
    best = HeadIndex(*divmod(int(r.score.argmax()), r.score.shape[1]))
    assert f"none (best {best} {float(r.score[best]):.2f})" in nothing.table()
    effect, low, high = strict["induction"].details["copying_effect"]["L1H0"]
    assert (
        f"L1H0 0.99 (own effect {effect:+.3f} nats [{low:+.3f}, {high:+.3f}], not above 0.104:"
        in row
    )
    report.evidence(strict)
    out = capsys.readouterr().out
    for e in strict["induction"].not_labelled:
        own = strict["induction"].per_head[e["head"]].effect
        assert (
            f"not labelled {e['head']} {e['score']:.3f}: {e['reason']}; own effect {own:+.4f}"
            in out
        )
    assert "each labelled head ablated alone: L1H3 " in out


def test_controls_widen_to_nearby_layers_when_the_same_layers_hold_too_few_sets():
    """SmolLM2's name movers: three labelled heads in layer 23, where three more may be
    name movers: six heads of the layer make 19 other sets, fewer than the 99 asked for.
    The controls come from the heads within one layer (none of them of the type, never the
    labelled set itself), and say so."""
    import warnings

    from headmech.classification.claims import control_space
    from headmech.classification.control_sets import draw_controls
    from headmech.models import ModelInfo

    info = ModelInfo("m", 30, 9, 3, 0, 0, True)
    heads = [HeadIndex(23, 1), HeadIndex(23, 0), HeadIndex(23, 2)]
    excluded = [HeadIndex(23, h) for h in (4, 7, 8)] + [HeadIndex(22, 7), HeadIndex(24, 4)]
    assert control_space(heads, 30, 9, "same_layers", excluded) == (6, 19)  # C(6, 3) - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sets, kind, note = draw_controls(info, heads, 99, 0, excluded)
        assert draw_controls(info, heads, 19, 0, excluded)[1] == "same_layers"
    assert kind == "layers_within_1" and "only 19 distinct control set" in note
    assert len({frozenset(s) for s in sets}) == 99
    drawn = {h for s in sets for h in s}
    assert all(22 <= h.layer <= 24 for h in drawn)
    assert not drawn & set(excluded) and frozenset(heads) not in {frozenset(s) for s in sets}
    pool, possible = control_space(heads, 30, 9, kind, excluded)
    assert pool == 27 - 5 and possible == 1539  # C(22, 3) - 1
    # as many sets as one layer on either side holds: still that distance, not two
    assert draw_controls(info, heads, 1539, 0, excluded)[1] == "layers_within_1"


def test_redundancy_is_the_set_over_the_sum_and_none_across_signs():
    """Qwen2.5's induction heads: the set +0.14, its heads' own effects summing to -0.04:
    no ratio (a ratio of -3.8 would read as strong back-up)."""
    from headmech.classification.validation import _per_head

    a, b = HeadIndex(0, 0), HeadIndex(0, 1)
    assert _per_head([a, b], [(a, 0.2, None), (b, 0.3, None)], 1.0)[2].ratio == 2.0
    mixed = _per_head([a, b], [(a, 0.05, None), (b, -0.09, None)], 0.14)[2]
    assert mixed.ratio is None and mixed.sum_of_own_effects == pytest.approx(-0.04)
    lower = _per_head([a], [(a, -0.5, [-0.7, -0.3])], -0.5)[2]  # negative movers
    assert lower.ratio == 1.0
    per, note, red = _per_head([a, b], [(a, 0.2, None)], 1.0)
    assert red is None and note.startswith("1 of 2 labelled") and per["L0H0"].effect == 0.2


def test_a_score_shown_at_the_threshold_is_at_the_threshold():
    """0.5 - 0.4 is 0.09999999 in float32, shown as 0.1 in catalog.json: it reaches 0.1."""
    from headmech.headtypes.base import at_or_above

    gain = torch.tensor([0.5], dtype=torch.float32) - torch.tensor([0.4], dtype=torch.float32)
    assert float(gain) < 0.1 and bool(at_or_above(gain, 0.1))
    assert not bool(at_or_above(torch.tensor([0.0999994]), 0.1))
    t = headmech.get_head_type("previous_token")(threshold=0.1)
    assert t.above(torch.stack([gain, torch.tensor([0.05])], 1)) == [HeadIndex(0, 0)]


def test_validation_ablates_alone_at_most_as_many_heads_as_asked(toy):
    """``classify(alone=(labelled, rejected))``: the highest-scoring labelled heads alone,
    the rest said in ``per_head_note``, and the cap in the provenance's settings."""
    cat = headmech.classify(
        toy,
        [InductionHead(copying_threshold=COPYING)],
        validate=True,
        n_random=1,
        alone=(1, 2),
        **SIZE,
    )
    r = cat["induction"]
    assert len(r.heads) == 1 and len(r.not_labelled) == 3
    alone = {h: e for h, e in r.per_head.items() if e.alone is not None}  # (all are read broadly)
    labelled = [h for h, e in alone.items() if e.labelled]
    rejected = [h for h, e in alone.items() if not e.labelled]
    assert labelled == ["L1H3"] and len(rejected) == 2
    assert set(rejected) == {e["head"] for e in r.not_labelled[:2]}  # the best first
    assert cat.to_json()["provenance"]["settings"]["alone"] == [1, 2]
    default = headmech.classify(toy, ["induction"], validate=True, n_random=1, **SIZE)
    assert "alone" not in default.to_json()["provenance"]["settings"]
    two = headmech.classify(toy, ["induction"], validate=True, n_random=1, alone=(2, 0), **SIZE)
    assert sum(e.alone is not None for e in two["induction"].per_head.values()) == 2
    assert two["induction"].validation.per_head_note == (
        "2 of 4 labelled heads ablated alone (the highest scores)"
    )


def test_alone_is_checked_in_python_and_on_the_command_line(toy, capsys):
    from headmech.cli import main

    with pytest.raises(headmech.core.errors.ArgumentError, match="alone must be two integers"):
        headmech.classify(toy, ["induction"], validate=True, alone=(1,))
    with pytest.raises(headmech.core.errors.ArgumentError, match="alone must be two integers"):
        headmech.classify(toy, ["induction"], validate=True, alone=(-1, 2))
    assert main(["classify", "toy-induction", "--validate", "--alone", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--alone takes two counts" in err[0]
