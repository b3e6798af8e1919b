"""Behaviour beyond the probe (headmech.classification.broad): the patterns on ordinary text against
brute force, and the shares against a hand computation from the full attention patterns."""

from __future__ import annotations

import pytest
import torch

from headmech.classification.broad import LENGTHS, NARROW, _grids, broad_behaviour, merge
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import get_head_type
from headmech.probes.broad import (
    DOMAINS,
    after_earlier_copy,
    broad_batches,
    copy_of_next,
    special_tokens,
)
from headmech.stream.engine import ProbeBatch


def _batch(ids: list[list[int]], special: list[list[bool]] | None = None) -> ProbeBatch:
    t = torch.tensor(ids)
    sp = torch.tensor(special) if special is not None else torch.zeros_like(t, dtype=torch.bool)
    return ProbeBatch(input_ids=t, attention_mask=torch.ones_like(t), special=sp, extras={})


IDS = [[0, 5, 6, 5, 7, 6, 5, 6], [0, 9, 9, 9, 3, 9, 3, 3]]
SPECIAL = [[True] + [False] * 7, [True] + [False] * 7]


def test_the_induction_pattern_on_text_is_the_token_after_an_earlier_copy():
    got = after_earlier_copy(_batch(IDS, SPECIAL))
    for b, ids in enumerate(IDS):
        for q in range(len(ids)):
            want = {
                j + 1
                for j in range(1, q - 1)  # j an earlier copy (not the BOS), before q - 1
                if ids[j] == ids[q] and not SPECIAL[b][q]
            }
            assert set(got[b, q].nonzero().flatten().tolist()) == want, (b, q)


def test_the_retrieval_pattern_on_text_is_an_earlier_copy_of_the_next_token():
    got = copy_of_next(_batch(IDS, SPECIAL))
    for b, ids in enumerate(IDS):
        for q in range(len(ids)):
            nxt = ids[q + 1] if q + 1 < len(ids) else None
            want = {k for k in range(1, q) if nxt is not None and ids[k] == nxt}
            want = want if not SPECIAL[b][q] else set()
            assert set(got[b, q].nonzero().flatten().tolist()) == want, (b, q)


def test_windows_come_from_every_domain_at_the_length_asked(tiny_models):
    model = tiny_models["llama"]
    batches, counts = broad_batches(model, 64, 3)
    assert set(counts) <= set(DOMAINS) and {"fiction", "news", "conversation"} <= set(counts)
    assert sum(counts.values()) == sum(b.input_ids.shape[0] for b in batches)
    assert all(b.input_ids.shape[1] == 64 for b in batches)
    assert all(n == 3 for n in counts.values())  # every text holds three windows of 64


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_windows_carry_the_special_tokens_every_probe_gets(tiny_models, kind):
    """A BOS where the tokenizer adds one to a sentence, [CLS] ... [SEP] for BERT: the
    first position of every window is the one a sink forms on."""
    model = tiny_models[kind]
    tok = model.tokenizer
    with_ = tok("A short sentence.", add_special_tokens=True)["input_ids"]
    bare = tok("A short sentence.", add_special_tokens=False)["input_ids"]
    before, after = special_tokens(tok)
    assert [*before, *bare, *after] == list(with_) and before  # both add a first token
    batches, _ = broad_batches(model, 64, 2)
    for b in batches:
        assert b.input_ids[:, : len(before)].tolist() == [before] * b.input_ids.shape[0]
        assert b.special[:, 0].all()
        if after:
            assert b.input_ids[:, -len(after) :].tolist() == [after] * b.input_ids.shape[0]


@pytest.mark.parametrize("name", ["previous_token", "attention_sink", "induction"])
def test_the_share_is_the_patterns_mass_out_of_the_non_sink_mass(tiny_models, name):
    """From the full patterns (run_with_cache): Σ mass on the type's pattern over every
    query, divided by Σ mass off the first position (sinks: by all of it)."""
    model = tiny_models["llama"]
    t = get_head_type(name)()
    share, score = _grids(model, [t], 64)[name]
    batches, _ = broad_batches(model, 64, 4)
    on = off = hit = n_q = 0.0
    for b in batches:
        _, cache = model.run_with_cache(b.input_ids, names_filter=lambda n: "hook_pattern" in n)
        p = torch.stack([cache[f"blocks.{la}.attn.hook_pattern"] for la in range(2)], 1)
        mask = t.broad_targets(b)
        if mask.dtype != torch.bool:
            mask = (
                torch.nn.functional.one_hot(mask.clamp(min=0), p.shape[-1]).bool()
                & (mask >= 0)[..., None]
            )
        if not t.broad_on_first:  # the first position is left out of the share
            mask = mask.clone()
            mask[..., 0] = False
        mass = (p * mask[:, None, None]).sum(-1)  # [batch, layer, head, query]
        on += mass.sum((0, 3))
        off += (1 - p[..., 0]).sum((0, 3)) if not t.broad_on_first else p.sum((0, 3, 4))
        has = mask.any(-1)  # [batch, query]
        hit += (mass * has[:, None, None]).sum((0, 3))
        n_q += has.sum()
    torch.testing.assert_close(share, (on / off).float(), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(score, (hit / n_q).float(), atol=1e-4, rtol=1e-3)


def test_a_record_per_head_and_a_note_for_a_type_without_a_pattern(tiny_models):
    model = tiny_models["llama"]
    types = [get_head_type(n)() for n in ("previous_token", "name_mover")]
    heads = {"previous_token": [HeadIndex(1, 2), HeadIndex(0, 0)], "name_mover": [HeadIndex(1, 0)]}
    out = broad_behaviour(model, types, heads)
    assert "no pattern on ordinary text" in out["name_mover"]["note"]
    rec = out["previous_token"]
    assert rec["lengths"] == list(LENGTHS) and set(rec["heads"]) == {"L1H2", "L0H0"}
    share, _ = _grids(model, types[:1], LENGTHS[0])["previous_token"]
    for h, r in rec["heads"].items():
        assert r["broad_share"] == pytest.approx(float(share[HeadIndex.parse(h)]), abs=1e-5)
        assert r["narrow"] == (max(r["broad_share"], r["broad_share_4x"]) < NARROW)
    from headmech.classification.readings import HeadReading
    from headmech.classification.records import HeadEffect

    per = {"L1H2": HeadReading(True, HeadEffect(0.5, None, True))}
    meta = merge(per, rec, [HeadIndex(1, 2)])
    assert (
        per["L1H2"].effect == 0.5
        and per["L1H2"].broad.broad_share == rec["heads"]["L1H2"]["broad_share"]
    )
    assert "L0H0" in per and not per["L0H0"].labelled and per["L0H0"].alone is None
    assert "heads" not in meta and meta["lengths"] == list(LENGTHS)
