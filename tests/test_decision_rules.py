"""Every type's decision rule and defaults, pinned on made-up statistics (no model).

A head type decides in two steps: its score reaches the threshold (:meth:`HeadType.above`,
``>=`` on the score as catalog.json rounds it), then no further criterion rejects it
(:meth:`HeadType.rejected`). Here each rule is tried exactly at its boundary and one
representable step either side, so a ``>`` that became ``>=`` (or the reverse), a default
moved from 0.4 to 0.6 or a criterion that reads the wrong statistic fails in the fast tier,
not only when a slow check.json regeneration happens to move.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from headmech.core.head_index import HeadIndex
from headmech.core.stats import HeadStats
from headmech.headtypes.base import SCORE_DECIMALS
from headmech.headtypes.registry import get_head_type, head_types

# type -> (default threshold, the other keyword defaults of its constructor): the values the
# published catalogs were made with; changing one is a decision to write down here
DEFAULTS = {
    "attention_sink": (0.3, {}),
    "concept_induction": (0.4, {}),
    "concordance": (0.1, {"min_cases": 20, "alpha": 0.05}),
    "qrhead": (0.1, {"alpha": 0.05}),
    "locos": (1.0, {"alpha": 0.05}),
    "cri": (1.0, {"alpha": 0.05, "max_questions": None, "n_exact": 24}),
    "relation": (0.25, {"alpha": 0.05}),
    "subject": (0.25, {"alpha": 0.05}),
    "copy_suppression": (0.5, {"n_tokens": 500}),
    "duplicate_token": (0.4, {}),
    "function_vector": (0.01, {"max_prompts": 24}),
    "inactive": (0.5, {}),
    "induction": (0.4, {"copying_threshold": 0.0}),
    "name_mover": (0.3, {"copy_threshold": 0.5}),
    "negative_name_mover": (0.3, {"copy_threshold": 0.5}),
    "positional": (0.9, {"exclude_special_keys": True}),
    "previous_token": (0.5, {}),
    "rare_word": (0.3, {"min_ratio": 3.0}),
    "retrieval": (0.1, {}),
    "s_inhibition": (0.3, {}),
    "semantic_induction": (0.5, {}),
    "successor": (0.4, {}),
    "syntactic": (
        0.1,
        {
            "min_cases": 20,
            "relations": ("nsubj", "dobj", "amod", "advmod", "det", "pobj", "poss", "aux", "mark"),
            "alpha": 0.05,
        },
    ),
}
STEP = 10.0**-SCORE_DECIMALS  # one step of the score as catalog.json shows it
L, H = 3, 4


def _defaults(cls) -> dict:
    sig = inspect.signature(cls.__init__)
    return {
        k: p.default
        for k, p in sig.parameters.items()
        if k not in ("self", "threshold", "probe") and p.default is not inspect.Parameter.empty
    }


def test_every_type_has_its_defaults_pinned():
    assert sorted(DEFAULTS) == sorted(head_types()), "a type was added or removed: pin it here"


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_are_the_pinned_and_documented_ones(name):
    """The default threshold and every other keyword default are the pinned values, and
    the threshold is the number the type's own threshold note states."""
    cls = get_head_type(name)
    threshold, extra = DEFAULTS[name]
    assert cls.default_threshold == threshold
    assert cls().threshold == threshold
    assert _defaults(cls) == extra
    assert f"{threshold:g}" in cls.threshold_note, cls.threshold_note


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_threshold_is_at_or_above_on_the_shown_score(name):
    """A head exactly at the threshold is above it, one shown step below is not, a NaN
    (not measured) never is; heads come best first; a custom threshold replaces the
    default."""
    t = get_head_type(name)()
    th = t.threshold
    score = torch.full((L, H), float("nan"))
    score[0, 0] = th
    score[1, 2] = th - STEP
    score[2, 3] = th + 5 * STEP
    score[2, 0] = th - STEP / 10 * 6  # shown as one step below
    assert t.above(score) == [HeadIndex(2, 3), HeadIndex(0, 0)]
    higher = get_head_type(name)(threshold=th + 2 * STEP)
    assert higher.above(score) == [HeadIndex(2, 3)]


def _stats(**means: torch.Tensor) -> HeadStats:
    s = HeadStats(L, H)
    for key, value in means.items():
        for layer in range(L):
            s.add(key.replace("__", "."), layer, value[layer].double(), 1.0)
    return s


def _full(v: float) -> torch.Tensor:
    return torch.full((L, H), v, dtype=torch.float64)


