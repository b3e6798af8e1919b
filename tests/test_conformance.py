"""Every catalog head type passes the conformance checks (headmech.testing), and what the
positive controls rest on is checked independently of the types themselves.

Types scored from attention: the harness' positive control plants a type's own ideal
pattern (``headmech.testing.planting.ideal_pattern``, built from its own ``targets()``)
and scores it with the same class, so a wrong ``targets()`` passes it (see
:func:`test_a_wrong_targets_passes_the_harness_but_not_the_hand_definition`). Here each
type's perfect head is written out again by hand, from the probe's tokens and data alone,
in plain Python loops (``HAND``): the type's ideal pattern must equal it entry for entry,
and a head planted with the hand-written pattern must be the type's top head.

Types scored from weights or from runs of the model (copy_suppression, successor,
function_vector, inactive): nothing is planted; the positive control is a tiny model built
by hand (``headmech.testing.controls.POSITIVE_CONTROLS``) whose head PLANTED does the job, and the
type's own score, computed from that model as from any other, must rank it first. Here
each hand-built head is shown to do its job by a direct reading of the model (attention,
its direct effect on the logits, the answer's probability with and without it), and the
score function is mutated (a sign flipped, a wrong index, a weight left out) to show that
a wrong score fails the positive control.

A contributor adds one thing here: the new type's hand-written perfect head, a function
in ``HAND`` (docs/contributing-head-types.md, "The hand-written definition"). Which types
are scored from attention is derived (every type without a hand-built model in
``POSITIVE_CONTROLS``); a type without a hand definition fails
:func:`test_every_type_has_a_hand_definition` and its own tests with a message naming the
type, its file, and the dict to add it to.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable

import pytest
import torch

from headmech.core.head_index import HeadIndex
from headmech.headtypes.induction import InductionHead
from headmech.headtypes.previous_token import PreviousTokenHead
from headmech.headtypes.registry import HeadType, get_head_type, head_types
from headmech.interventions import Intervention, Zero, applied, capture
from headmech.probes import build_probe
from headmech.probes.icl import shuffle_labels
from headmech.probes.ordinal import ordinal_runs
from headmech.stream.engine import HeadStats, ProbeBatch
from headmech.testing import (
    CONTROL_OPTIONS,
    check_positive_control,
    head_type_checks,
    planted_statistics,
    tiny_model,
)
from headmech.testing.controls import (
    PLANTED,
    POSITIVE_CONTROLS,
    copy_suppression_model,
    function_vector_model,
    inactive_model,
    successor_model,
)
from headmech.testing.planting import IDEAL_PATTERNS, IDEAL_WEIGHT_STATISTICS, ideal_pattern


@pytest.mark.parametrize(("head_type", "check"), list(head_type_checks()))
def test_head_type_conformance(head_type, check):
    check(head_type())


def test_the_harness_emits_only_checks_that_can_run():
    """A check with nothing to test is not emitted (it would pass without testing): the
    blockwise check for types without a blockwise pattern reducer; called anyway, it fails
    saying so."""
    from headmech.testing import applies, check_blocks_add_up

    emitted = {p.id for p in head_type_checks()}
    for name in ("copy_suppression", "successor", "syntactic"):
        assert f"{name}-check_blocks_add_up" not in emitted
        assert not applies(check_blocks_add_up, get_head_type(name)())
        with pytest.raises(AssertionError, match="no blockwise pattern reducer"):
            check_blocks_add_up(get_head_type(name)())
    assert "induction-check_blocks_add_up" in emitted
    assert {i.split("-")[0] for i in emitted} == set(head_types())


# --- hand-written perfect heads ------------------------------------------------------
# Each function returns, per sequence and query position, the set of key positions a
# perfect head of the type attends to (uniformly); a query with no target attends to
# itself (the convention of headmech.testing.planting.ideal_pattern). Only the probe's
# tokens and its data (extras) are read, never the type.

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


def _concordance(batch: ProbeBatch, model) -> Targets:
    """The verb (the last token) attends to the noun of its number: the subject (the token
    after the prompt's "The") when they agree, else the attractor (the token before it)."""
    from headmech.probes.agreement import NOUNS

    tok = model.tokenizer
    (the,) = tok.encode("The", add_special_tokens=False)
    plural_nouns = {" " + p for _, p in NOUNS}
    out = []
    for ids, _, n in _rows(batch):
        subject = ids.index(the) + 1
        noun_plural = tok.decode([ids[subject]]) in plural_nouns
        verb_plural = tok.decode([ids[n - 1]]) in {" are", " were", " have"}
        row: list[set[int]] = [set() for _ in ids]
        row[n - 1] = {subject if noun_plural == verb_plural else n - 2}
        out.append(row)
    return out


def _qrhead(batch: ProbeBatch, model) -> Targets:
    """From each token of the question (its "Question" through the "?") to every token of
    the document naming the person it asks about (found by a plain search for the name
    after "does"); a null twin ("Question: N/A") asks nothing."""
    tok = model.tokenizer
    out = []
    for r, (ids, _, n) in enumerate(_rows(batch)):
        words = [tok.decode([t]) for t in ids[:n]]
        row: list[set[int]] = [set() for _ in ids]
        out.append(row)
        start = max(i for i, w in enumerate(words) if w.strip() == "Question")
        if "?" not in "".join(words[start:]):
            continue  # the null query
        end = next(i for i in range(start, n) if "?" in words[i]) + 1
        name = ids[next(i for i in range(start, end) if words[i].strip() == "does") + 1]
        spans = zip(batch.extras["doc_start"][r].tolist(), batch.extras["doc_end"][r].tolist(), strict=True)  # fmt: skip
        (gold,) = [(a, b) for a, b in spans if name in ids[a:b]]
        for q in range(start, end):
            row[q] = set(range(*gold))
    return out


def _fact_group(group: str) -> Callable[[ProbeBatch, object], Targets]:
    """A fact's last token reads the subject's (or the relation's) tokens: the prompt is
    the start tokens, then the subject, then the relation, as spelled by the tokenizer."""
    from headmech.probes.facts import FACTS

    def targets(batch: ProbeBatch, model) -> Targets:
        tok = model.tokenizer
        out = []
        for ids, sp, n in _rows(batch):
            text = tok.decode([t for t, s in zip(ids[:n], sp[:n], strict=True) if not s])
            subject, relation, _ = next(f for f in FACTS if f[0] + f[1] == text)
            start = next(i for i in range(n) if not sp[i])
            n_subject = len(tok.encode(subject, add_special_tokens=False))
            span = range(start, start + n_subject) if group == "subject" else range(start + n_subject, n)  # fmt: skip
            row: list[set[int]] = [set() for _ in ids]
            row[n - 1] = set(span)
            out.append(row)
        return out

    return targets


def _locos(batch: ProbeBatch, model) -> Targets:
    """From the answer's last token to every token of the document naming the person asked
    about (the name just before " lives in" at the end, found by a plain search)."""
    out = []
    for r, (ids, _, n) in enumerate(_rows(batch)):
        name = ids[n - 3]  # "... Answer: Mary lives in"
        spans = zip(batch.extras["doc_start"][r].tolist(), batch.extras["doc_end"][r].tolist(), strict=True)  # fmt: skip
        (gold,) = [(a, b) for a, b in spans if name in ids[a:b]]
        row: list[set[int]] = [set() for _ in ids]
        row[n - 1] = set(range(*gold))
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
    "concordance": _concordance,
    "qrhead": _qrhead,
    "locos": _locos,
    "cri": _locos,  # read from the answer step to the gold document, as LOCOS's
    "subject": _fact_group("subject"),
    "relation": _fact_group("relation"),
}
# Types whose score reads the attention pattern: every type but those scored from weights
# or runs of the model, whose positive control is a hand-built model (checked at the end
# of this file). Derived, so a new attention type needs nothing here but its HAND entry.
TYPES = sorted(head_types())
ATTENTION_SCORED = [name for name in TYPES if name not in POSITIVE_CONTROLS]


