"""Every catalog head type passes the conformance checks (headmech.testing), and every
type's targets are checked against an independent, hand-written definition.

The harness' positive control plants a type's own ``ideal_pattern`` (built from its own
``targets()``) and scores it with the same class, so a wrong ``targets()`` passes it (see
:func:`test_a_wrong_targets_passes_the_harness_but_not_the_hand_definition`). Here each
type's perfect head is written out again by hand, from the probe's tokens and data alone,
in plain Python loops (``HAND``): the type's ``ideal_pattern`` must equal it entry for
entry, and a head planted with the hand-written pattern must be the type's top head.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from headmech.catalog.induction import InductionHead
from headmech.catalog.previous_token import PreviousTokenHead
from headmech.engine import HeadStats, ProbeBatch, stream_statistics
from headmech.heads import HeadType, get_head_type, head_types
from headmech.interventions import Intervention, Set, applied
from headmech.probes import build_probe
from headmech.testing import (
    CONTROL_OPTIONS,
    PLANTED,
    check_positive_control,
    head_type_checks,
    tiny_model,
)


@pytest.mark.parametrize(("head_type", "check"), list(head_type_checks()))
def test_head_type_conformance(head_type, check):
    check(head_type())


# --- hand-written perfect heads ------------------------------------------------------
# Each function returns, per sequence and query position, the set of key positions a
# perfect head of the type attends to (uniformly); a query with no target attends to
# itself (the convention of HeadType.ideal_pattern). Only the probe's tokens and its
# data (extras) are read, never the type.

Targets = list[list[set[int]]]  # [sequence][query] -> keys


def _rows(batch: ProbeBatch) -> list[tuple[list[int], list[bool], int]]:
    """Per sequence: token ids, special-token flags and the number of real tokens."""
    ids, special = batch.input_ids.tolist(), batch.special.tolist()
    lengths = batch.attention_mask.sum(1).tolist()
    return list(zip(ids, special, lengths, strict=True))


def _previous(batch: ProbeBatch, model) -> Targets:
    out = []
    for ids, sp, _ in _rows(batch):
        out.append(
            [{i - 1} if i > 0 and not sp[i] and not sp[i - 1] else set() for i in range(len(ids))]
        )
    return out


def _duplicate(batch: ProbeBatch, model) -> Targets:
    out = []
    for ids, sp, _ in _rows(batch):
        row = []
        for i in range(len(ids)):
            row.append({j for j in range(i) if ids[j] == ids[i] and not sp[i] and not sp[j]})
        out.append(row)
    return out


def _induction(batch: ProbeBatch, model) -> Targets:
    """The key right after each earlier copy of the query's token."""
    out = []
    for ids, sp, n in _rows(batch):
        real = [t for t, s in zip(ids[:n], sp[:n], strict=True) if not s]
        half = len(real) // 2
        # the probe's random halves have no repeated token of their own (else a query
        # would have several earlier copies, which the type does not count)
        assert len(set(real[:half])) == half, "a chance repeat inside a random half"
        row = []
        for i in range(len(ids)):
            copies = [j for j in range(i - 1) if ids[j] == ids[i] and not sp[i] and not sp[j]]
            row.append({j + 1 for j in copies})
        out.append(row)
    return out


def _sink(batch: ProbeBatch, model) -> Targets:
    return [[{0} if i >= 1 and not sp[i] else set() for i in range(len(ids))] for ids, sp, _ in _rows(batch)]  # fmt: skip


def _rare(batch: ProbeBatch, model) -> Targets:
    """Every ordinary token that is not a rarest one attends to the rarest tokens (fewest
    occurrences in the reference counts, ``extras["token_count"]``)."""
    out = []
    for (ids, sp, _), count in zip(_rows(batch), batch.extras["token_count"].tolist(), strict=True):
        ordinary = [i for i in range(len(ids)) if not sp[i] and count[i] >= 0]
        if not ordinary:
            out.append([set() for _ in ids])
            continue
        lowest = min(count[i] for i in ordinary)
        rare = {i for i in ordinary if count[i] == lowest}
        out.append(
            [set(rare) if i in ordinary and i not in rare else set() for i in range(len(ids))]
        )
    return out


def _syntactic(batch: ProbeBatch, model) -> Targets:
    """Every token of a word attends to the tokens of the word's syntactic head (spaCy's
    parse in the extras); a root's head is itself: no target."""
    out = []
    word_ids = batch.extras["word_ids"].tolist()
    word_heads = batch.extras["word_heads"].tolist()
    for words, heads in zip(word_ids, word_heads, strict=True):
        row = []
        for w in words:
            if w < 0 or heads[w] == w:
                row.append(set())
            else:
                row.append({j for j, v in enumerate(words) if v == heads[w]})
        out.append(row)
    return out


