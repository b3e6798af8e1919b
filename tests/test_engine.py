"""The streaming engine against hand computations from run_with_cache."""

from __future__ import annotations

import math

import pytest
import torch

from headmech.headtypes.registry import get_head_type
from headmech.probes import ProbeOptions, batch_sequences, build_probe, encode_sentences
from headmech.stream.engine import HeadStats, ProbeBatch, stream_statistics, target_reducer

SENTENCES = [
    "The cat sat on the mat.",
    "A much longer sentence about attention heads and what they do in transformers.",
    "Short one.",
    "Researchers want to know what each attention head does, and to prove it.",
    "Heads attend to previous tokens quite often.",
]


def previous_token_targets(batch):
    return get_head_type("previous_token")().targets(batch)


def duplicate_targets(batch):
    """Bool[batch, q, k]: earlier positions holding the same token (a set per query)."""
    ids = batch.input_ids
    same = ids[:, :, None] == ids[:, None, :]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril(-1)
    real = ~batch.special
    return same & earlier & real[:, :, None] & real[:, None, :]


def hand_stats(model, sequences, targets_fn, tokenizer):
    """Per-head mean attention mass on targets, one unpadded sequence at a time."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    mass_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    hit_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    count = 0
    for seq in sequences:
        (b,) = batch_sequences([seq], tokenizer, 1)
        t = targets_fn(b)
        mask = (
            t
            if t.dtype == torch.bool
            else torch.nn.functional.one_hot(t.clamp(min=0), t.shape[1]).bool()
            & (t >= 0)[..., None]
        )
        has = mask.any(-1)[0]
        _, cache = model.run_with_cache(b.input_ids)
        for layer in range(n_layers):
            pat = cache[f"blocks.{layer}.attn.hook_pattern"][0].double()  # [head, q, k]
            m = mask[0].double()
            mass_sum[layer] += (pat * m).sum(-1)[:, has].sum(-1)
            am = pat.argmax(-1)  # [head, q]
            hit_sum[layer] += mask[0].gather(-1, am.T).T[:, has].double().sum(-1)
        count += int(has.sum())
    return mass_sum / count, hit_sum / count


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize(
    "targets_fn", [previous_token_targets, duplicate_targets], ids=["index", "mask"]
)
def test_engine_matches_run_with_cache(tiny_models, kind, targets_fn):
    model = tiny_models[kind]
    tok = model.tokenizer
    seqs = encode_sentences(model, SENTENCES * 2)
    # padded batches of mixed lengths: padding must not change any statistic
    batches = batch_sequences(seqs, tok, batch_size=3)
    assert any((b.attention_mask == 0).any() for b in batches)
    stats = stream_statistics(model, batches, [target_reducer("t", targets_fn)])
    want_mass, want_hit = hand_stats(model, seqs, targets_fn, tok)
    torch.testing.assert_close(stats.mean("t.mass").double(), want_mass, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.mean("t.hit").double(), want_hit, atol=1e-6, rtol=0)
    assert stats.mean("t.mass").shape == (model.cfg.n_layers, model.cfg.n_heads)


@pytest.mark.parametrize("route", ["pattern", "points", "rows"])
def test_set_targets_on_every_route(tiny_models, route):
    """A set of target keys per query (kept as sorted pair codes, read by binary search)
    gives the hand computation's mass and hits on each route: the cached pattern's
    blocks, point masses from the kernel's log-sum-exp, and rows of scores (shared scores
    on a CPU: the blocks compute the output too). Padded batches of mixed lengths."""
    import dataclasses

    model = tiny_models["llama"]
    tok = model.tokenizer
    seqs = encode_sentences(model, SENTENCES * 2)
    batches = batch_sequences(seqs, tok, batch_size=3)
    r = target_reducer("t", duplicate_targets)
    if route == "rows":  # no points: the pass builds rows for every query
        r = dataclasses.replace(r, points=None)
    attention = "pattern" if route == "pattern" else "blocks"
    stats = stream_statistics(model, batches, [r], attention=attention)
    want_mass, want_hit = hand_stats(model, seqs, duplicate_targets, tok)
    torch.testing.assert_close(stats.mean("t.mass").double(), want_mass, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.mean("t.hit").double(), want_hit, atol=1e-6, rtol=0)
    assert float(want_mass.max()) > 0.05  # the sets are not empty


def test_gqa_statistics_are_per_query_head(tiny_models):
    model = tiny_models["llama"]
    assert model.cfg.n_key_value_heads == 2 and model.cfg.n_heads == 4
    batches = batch_sequences(encode_sentences(model, SENTENCES), model.tokenizer, 2)
    stats = stream_statistics(model, batches, [target_reducer("p", previous_token_targets)])
    assert stats.mean("p.mass").shape == (2, 4)
    # query heads sharing a KV head still differ (own queries)
    m = stats.mean("p.mass")
    assert not torch.allclose(m[:, 0], m[:, 1])


def test_hand_written_attention_equals_hook_pattern(tiny_models):
    """softmax(q k^T / sqrt(d_head) + causal mask) from hook_q/hook_k equals hook_pattern."""
    model = tiny_models["gpt2"]
    ids = torch.tensor([encode_sentences(model, SENTENCES[:1])[0]])
    _, cache = model.run_with_cache(ids)
    for layer in range(model.cfg.n_layers):
        q = cache[f"blocks.{layer}.attn.hook_q"][0]  # [pos, head_index, d_head]
        k = cache[f"blocks.{layer}.attn.hook_k"][0]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        torch.testing.assert_close(
            pattern, cache[f"blocks.{layer}.attn.hook_pattern"][0], atol=1e-5, rtol=1e-4
        )


def test_statistics_merge_by_addition(tiny_models):
    model = tiny_models["gpt2"]
    batches = batch_sequences(encode_sentences(model, SENTENCES * 2), model.tokenizer, 2)
    reducers = [target_reducer("p", previous_token_targets), target_reducer("d", duplicate_targets)]
    whole = stream_statistics(model, batches, reducers)
    parts = stream_statistics(model, batches[:2], reducers) + stream_statistics(
        model, batches[2:], reducers
    )
    for name in ("p.mass", "p.hit", "d.mass", "p.rows"):
        torch.testing.assert_close(parts.sums[name], whole.sums[name])
        torch.testing.assert_close(parts.counts[name], whole.counts[name])
    assert set(whole.state_dict()) >= {"sum/p.mass", "count/p.mass"}


def test_merge_refuses_other_shapes():
    with pytest.raises(ValueError):
        HeadStats(2, 4) + HeadStats(3, 4)


def test_engine_keeps_no_cache_and_does_not_touch_inputs(tiny_models):
    model = tiny_models["gpt2"]
    batches = batch_sequences(encode_sentences(model, SENTENCES), model.tokenizer, 5)
    before = [b.input_ids.clone() for b in batches]
    seen = []

    def spy(pattern, batch, prepared, layer):
        seen.append(pattern.shape)
        return {"max": (pattern.amax(-1).sum((0, 2)), batch.attention_mask.sum())}

    from headmech.stream.engine import Reducer

    stream_statistics(model, batches, [Reducer("spy", spy)])
    assert len(seen) == model.cfg.n_layers  # once per layer, one layer at a time
    for b, ids in zip(batches, before, strict=True):
        assert torch.equal(b.input_ids, ids)
    # hooks are removed afterwards
    assert all(not hp._forward_hooks for hp in model.hook_dict.values())


def test_head_output_reducer_on_hook_z(tiny_models):
    from headmech.stream.engine import Reducer

    model = tiny_models["llama"]
    (batch,) = batch_sequences(encode_sentences(model, SENTENCES[:2]), model.tokenizer, 2)

    def znorm(z, batch, prepared, layer):  # z: [batch, pos, head_index, d_head]
        real = batch.attention_mask.bool()
        return {"norm": (z.norm(dim=-1)[real].sum(0), real.sum())}

    stats = stream_statistics(model, [batch], [Reducer("z", znorm, hook="hook_z")])
    _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask)
    real = batch.attention_mask.bool()
    for layer in range(2):
        want = cache[f"blocks.{layer}.attn.hook_z"].norm(dim=-1)[real].mean(0)
        torch.testing.assert_close(stats.mean("z.norm")[layer], want, atol=1e-5, rtol=1e-4)


def test_probes_are_deterministic(tiny_models):
    model = tiny_models["gpt2"]
    a = build_probe("repeated_random", model, ProbeOptions(n_sequences=4, half_len=5, seed=3))
    b = build_probe("repeated_random", model, ProbeOptions(n_sequences=4, half_len=5, seed=3))
    c = build_probe("repeated_random", model, ProbeOptions(n_sequences=4, half_len=5, seed=4))
    ids = a.batches[0].input_ids
    assert torch.equal(ids, b.batches[0].input_ids)
    assert not torch.equal(ids, c.batches[0].input_ids)
    off = a.info["offset"]
    assert torch.equal(ids[:, off : off + 5], ids[:, off + 5 : off + 10])
    p1 = build_probe("prose", model, ProbeOptions(n_sentences=8, seed=1))
    p2 = build_probe("prose", model, ProbeOptions(n_sentences=8, seed=1))
    assert all(
        torch.equal(x.input_ids, y.input_ids) for x, y in zip(p1.batches, p2.batches, strict=True)
    )


@pytest.mark.parametrize("kind", ["causal", "encoder"])
def test_run_blocks_stops_before_the_unembedding(kind):
    """Statistics passes never compute logits: TransformerLens' ``stop_at_layer=n_layers``
    did not stop, and on BERT the bridge never stops; ``run_blocks`` does."""
    from headmech.stream.engine import run_blocks
    from headmech.testing import tiny_model

    model = tiny_model(kind)
    n_layers = int(model.cfg.n_layers)
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    fired: list[str] = []
    hook = ("unembed.hook_in", lambda x, hook: fired.append(hook.name))
    with torch.no_grad(), model.hooks(fwd_hooks=[hook]):
        out = run_blocks(model, ids)
        stream_statistics(
            model,
            [ProbeBatch(ids, torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool))],
            [
                target_reducer(
                    "prev",
                    lambda b: (torch.arange(b.input_ids.shape[1]) - 1).expand_as(b.input_ids),
                )
            ],
        )
    assert fired == []
    _, cache = model.run_with_cache(ids)
    torch.testing.assert_close(out, cache[f"blocks.{n_layers - 1}.hook_out"])


def test_statistics_are_copied_when_added_and_moved_when_read():
    """HeadStats.add keeps a copy on the sums' own device and moves every pending sum at
    the first read, in one transfer per device (on a GPU: one synchronisation a pass,
    not one per statistic and layer); the totals equal adding them one by one."""
    stats = HeadStats(2, 3)
    buffer = torch.ones(2, 3)  # a reducer's reused buffer: changed after it was added
    stats.add("a.x", 0, buffer, torch.tensor([1.0, 2.0]))
    buffer.fill_(5.0)
    stats.add("a.x", 1, buffer, 4.0)
    stats.add("a.y", 0, torch.arange(3.0), torch.ones(3))
    assert len(stats._pending) == 3  # nothing moved or summed yet
    assert "a.x" in stats and len(stats._pending) == 0
    torch.testing.assert_close(
        stats.sums["a.x"], torch.tensor([[2.0] * 3, [10.0] * 3], dtype=torch.float64)
    )
    torch.testing.assert_close(
        stats.counts["a.x"], torch.tensor([[3.0] * 3, [8.0] * 3], dtype=torch.float64)
    )
    torch.testing.assert_close(stats.mean("a.y")[0], torch.arange(3.0))
    sums, counts = stats.units("a.x")  # per sequence: both sequences of both layers
    assert sums.shape == (2, 2, 3) and float(counts[1, 0, 0]) == 2.0
    stats.add("a.y", 1, torch.ones(3), 1.0)  # a later add is pending again, then read
    assert float(stats.sums["a.y"][1, 0]) == 1.0