def _missing_hand(name: str) -> str:
    """Why ``name`` fails here: it has no hand-written perfect head in ``HAND``."""
    cls = head_types()[name]
    where = inspect.getsourcefile(cls) or cls.__module__
    return (
        f"head type '{name}' ({cls.__qualname__}, {where}) has no hand-written definition: "
        f"add a function returning its perfect head's targets, written from the probe's "
        f"tokens and data alone, to the dict HAND in tests/test_conformance.py, as "
        f'"{name}": _{name} (docs/contributing-head-types.md, "The hand-written definition")'
    )


def _hand(name: str) -> Callable[[ProbeBatch, object], Targets]:
    """The hand-written definition of ``name``; a failure that says what to add, else."""
    if name not in HAND:
        pytest.fail(_missing_hand(name), pytrace=False)
    return HAND[name]


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
    """The type's statistics with head PLANTED attending by ``pattern(batch)`` (as the
    harness plants it, its other statistics at their ideal values for that head)."""
    return planted_statistics(t, model, batches, lambda b: pattern(b))


def test_every_type_has_a_hand_definition():
    missing = [name for name in TYPES if name not in HAND]
    assert not missing, "\n".join(_missing_hand(name) for name in missing)
    stale = sorted(set(HAND) - set(TYPES))
    assert not stale, f"HAND in tests/test_conformance.py defines unregistered types: {stale}"
    assert set(POSITIVE_CONTROLS) <= set(TYPES), sorted(set(POSITIVE_CONTROLS) - set(TYPES))