def _retrieval(batch: ProbeBatch, model) -> Targets:
    """At each answer step (the query before an answer token), the needle's copy of that
    token: the answer is found again inside the needle sentence by a plain search."""
    out = []
    for r, (ids, _, _) in enumerate(_rows(batch)):
        answer = [a for a in batch.extras["answer_pos"][r].tolist() if a >= 0]
        tokens = [ids[a] for a in answer]
        start, end = int(batch.extras["needle_start"][r]), int(batch.extras["needle_end"][r])
        found = [s for s in range(start, end - len(tokens) + 1) if ids[s : s + len(tokens)] == tokens]  # fmt: skip
        assert len(found) == 1, "the answer should occur once in the needle"
        row: list[set[int]] = [set() for _ in ids]
        for k, a in enumerate(answer):
            row[a - 1] = {found[0] + k}
        out.append(row)
    return out


def _end_to_name(which: str) -> Callable[[ProbeBatch, object], Targets]:
    """IOI: the prompt's last token attends to the indirect object (the name that occurs
    once) or to the subject's second occurrence (the name that occurs twice)."""

    def targets(batch: ProbeBatch, model) -> Targets:
        out = []
        for r, (ids, _, n) in enumerate(_rows(batch)):
            name = int(batch.extras["io" if which == "io" else "s"][r])
            where = [j for j in range(n) if ids[j] == name]
            assert len(where) == (1 if which == "io" else 2), (which, where)
            row: list[set[int]] = [set() for _ in ids]
            row[n - 1] = {where[-1]}
            out.append(row)
        return out

    return targets


def _copy_suppression(batch: ProbeBatch, model) -> Targets:
    """Each token attends to its latest earlier copy."""
    out = []
    for ids, sp, _ in _rows(batch):
        row = []
        for i in range(len(ids)):
            copies = [j for j in range(i) if ids[j] == ids[i] and not sp[j] and not sp[i]]
            row.append({copies[-1]} if copies else set())
        out.append(row)
    return out


def _successor(batch: ProbeBatch, model) -> Targets:
    """Each comma (the position that predicts the next item) attends to the item before it."""
    (comma,) = model.tokenizer.encode(",", add_special_tokens=False)
    out = []
    for ids, sp, n in _rows(batch):
        row: list[set[int]] = [set() for _ in ids]
        for i in range(n):
            if ids[i] == comma:
                items = [j for j in range(i) if not sp[j] and ids[j] != comma]
                row[i] = {items[-1]}
        out.append(row)
    return out


def _function_vector(batch: ProbeBatch, model) -> Targets:
    """The prompt's last token (the query's colon) attends to the examples' answers: the
    tokens right after every earlier colon."""
    out = []
    for ids, _, n in _rows(batch):
        colon = ids[n - 1]
        row: list[set[int]] = [set() for _ in ids]
        row[n - 1] = {j + 1 for j in range(n - 1) if ids[j] == colon}
        out.append(row)
    return out


def _concept(batch: ProbeBatch, model) -> Targets:
    """The token before each multi-token word of the second copy attends to the last token
    of the same word in the first copy (Feucht et al. 2025)."""
    out = []
    rows = zip(
        _rows(batch),
        *(batch.extras[k].tolist() for k in ("word_pos", "copy", "word_len")),
        strict=True,
    )
    for (ids, _, _), word, copy, length in rows:
        where: dict[tuple[int, int], list[int]] = {}
        for i in range(len(ids)):
            if word[i] >= 0:
                where.setdefault((copy[i], word[i]), []).append(i)
        row: list[set[int]] = [set() for _ in ids]
        for (c, w), positions in where.items():
            if c == 1 and length[positions[0]] >= 2:
                row[positions[0] - 1] = {max(where[(0, w)])}
        out.append(row)
    return out


def _semantic(batch: ProbeBatch, model) -> Targets:
    """The token before a relation's tail attends to the head word's last token, when the
    head word comes earlier and not just before (Ren et al. 2024)."""
    labels = list(batch.extras["dep_labels"])
    rels = {"nsubj", "dobj", "amod", "advmod", "det", "pobj", "poss", "aux", "mark"}
    out = []
    for r, (ids, _, _) in enumerate(_rows(batch)):
        words = batch.extras["word_ids"][r].tolist()
        heads, deps = batch.extras["word_heads"][r].tolist(), batch.extras["word_deps"][r].tolist()
        row: list[set[int]] = [set() for _ in ids]
        for w in sorted({x for x in words if x >= 0}):
            pos = [i for i, x in enumerate(words) if x == w]
            h = heads[w]
            if 0 <= deps[w] < len(labels) and labels[deps[w]] in rels and 0 <= h < w:
                head_pos = [i for i, x in enumerate(words) if x == h]
                if head_pos and head_pos[-1] < pos[0] - 1:
                    row[pos[0] - 1] = {head_pos[-1]}
        out.append(row)
    return out


