"""Successor heads (Gould et al. 2023): the succession score against a hand-written
effective-OV computation, the ordinal probe and the succession task."""

from __future__ import annotations

import torch

import headmech
from headmech.core.registry import TASKS
from headmech.headtypes.successor import succession_counts
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.ordinal import ORDINAL_TASKS, ordinal_runs


def _hand_counts(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective embeddings from run_with_cache, the layer's real input norm, the raw
    (unfolded) value and output weights, the final norm's weight, the raw unembedding."""
    runs = ordinal_runs(model.tokenizer)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    group = n_heads // int(model.W_V.shape[1])
    gamma = model.ln_final.weight.detach().float()
    succeeded = torch.zeros(len(ORDINAL_TASKS), n_layers, n_heads)
    pairs = torch.zeros(len(ORDINAL_TASKS))
    with torch.no_grad():
        for i, task in enumerate(ORDINAL_TASKS):
            for run in runs.get(task, []):
                ids = torch.tensor(run)[:, None]
                _, cache = model.run_with_cache(ids, attention_mask=torch.ones_like(ids))
                e = cache["blocks.0.hook_resid_post"][:, 0].float()  # [n, d_model]
                for layer in range(n_layers):
                    x = model.blocks[layer].ln1(e).float()
                    for h in range(n_heads):
                        v = x @ model.W_V[layer, h // group].float()
                        out = (v @ model.W_O[layer, h].float()) * gamma
                        logits = out @ model.W_U[:, torch.tensor(run)].float()
                        top = logits.argmax(-1)[:-1]
                        succeeded[i, layer, h] += (top == torch.arange(1, len(run))).sum()
                pairs[i] += len(run) - 1
    return succeeded, pairs


def test_succession_counts_equal_a_hand_computation(tiny_models):
    model = tiny_models["llama"]  # grouped-query: 4 query heads, 2 KV heads
    got, got_pairs = succession_counts(model)
    want, want_pairs = _hand_counts(model)
    assert torch.equal(got_pairs, want_pairs) and float(want_pairs.sum()) > 50
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_ordinal_runs_follow_the_tokenizer(bpe_tokenizer):
    runs = ordinal_runs(bpe_tokenizer)
    assert "numbers" not in runs  # SmolLM2 splits " 12" into a space and digits
    assert [len(r) for r in runs["days"]] == [7] and [len(r) for r in runs["letters"]] == [26]
    day_ids = [
        bpe_tokenizer.encode(" " + d, add_special_tokens=False)[0] for d in ORDINAL_TASKS["days"]
    ]
    assert runs["days"][0] == day_ids


def test_succession_task_scores_each_next_item(tiny_models):
    model = tiny_models["llama"]
    probe = build_probe("ordinal", model, ProbeOptions(n_sequences=16, batch_size=8))
    task = TASKS.get("succession")(model)
    successor: dict[str, dict[int, int]] = {}  # per task (" May" is a month and a prefix)
    for name, runs in ordinal_runs(model.tokenizer).items():
        for run in runs:
            successor.setdefault(name, {}).update(zip(run[:-1], run[1:], strict=True))
    n = 0
    for batch in probe.batches:
        query, target = task.select(batch)
        for row, pos in query.nonzero().tolist():
            follows = successor[batch.extras["task"][row]]
            assert int(target[row, pos]) == follows[int(batch.input_ids[row, pos - 1])]
            assert model.tokenizer.decode(batch.input_ids[row, pos]) == ","
            n += 1
        shuffled = task.corrupt(batch, model, 0)
        assert torch.equal(shuffled.input_ids.sort(1).values, batch.input_ids.sort(1).values)
        assert not torch.equal(shuffled.input_ids, batch.input_ids)
    assert n >= 16 * 3  # at least 4 items per sequence: 3 successions


def test_successor_is_listed_and_reports_no_head_on_a_random_model(tiny_models):
    assert "successor" in headmech.head_types()
    cat = headmech.classify(tiny_models["llama"], types=["successor"])
    result = cat.types["successor"]
    assert result.heads == [] and 0.0 <= result.details["best_score"] < 0.4


# --- copy suppression (McDougall et al. 2023): the same effective-OV machinery ---------


def test_own_token_ranks_count_the_vocabulary_in_either_order(tiny_models):
    """Many tokens go through (e W_V)(W_O W_U) in tiles of rows, few through
    ((e W_V) W_O) W_U: both count the tokens above and below each token's own logit as
    a float64 computation does (up to a tie within float32 rounding)."""
    from headmech.headtypes.copy_suppression import word_tokens
    from headmech.models.weights import effective_embeddings, head_weights, own_token_ranks

    model = tiny_models["llama"]
    ids = word_tokens(model.tokenizer, n=40)  # 40 tokens: the tiled order; 2: the other
    w = head_weights(model)
    e = effective_embeddings(model, ids).double()
    logits = torch.einsum("nd,lhde,lhem,mv->lhnv", e, w.W_V.double(), w.W_O.double(),
                          w.W_U.double())  # fmt: skip
    own = logits.gather(-1, ids.expand(*logits.shape[:2], -1)[..., None])
    want_above, want_below = (logits > own).sum(-1), (logits < own).sum(-1)
    for n in (40, 2):
        above, below = own_token_ranks(model, ids[:n])
        for got, want in ((above, want_above[..., :n]), (below, want_below[..., :n])):
            assert (got - want).abs().max() <= 1 and (got != want).float().mean() < 0.01
        assert (above + below <= logits.shape[-1] - 1).all()


def test_suppression_scores_equal_a_hand_computation(tiny_models):
    """The share of tokens whose own logit is among the 10 most negative of the whole
    vocabulary, against run_with_cache, the real input norm and unfolded weights."""
    from headmech.headtypes.copy_suppression import TOP_K, suppression_scores, word_tokens

    model = tiny_models["llama"]
    ids = word_tokens(model.tokenizer, n=40)
    assert len(ids) == 40 and all(model.tokenizer.decode([int(i)])[1:].isalpha() for i in ids)
    got = suppression_scores(model, ids)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    group = n_heads // int(model.W_V.shape[1])
    gamma = model.ln_final.weight.detach().float()
    with torch.no_grad():
        _, cache = model.run_with_cache(ids[:, None], attention_mask=torch.ones(len(ids), 1))
        e = cache["blocks.0.hook_resid_post"][:, 0].float()
        want = torch.zeros(n_layers, n_heads)
        for layer in range(n_layers):
            x = model.blocks[layer].ln1(e).float()
            for h in range(n_heads):
                out = (x @ model.W_V[layer, h // group].float()) @ model.W_O[layer, h].float()
                logits = (out * gamma) @ model.W_U.float()  # [n, d_vocab]
                ranks = [int((row < row[t]).sum()) for row, t in zip(logits, ids, strict=True)]
                want[layer, h] = sum(r < TOP_K for r in ranks) / len(ranks)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert float(got.max()) < 0.5  # random weights: near chance (10 / 49152)