def test_planted_values_are_registered_under_type_names():
    """What ``headmech.testing.planting`` plants is keyed by registered types' names;
    values are planted only for types scored from attention (the others have a hand-built
    model)."""
    assert set(IDEAL_PATTERNS) <= set(TYPES), sorted(set(IDEAL_PATTERNS) - set(TYPES))
    extra = set(IDEAL_WEIGHT_STATISTICS) - set(ATTENTION_SCORED)
    assert not extra, sorted(extra)


@pytest.mark.parametrize("name", TYPES)
def test_ideal_pattern_equals_the_hand_written_definition(name):
    """The type's ideal pattern (:func:`ideal_pattern`, from its ``targets()`` or its own
    plant in ``IDEAL_PATTERNS``) equals the hand-written perfect head on every batch of the
    control probe, and that head has real targets."""
    hand_written = _hand(name)
    t = get_head_type(name)()
    model = _model(t)
    n_targets = 0
    for batch in build_probe(t.probe, model, CONTROL_OPTIONS).batches:
        hand = _pattern(hand_written(batch, model), batch.input_ids.shape[1])
        torch.testing.assert_close(ideal_pattern(t, batch).float(), hand, atol=1e-6, rtol=0)
        n_targets += int((hand.diagonal(dim1=1, dim2=2) < 1).sum())
    assert n_targets > 0, "the hand-written head attends only to itself: nothing checked"


@pytest.mark.parametrize("name", ATTENTION_SCORED)
def test_head_planted_by_hand_is_found_first(name):
    """A head attending by the hand-written definition is labelled and ranked first; the
    type's own targets play no part in planting it."""
    hand_written = _hand(name)
    t = get_head_type(name)()
    model = _model(t)
    probe = build_probe(t.probe, model, CONTROL_OPTIONS)

    def pattern(batch):
        return _pattern(hand_written(batch, model), batch.input_ids.shape[1])

    stats = _planted_stats(t, model, probe.batches, pattern)
    score = t.score(stats)
    heads = t.select(score, stats)
    assert heads and heads[0] == PLANTED, (
        f"{name}: the head planted by hand is not the top head ({heads[:3]}, its score "
        f"{float(score[PLANTED]):.3f}); a type scored from weights or runs of the model, not "
        f"from attention, needs a hand-built model in POSITIVE_CONTROLS "
        f"(headmech/testing/controls.py) instead"
    )


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
    assert not torch.allclose(ideal_pattern(t, batch).float(), hand)

    def pattern(b):
        return _pattern(HAND[t.name](b, model), b.input_ids.shape[1])

    stats = _planted_stats(t, model, probe.batches, pattern)
    assert PLANTED not in t.select(t.score(stats), stats)


# --- hand-built positive controls: the head does the job, a wrong score misses it ------


def _planted(model, batch, *sites: str) -> list[torch.Tensor]:
    """Head PLANTED's activations at ``blocks.1.attn.hook_{site}`` (head axis removed)."""
    names = [f"blocks.{PLANTED.layer}.attn.hook_{s}" for s in sites]
    got = capture(model, batch, names)
    return [got[n][:, PLANTED.head] if s == "pattern" else got[n][:, :, PLANTED.head] for s, n in zip(sites, names, strict=True)]  # fmt: skip


def _direct_logits(model, z: torch.Tensor) -> torch.Tensor:
    """What head PLANTED's output ``z`` adds to the logits through the unembedding alone."""
    w_o = model.W_O[PLANTED.layer, PLANTED.head].detach().float()
    return z @ w_o @ model.W_U.detach().float()  # [..., d_vocab]