HAND: dict[str, Callable[[ProbeBatch, object], Targets]] = {
    "previous_token": _previous,
    "positional": _previous,  # its perfect head is a previous-token head (offset -1)
    "duplicate_token": _duplicate,
    "induction": _induction,
    "attention_sink": _sink,
    "rare_word": _rare,
    "syntactic": _syntactic,
    "retrieval": _retrieval,
    "name_mover": _end_to_name("io"),
    "negative_name_mover": _end_to_name("io"),
    "s_inhibition": _end_to_name("s2"),
    "copy_suppression": _copy_suppression,
    "successor": _successor,
    "function_vector": _function_vector,
    "inactive": _sink,  # a dormant head parks its attention on the first token
    "concept_induction": _concept,
    "semantic_induction": _semantic,
}
# types whose score reads the attention pattern (the others score weights or effects:
# their targets only shape the pattern a user plants)
ATTENTION_SCORED = [
    "previous_token", "positional", "duplicate_token", "induction", "attention_sink",
    "rare_word", "syntactic", "retrieval", "name_mover", "negative_name_mover", "s_inhibition",
    "concept_induction", "semantic_induction",
]  # fmt: skip


def _pattern(targets: Targets, n: int) -> torch.Tensor:
    p = torch.zeros(len(targets), n, n)
    for r, row in enumerate(targets):
        for i, keys in enumerate(row):
            for j in keys or {i}:
                p[r, i, j] = 1.0 / len(keys or {i})
    return p


def _model(t: HeadType):
    return tiny_model("causal" if t.causal_only else "encoder")


def _planted_stats(t: HeadType, model, batches: list[ProbeBatch], pattern) -> HeadStats:
    """The type's statistics with head PLANTED attending by ``pattern(batch)``, and its
    weight statistics at their ideal values for that head (as the harness does)."""
    total: HeadStats | None = None
    for batch in batches:
        planted = Intervention.on([PLANTED], Set(pattern(batch)[:, None]), site="pattern")
        with applied(model, [planted], strict=False), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # BERT: the edit misses the output
            s = stream_statistics(model, [batch], t.reducers())
        total = s if total is None else total + s
    assert total is not None
    ideal = t.ideal_weight_statistics()
    for key, value in {**t.weight_statistics(model), **t.model_statistics(model, batches)}.items():
        value = value.clone()
        if key in ideal:
            value[PLANTED] = ideal[key]
        total.set(f"{t.name}.{key}", value)
    return total


def test_every_type_has_a_hand_definition():
    assert sorted(HAND) == sorted(head_types())
    assert set(ATTENTION_SCORED) <= set(HAND)


@pytest.mark.parametrize("name", sorted(HAND))
def test_ideal_pattern_equals_the_hand_written_definition(name):
    """``ideal_pattern`` (from the type's ``targets()``) equals the hand-written perfect
    head on every batch of the control probe, and that head has real targets."""
    t = get_head_type(name)()
    model = _model(t)
    n_targets = 0
    for batch in build_probe(t.probe, model, CONTROL_OPTIONS).batches:
        hand = _pattern(HAND[name](batch, model), batch.input_ids.shape[1])
        torch.testing.assert_close(t.ideal_pattern(batch).float(), hand, atol=1e-6, rtol=0)
        n_targets += int((hand.diagonal(dim1=1, dim2=2) < 1).sum())
    assert n_targets > 0, "the hand-written head attends only to itself: nothing checked"


@pytest.mark.parametrize("name", ATTENTION_SCORED)
def test_head_planted_by_hand_is_found_first(name):
    """A head attending by the hand-written definition is labelled and ranked first; the
    type's own targets play no part in planting it."""
    t = get_head_type(name)()
    model = _model(t)
    probe = build_probe(t.probe, model, CONTROL_OPTIONS)

    def pattern(batch):
        return _pattern(HAND[name](batch, model), batch.input_ids.shape[1])

    stats = _planted_stats(t, model, probe.batches, pattern)
    score = t.score(stats)
    heads = t.select(score, stats)
    assert heads and heads[0] == PLANTED, (heads[:3], float(score[PLANTED]))


class _SkipsOneToken(PreviousTokenHead):
    """Wrong: attends two tokens back."""

    def targets(self, batch):
        t = super().targets(batch)
        return torch.where(t >= 1, t - 1, -1)


class _CopiesNotNext(InductionHead):
    """Wrong: attends to the earlier copy itself, not the token after it."""

    def targets(self, batch):
        t = super().targets(batch)
        return torch.where(t >= 1, t - 1, -1)


@pytest.mark.parametrize("wrong", [_SkipsOneToken, _CopiesNotNext])
def test_a_wrong_targets_passes_the_harness_but_not_the_hand_definition(wrong):
    """The circular control passes a wrong ``targets()``; the hand-written checks fail it."""
    t = wrong()
    model = _model(t)
    check_positive_control(t, model)  # plants its own (wrong) pattern: still "found"
    probe = build_probe(t.probe, model, CONTROL_OPTIONS)
    batch = probe.batches[0]
    hand = _pattern(HAND[t.name](batch, model), batch.input_ids.shape[1])
    assert not torch.allclose(t.ideal_pattern(batch).float(), hand)

    def pattern(b):
        return _pattern(HAND[t.name](b, model), b.input_ids.shape[1])

    stats = _planted_stats(t, model, probe.batches, pattern)
    assert PLANTED not in t.select(t.score(stats), stats)