def test_induction_copies_strictly_above_its_threshold():
    """The interval's lower end must exceed copying_threshold (> 0 nats): at 0 the head is
    rejected, just above it kept; with no interval drawn the effect itself is tested; with
    neither (not measured) it is rejected."""
    t = get_head_type("induction")()
    score = _full(0.9)
    effect, low, high = _full(0.5), _full(0.0), _full(1.0)
    low[0, 1] = 1e-6  # a positive lower end (HeadStats.mean is float32)
    low[1, 1] = float("nan")  # no interval: the effect (0.5) is tested
    low[1, 2], effect[1, 2] = float("nan"), 0.0  # no interval, no effect
    low[2, 2] = effect[2, 2] = float("nan")  # not measured
    stats = _stats(
        induction__own_effect=effect, induction__own_effect_low=low, induction__own_effect_high=high
    )
    kept = set(t.select(score, stats))
    assert kept == {HeadIndex(0, 1), HeadIndex(1, 1)}
    no = t.rejected(score, stats)
    assert HeadIndex(0, 0) in no and "not above 0" in no[HeadIndex(0, 0)]
    stricter = get_head_type("induction")(copying_threshold=0.5)  # exact in float32
    low2 = _full(0.5)
    low2[0, 0] = 0.5 + 1e-6
    stats2 = _stats(
        induction__own_effect=effect,
        induction__own_effect_low=low2,
        induction__own_effect_high=high,
    )
    assert stricter.select(score, stats2) == [HeadIndex(0, 0)]


def test_concept_induction_needs_more_mass_on_the_concept_than_on_the_token():
    t = get_head_type("concept_induction")()
    score = _full(0.6)
    token = _full(0.6)  # equal: a token induction head, rejected
    token[0, 0] = 0.6 - 1e-6  # less on the first token: kept
    stats = _stats(concept_induction__token__mass=token)
    assert t.select(score, stats) == [HeadIndex(0, 0)]


@pytest.mark.parametrize(("name", "key"), [("name_mover", "copy"), ("negative_name_mover", None)])
def test_name_movers_copy_at_or_above_and_attend_io_over_s(name, key):
    """The copy score at exactly copy_threshold passes (>=), a step below fails; the IO
    mass must exceed S1 + S2 strictly."""
    t = get_head_type(name)()
    copy_key = t.copy_key
    if key is not None:
        assert copy_key == key
    score = _full(0.5)
    copy = _full(0.5)  # at the threshold: passes
    copy[0, 1] = 0.5 - 1e-6  # a float32 step below (HeadStats.mean is float32)
    s1, s2 = _full(0.1), _full(0.1)
    s1[1, 1], s2[1, 1] = 0.25, 0.25  # S1 + S2 = IO mass: rejected
    s1[2, 2] = 0.25 - 1e-6  # just under: kept
    s2[2, 2] = 0.25
    stats = _stats(
        **{f"{name}__{copy_key}": copy, f"{name}__s1__mass": s1, f"{name}__s2__mass": s2}
    )
    no = t.rejected(score, stats)
    assert set(no) == {HeadIndex(0, 1), HeadIndex(1, 1)}
    assert "copy score" in no[HeadIndex(0, 1)] and "subject mass" in no[HeadIndex(1, 1)]
    assert HeadIndex(2, 2) in t.select(score, stats)


def test_s_inhibition_sits_below_the_name_movers_and_prefers_s2_over_io():
    t = get_head_type("s_inhibition")()
    score = _full(0.5)
    io = _full(0.1)
    io[0, 0] = 0.5  # S2 mass equal to IO mass: rejected
    below = _full(1.0)
    below[2] = 0.0  # layer 2 is not below the first name mover
    stats = _stats(s_inhibition__io__mass=io, s_inhibition__below_name_movers=below)
    no = t.rejected(score, stats)
    assert set(no) == {HeadIndex(0, 0)} | {HeadIndex(2, h) for h in range(H)}
    assert "IO mass" in no[HeadIndex(0, 0)] and "below the first name mover" in no[HeadIndex(2, 0)]


def test_rare_word_hit_rate_at_or_above_min_ratio_times_chance():
    t = get_head_type("rare_word")()
    chance = 0.125
    score = _full(0.5)
    score[0, 0] = t.min_ratio * chance  # exactly the bar: kept
    score[0, 1] = t.min_ratio * chance - 1e-6  # just under: rejected
    stats = _stats(rare_word__chance=_full(chance))
    assert set(t.rejected(score, stats)) == {HeadIndex(0, 1)}
    assert t.chance(stats) == chance