def test_hand_built_copy_suppressor_lowers_the_token_it_attends_to():
    """On prose, PLANTED attends to the copies of the current token (itself and earlier
    ones), and where an earlier copy exists that token gets the lowest logit of the whole
    vocabulary from the head."""
    model = copy_suppression_model()
    n = 0
    for batch in build_probe("prose", model, CONTROL_OPTIONS).batches:
        pattern, z = _planted(model, batch, "pattern", "z")
        ids, real = batch.input_ids, batch.attention_mask.bool() & ~batch.special
        same = ids[:, :, None] == ids[:, None, :]
        assert float((pattern * same).sum(-1)[real].min()) > 0.9
        earlier = (same & torch.ones_like(same[0]).tril(-1)).any(-1) & real
        lowest = _direct_logits(model, z[earlier]).argmin(-1)
        assert torch.equal(lowest, ids[earlier])
        n += int(earlier.sum())
    assert n >= 20


def test_hand_built_successor_head_writes_the_next_item():
    """On the ordinal probe, each comma before a next item attends to the item before it,
    and among the task's items the head's direct effect is highest on the next item."""
    model = successor_model()
    runs = ordinal_runs(model.tokenizer)
    n = 0
    for batch in build_probe("ordinal", model, CONTROL_OPTIONS).batches:
        pattern, z = _planted(model, batch, "pattern", "z")
        logits = _direct_logits(model, z)
        for row, pos in batch.extras["next_item"].nonzero().tolist():
            assert float(pattern[row, pos, pos - 1]) > 0.9
            items = torch.tensor([t for run in runs[batch.extras["task"][row]] for t in run])
            best = items[logits[row, pos, items].argmax()]
            assert int(best) == int(batch.input_ids[row, pos + 1])
            n += 1
    assert n >= 16 * 3


def test_hand_built_inactive_head_parks_on_bos_and_writes_nothing():
    """On every domain PLANTED's output norm is below 1% of its layer's other heads'; where
    a sequence starts with BOS it puts its attention there."""
    model = inactive_model()
    w_o = model.W_O[PLANTED.layer].detach().float()  # [n_heads, d_head, d_model]
    for batch in build_probe("domains", model, CONTROL_OPTIONS).batches:
        z = capture(model, batch, [f"blocks.{PLANTED.layer}.attn.hook_z"])
        z = next(iter(z.values()))[batch.attention_mask.bool()]  # [token, n_heads, d_head]
        norms = torch.einsum("thd,hdm->thm", z, w_o).norm(dim=-1).mean(0)  # [n_heads]
        others = torch.cat([norms[: PLANTED.head], norms[PLANTED.head + 1 :]])
        assert float(norms[PLANTED.head]) < 0.01 * float(others.min())
        if batch.extras["domain"] == "repeated_random":
            (pattern,) = _planted(model, batch, "pattern")
            assert float(pattern[:, 1:, 0].min()) > 0.9


def _p_answer(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    p = logits[:, -1].float().softmax(-1)
    return p[torch.arange(len(p)), batch.extras["answer"]]


def test_hand_built_function_vector_head_carries_the_task():
    """The model answers in-context prompts, echoes the query when the examples' answers
    are shuffled, and echoes it too without PLANTED, which at the query attends to the
    examples' answers."""
    model = function_vector_model()
    ablated = [Intervention.on([PLANTED], Zero(), site="z")]
    for batch in build_probe("icl", model, CONTROL_OPTIONS).batches:
        assert float(_p_answer(model, batch).mean()) > 0.9
        assert float(_p_answer(model, shuffle_labels(batch, model, 0)).mean()) < 0.1
        with applied(model, ablated):
            assert float(_p_answer(model, batch).mean()) < 0.1
        (pattern,) = _planted(model, batch, "pattern")  # antonyms: some queries are answers too
        assert float((pattern[:, -1] * batch.extras["label"]).sum(-1).mean()) > 0.9


@pytest.mark.parametrize("planted", ["subject", "relation"])
def test_hand_built_fact_heads_write_the_answer_from_their_group(planted):
    """The model completes every fact of the probe; at the last token PLANTED reads its
    group's tokens and head 0 the other group's; without PLANTED's subject head the model
    completes few facts (the relation head alone writes only a relation's mean answer)."""
    from headmech.probes.facts import answer_is_top
    from headmech.testing.recall_controls import facts_model

    model = facts_model(planted)
    other = "relation" if planted == "subject" else "subject"
    batches = build_probe("facts", model, CONTROL_OPTIONS).batches
    assert bool(answer_is_top(model, batches).all())
    subject_head = PLANTED if planted == "subject" else HeadIndex(1, 0)
    ablated = [Intervention.on([subject_head], Zero(), site="z")]
    with applied(model, ablated):
        assert float(answer_is_top(model, batches).float().mean()) < 0.5
    for batch in batches:
        (pattern,) = _planted(model, batch, "pattern")  # PLANTED's [batch, query, key]
        rows = torch.arange(len(pattern))
        last = pattern[rows, batch.extras["end_pos"]]
        assert float((last * batch.extras[planted]).sum(-1).min()) > 0.99
        z = capture(model, batch, ["blocks.1.attn.hook_pattern"])["blocks.1.attn.hook_pattern"]
        assert (
            float((z[rows, 0, batch.extras["end_pos"]] * batch.extras[other]).sum(-1).min()) > 0.99
        )


def test_hand_built_locos_head_reads_the_gold_city_and_writes_it():
    """The model answers every question; at the last token PLANTED attends to the gold
    document's city; without it the model answers few."""
    from headmech.probes.facts import answer_is_top
    from headmech.testing.recall_controls import documents_model

    model = documents_model()
    batches = build_probe("documents", model, CONTROL_OPTIONS).batches
    assert bool(answer_is_top(model, batches).all())
    with applied(model, [Intervention.on([PLANTED], Zero(), site="z")]):
        assert float(answer_is_top(model, batches).float().mean()) < 0.5
    for batch in batches:
        (pattern,) = _planted(model, batch, "pattern")
        rows = torch.arange(len(pattern))
        e = batch.extras
        assert float(pattern[rows, e["end_pos"], e["answer_pos"]].min()) > 0.9


def _mutant(module_name: str, function: str, old: str, new: str) -> Callable:
    """``module.function`` compiled again from its source with ``old`` replaced by ``new``."""
    import importlib

    module = importlib.import_module(module_name)
    source = textwrap.dedent(inspect.getsource(getattr(module, function)))
    assert source.count(old) == 1, f"{old!r} is not once in {function}"
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), f"<mutant of {function}>", "exec"), namespace)
    return namespace[function]


