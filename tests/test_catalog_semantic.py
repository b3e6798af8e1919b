"""Semantic induction heads (Ren et al. 2024): the relation cases, the tail gain against a
hand computation with the Hugging Face modules of a tiny model, and the task's selection."""

from __future__ import annotations

import pytest
import torch

from headmech.headtypes.semantic_induction import SemanticInductionHead, tail_gains
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.relations import RELATIONS, relation_cases
from headmech.tasks.words import select_relation_tail
from headmech.testing import tiny_model

OPTIONS = ProbeOptions(n_sentences=12, batch_size=6, seed=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("causal")


@pytest.fixture(scope="module")
def batches(model):
    return build_probe("prose", model, OPTIONS).batches


def _hand_cases(batch):
    """(row, query, key, tail token) by a walk over the parse of each sentence."""
    labels = list(batch.extras["dep_labels"])
    out = []
    for r in range(batch.input_ids.shape[0]):
        words = batch.extras["word_ids"][r].tolist()
        heads = batch.extras["word_heads"][r].tolist()
        deps = batch.extras["word_deps"][r].tolist()
        for w in sorted({x for x in words if x >= 0}):
            pos = [i for i, x in enumerate(words) if x == w]
            h = heads[w]
            if labels[deps[w]] not in RELATIONS or not 0 <= h < w:
                continue
            head_pos = [i for i, x in enumerate(words) if x == h]
            if head_pos[-1] < pos[0] - 1:
                out.append((r, pos[0] - 1, head_pos[-1], int(batch.input_ids[r, pos[0]])))
    return out


def test_relation_cases_match_a_walk_over_the_parses(batches):
    n = 0
    for b in batches:
        c = relation_cases(b, RELATIONS)
        got = sorted(
            zip(c.seq.tolist(), c.query.tolist(), c.key.tolist(), c.tail.tolist(), strict=True)
        )
        assert got == sorted(_hand_cases(b))
        n += len(got)
    assert n > 10


@torch.no_grad()
def _hand_gains(model, batches):
    hf = model.original_model
    cfg = hf.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d_head = cfg.hidden_size // n_heads
    w_u = hf.lm_head.weight.detach().float() * hf.model.norm.weight.detach().float()[None]
    total = torch.zeros(cfg.num_hidden_layers, n_heads, dtype=torch.float64)
    n = 0
    for b in batches:
        hidden = hf(
            input_ids=b.input_ids, attention_mask=b.attention_mask, output_hidden_states=True
        ).hidden_states
        for r, _, key, tail in _hand_cases(b):
            n += 1
            for la, layer in enumerate(hf.model.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(hidden[la][r, key]).float()
                v = attn.v_proj(x).float()
                for h in range(n_heads):
                    g = h // (n_heads // n_kv)
                    vh = v[g * d_head : (g + 1) * d_head]
                    out = attn.o_proj.weight[:, h * d_head : (h + 1) * d_head].float() @ vh
                    logits = w_u @ out
                    total[la, h] += float(
                        (logits[tail] - logits.mean()) / logits.std(unbiased=False)
                    )
    return total / n


def test_tail_gain_matches_a_hand_computation(model, batches):
    torch.testing.assert_close(
        tail_gains(model, batches).double(), _hand_gains(model, batches), atol=2e-4, rtol=1e-3
    )


def test_score_is_attention_times_gain(model, batches):
    from headmech.headtypes.registry import collect_statistics

    t = SemanticInductionHead()
    stats = collect_statistics([t], model, batches)
    mass, gain = stats.mean("semantic_induction.mass"), stats.mean("semantic_induction.tail_gain")
    torch.testing.assert_close(t.score(stats), mass * gain)
    assert t.select(t.score(stats), stats) == []  # a random model has none


def test_relation_tail_task_reads_the_cases(batches):
    for b in batches:
        query, target = select_relation_tail(b)
        cases = _hand_cases(b)
        assert sorted(map(tuple, query.nonzero().tolist())) == sorted(
            (r, q) for r, q, _, _ in cases
        )
        assert all(int(target[r, q]) == tail for r, q, _, tail in cases)