# (type, module, function, original, mutation): each mutation leaves the type's score
# running and wrong; a control that planted the score's statistic passed every one
MUTANTS = [
    ("copy_suppression", "headmech.headtypes.copy_suppression", "suppression_scores",
     "_, below = own_token_ranks", "below, _ = own_token_ranks"),  # counts raised tokens
    ("successor", "headmech.headtypes.successor", "succession_counts",
     "== (src + 1)", "== (src - 1)"),  # the previous item
    ("successor", "headmech.headtypes.successor", "succession_counts",
     "logits.argmax(-1)", "logits.argmin(-1)"),
    ("function_vector", "headmech.headtypes.function_vector", "indirect_effects",
     "(clean - values)", "(values - clean)"),
    ("function_vector", "headmech.headtypes.function_vector", "indirect_effects",
     '"z", pos=-1', '"z", pos=0'),  # patched at the first token, not the query
    ("subject", "headmech.interventions.sources", "subject_relation_scores",
     '[e["subject"], e["relation"]]', '[e["relation"], e["subject"]]'),  # the other group
    ("locos", "headmech.interventions.sources", "locos_scores",
     'W_U[:, e["answer"]].T', 'W_U[:, e["answer"] - 1].T'),  # another token's direction
    ("locos", "headmech.interventions.sources", "locos_scores",
     "on = (phi * needle[:, None, None])", "on = (phi * (keys & ~needle)[:, None, None])"),
    ("cri", "headmech.headtypes.cri", "_contrast",
     "return query, good, bad", "return query, bad, good"),  # the counterfactual as answer
    ("cri", "headmech.headtypes.cri", "remove_needle",
     "lo, hi = needle_span(batch)", "hi, lo = needle_span(batch)"),  # nothing removed
    ("relation", "headmech.interventions.sources", "subject_relation_scores",
     '"relation": mean[1]', '"relation": mean[2]'),  # the keys of neither group
    ("subject", "headmech.interventions.sources", "direct_effects_by_source",
     "W_U[:, target].T - W_U.mean(1)", "W_U.mean(1) - W_U[:, target].T"),  # the sign
    ("inactive", "headmech.headtypes.inactive", "output_norms",
     'torch.einsum("nhd,hdm->nhm", z[la][real], w_o[la].to(z.device))',
     "z[la][real]"),  # the norm of z, without W_O
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "module", "function", "old", "new"), MUTANTS, ids=[f"{m[0]}-{m[4]}" for m in MUTANTS]
)
def test_a_wrong_score_fails_the_hand_built_control(monkeypatch, name, module, function, old, new):
    head_type = get_head_type(name)()
    POSITIVE_CONTROLS[name]()  # built before the mutation: the model does not depend on it
    monkeypatch.setattr(module + "." + function, _mutant(module, function, old, new))
    with pytest.raises(AssertionError, match="planted head"):
        check_positive_control(head_type)
