"""IOI (Wang et al. 2022) and in-context (Todd et al. 2023) types: probes, the logit-difference
task, direct effects, copy scores and the average indirect effect, each against a hand
computation on a tiny model; the findings on SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch

import headmech
from headmech.attribution.logit import direct_effects
from headmech.headtypes.function_vector import indirect_effects
from headmech.headtypes.name_mover import name_copying
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.icl import N_EXAMPLES, shuffle_labels
from headmech.probes.ioi import corrupt_ioi, ioi_names
from headmech.tasks import get_task

OPTIONS = ProbeOptions(n_sequences=12, batch_size=6, seed=3)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]  # grouped-query: 4 query heads, 2 KV heads


def test_ioi_prompts_place_the_names(llama):
    batches = build_probe("ioi", llama, OPTIONS).batches
    n = 0
    for b in batches:
        e, rows = b.extras, torch.arange(b.input_ids.shape[0])
        assert torch.equal(b.input_ids[rows, e["io_pos"]], e["io"])
        assert torch.equal(b.input_ids[rows, e["s1_pos"]], e["s"])
        assert torch.equal(b.input_ids[rows, e["s2_pos"]], e["s"])
        assert bool((e["io"] != e["s"]).all())
        assert torch.equal(e["end_pos"], b.attention_mask.sum(1) - 1)  # the last real token
        assert bool((e["s2_pos"] > torch.maximum(e["io_pos"], e["s1_pos"])).all())
        # ABBA: IO first; BABA: S first
        assert {bool(a) for a in (e["io_pos"] < e["s1_pos"])} == {True, False}
        n += len(rows)
    assert n == OPTIONS.n_sequences


def test_abc_corruption_replaces_only_the_three_names(llama):
    (b, *_) = build_probe("ioi", llama, OPTIONS).batches
    c = corrupt_ioi(b, llama, seed=0)
    names = set(ioi_names(llama.tokenizer))
    for row in range(b.input_ids.shape[0]):
        where = [int(b.extras[k][row]) for k in ("io_pos", "s1_pos", "s2_pos")]
        fresh = [int(c.input_ids[row, p]) for p in where]
        assert len(set(fresh)) == 3 and set(fresh) <= names
        assert not {int(b.extras["io"][row]), int(b.extras["s"][row])} & set(fresh)
        keep = torch.ones(b.input_ids.shape[1], dtype=torch.bool)
        keep[where] = False
        assert torch.equal(c.input_ids[row, keep], b.input_ids[row, keep])


def test_logit_difference_task_equals_the_full_logits(llama):
    task = get_task("ioi", llama)
    (b, *_) = task.batches(llama, OPTIONS)
    with torch.no_grad():
        sums, counts = task.metric(llama, b, copies=2)
        logits = llama(b.input_ids, attention_mask=b.attention_mask).float()
    rows = torch.arange(b.input_ids.shape[0])
    end = logits[rows, b.extras["end_pos"]]
    want = end[rows, b.extras["s"]] - end[rows, b.extras["io"]]
    torch.testing.assert_close(sums, want[None].expand(2, -1), atol=1e-4, rtol=1e-4)
    assert torch.equal(counts, torch.ones_like(counts))


def test_direct_effects_on_the_logit_difference_equal_a_hand_computation(llama):
    task = get_task("ioi", llama)
    (b, *_) = task.batches(llama, OPTIONS)
    query, good, bad = task.contrast(b)
    got, n = direct_effects(llama, b, query, good, bad[query])
    with torch.no_grad():
        _, cache = llama.run_with_cache(b.input_ids, attention_mask=b.attention_mask)
    rows = torch.arange(b.input_ids.shape[0])
    end = b.extras["end_pos"]
    resid = cache["blocks.1.hook_resid_post"][rows, end].float()
    scale = resid.pow(2).mean(-1, keepdim=True).add(llama.cfg.eps).sqrt()  # RMSNorm
    u = llama.W_U.float()
    direction = (u[:, b.extras["io"]] - u[:, b.extras["s"]]).T * llama.ln_final.weight.float()
    for layer in range(2):
        z = cache[f"blocks.{layer}.attn.hook_z"][rows, end].float()  # [batch, heads, d_head]
        out = torch.einsum("bhd,hdm->bhm", z, llama.blocks[layer].attn.W_O.float())
        want = torch.einsum("bhm,bm->bh", out / scale[:, None], direction)
        torch.testing.assert_close(got[:, layer], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(n, torch.ones_like(n))


def test_name_copy_scores_equal_a_hand_computation(llama):
    copy, negative = name_copying(llama)
    ids = torch.tensor(ioi_names(llama.tokenizer))
    group = 4 // int(llama.W_V.shape[1])
    gamma = llama.ln_final.weight.detach().float()
    with torch.no_grad():
        _, cache = llama.run_with_cache(ids[:, None], attention_mask=torch.ones(len(ids), 1))
        e = cache["blocks.0.hook_resid_post"][:, 0].float()
        for layer in range(2):
            x = llama.blocks[layer].ln1(e).float()
            for h in range(4):
                out = (
                    x @ llama.W_V[layer, h // group].float() @ llama.W_O[layer, h].float()
                ) * gamma
                logits = out @ llama.W_U.float()  # [n, d_vocab]
                own = logits[torch.arange(len(ids)), ids]
                top = (logits > own[:, None]).sum(-1) < 5
                bottom = (logits < own[:, None]).sum(-1) < 5
                assert float(copy[layer, h]) == pytest.approx(float(top.float().mean()))
                assert float(negative[layer, h]) == pytest.approx(float(bottom.float().mean()))


def test_icl_prompts_and_shuffled_labels(llama):
    batches = build_probe("icl", llama, OPTIONS).batches
    for b in batches:
        assert bool(b.attention_mask.all())  # one length: every prompt is 4k + 2 tokens
        assert b.input_ids.shape[1] == 1 + 4 * N_EXAMPLES + 2
        assert int(b.extras["label"].sum(1).unique()) == N_EXAMPLES
        c = shuffle_labels(b, llama, seed=0)
        lab = b.extras["label"]
        assert torch.equal(c.input_ids[~lab], b.input_ids[~lab])
        for row in range(len(c.input_ids)):
            got, want = c.input_ids[row, lab[row]], b.input_ids[row, lab[row]]
            assert torch.equal(got.sort().values, want.sort().values)
    assert {t for b in batches for t in b.extras["task"]} == {
        "antonyms",
        "capitalize",
        "country_capital",
    }


def _hand_indirect_effect(model, layer: int, head: int, n_prompts: int) -> float:
    """Todd et al.'s AIE of one head with plain hooks: the task's mean z at the last token,
    written into the shuffled prompts' last token."""
    batches = build_probe("icl", model, ProbeOptions(n_sequences=n_prompts)).batches
    name = f"blocks.{layer}.attn.hook_z"
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    with torch.no_grad():
        for b in batches:
            _, cache = model.run_with_cache(b.input_ids, attention_mask=b.attention_mask)
            for row, t in enumerate(b.extras["task"]):
                sums[t] = sums.get(t, 0) + cache[name][row, -1, head].float()
                counts[t] = counts.get(t, 0) + 1
        total, n = 0.0, 0
        for b in batches:
            s = shuffle_labels(b, model, 0)
            mean = torch.stack([sums[t] / counts[t] for t in b.extras["task"]])

            def patch(z, hook, mean=mean):
                z = z.clone()
                z[:, -1, head] = mean.to(z)
                return z

            rows = torch.arange(len(s.input_ids))
            p0 = model(s.input_ids, attention_mask=s.attention_mask)[:, -1].softmax(-1)
            with model.hooks(fwd_hooks=[(name, patch)]):
                p1 = model(s.input_ids, attention_mask=s.attention_mask)[:, -1].softmax(-1)
            ans = b.extras["answer"]
            total += float((p1[rows, ans] - p0[rows, ans]).sum())
            n += len(rows)
    return total / n


def test_average_indirect_effect_equals_hand_hooks(llama):
    aie = indirect_effects(llama, n_prompts=12)
    assert aie.shape == (2, 4)
    for layer, head in [(0, 1), (1, 2)]:
        want = _hand_indirect_effect(llama, layer, head, 12)
        assert abs(want) > 1e-9  # a random model moves the answer a little
        assert float(aie[layer, head]) == pytest.approx(want, rel=1e-3, abs=1e-10)


def _ioi_by_hand(model, batches, heads, zeroed=()):
    """From the model's own activations (TransformerLens hooks, no headmech statistic):
    the logit difference IO - S at the last token, with the heads ``zeroed`` there; and per
    head in ``heads`` (unzeroed run) the attention from the last token to IO, S1 and S2 and
    its direct effect on the logit difference (its output through the final RMSNorm's
    scale and weight, dotted with ``W_U[IO] - W_U[S]``). Means over the prompts."""
    n_layers = int(model.cfg.n_layers)
    final_norm = model.ln_final.original_component
    w_u = model.unembed.original_component.weight  # [d_vocab, d_model]
    diffs, attn, direct = [], {h: [] for h in heads}, {h: [] for h in heads}
    with torch.no_grad():  # the weights require gradients
        for b in batches:
            e, rows = b.extras, torch.arange(b.input_ids.shape[0])
            end = e["end_pos"]

            def zero(z, hook, rows=rows, end=end):
                layer = int(hook.name.split(".")[1])
                z = z.clone()
                for la, h in zeroed:
                    if la == layer:
                        z[rows, end, h] = 0.0
                return z

            hooks = [(f"blocks.{la}.attn.hook_z", zero) for la in sorted({la for la, _ in zeroed})]
            with model.hooks(fwd_hooks=hooks):
                if zeroed:  # the logits alone
                    logits = model(b.input_ids, attention_mask=b.attention_mask)
                else:
                    logits, cache = model.run_with_cache(
                        b.input_ids, attention_mask=b.attention_mask
                    )
            final = logits[rows, end].float()
            diffs.append(final[rows, e["io"]] - final[rows, e["s"]])
            if zeroed:
                continue
            resid = cache[f"blocks.{n_layers - 1}.hook_resid_post"][rows, end]
            rms = resid.pow(2).mean(-1, keepdim=True).add(final_norm.variance_epsilon).sqrt()
            direction = (w_u[e["io"]] - w_u[e["s"]]) * final_norm.weight  # [prompt, d_model]
            # the decomposition is exact: the whole residual gives the logit difference
            whole = (resid / rms * direction).sum(-1)
            torch.testing.assert_close(whole, diffs[-1], atol=1e-4, rtol=1e-4)
            for la, h in heads:
                p = cache[f"blocks.{la}.attn.hook_pattern"][rows, h, end]  # [prompt, key]
                attn[la, h].append(
                    torch.stack([p[rows, e[k]] for k in ("io_pos", "s1_pos", "s2_pos")], -1)
                )
                z = cache[f"blocks.{la}.attn.hook_z"][rows, end, h]  # [prompt, d_head]
                d = z.shape[-1]
                w_o = model.blocks[la].attn.original_component.o_proj.weight[:, h * d : (h + 1) * d]
                direct[la, h].append(((z @ w_o.T) / rms * direction).sum(-1))
    mean = lambda xs: torch.cat(xs).mean(0)  # noqa: E731
    return (
        float(mean(diffs)),
        {h: mean(v) for h, v in attn.items()},
        {h: float(mean(v)) for h, v in direct.items()},
    )


@pytest.mark.slow
def test_smollm2_does_ioi_with_name_movers_and_a_negative_name_mover(smollm2):
    """SmolLM2-135M does IOI (logit difference ~4.4 nats; GPT-2 small: 3.56 in Wang et
    al.), and the heads headmech labels do, by hand from the model's own patterns, outputs
    and logits, what Wang et al.'s heads do: name movers attend from the last token to the
    IO more than to both S tokens and push the IO's logit over the S's (direct effect);
    negative name movers attend to the IO and push the other way, and zeroing them at the
    last token raises the logit difference; S-inhibition heads, in earlier layers, attend
    to S2 and zeroing them lowers it by more than a nat."""
    cat = headmech.classify(
        smollm2, ["name_mover", "negative_name_mover", "s_inhibition"], n_sequences=32
    )
    movers, negative, inhibition = (
        [(h.layer, h.head) for h in cat[t].heads]
        for t in ("name_mover", "negative_name_mover", "s_inhibition")
    )
    assert movers and negative and inhibition
    batches = get_task("ioi", smollm2).batches(smollm2, ProbeOptions(n_sequences=32))
    clean, attn, direct = _ioi_by_hand(smollm2, batches, movers + negative + inhibition)
    # measured: 4.38; name movers' direct effects +0.27 to +0.55 (L23H0-2), the negative
    # name mover's -0.65 (L24H4); zeroing it: 4.79; zeroing the S-inhibition head: 2.76
    assert clean > 2.0
    for h in movers:
        io, s1, s2 = attn[h].tolist()
        assert io > s1 + s2 and direct[h] > 0.1, (h, attn[h], direct[h])
    for h in negative:
        io, s1, s2 = attn[h].tolist()
        assert io > s1 + s2 and direct[h] < -0.3, (h, attn[h], direct[h])
    assert _ioi_by_hand(smollm2, batches, [], zeroed=negative)[0] > clean + 0.2
    for h in inhibition:
        io, s1, s2 = attn[h].tolist()
        assert s2 > io + s1 and h[0] < min(la for la, _ in movers), (h, attn[h])
    assert _ioi_by_hand(smollm2, batches, [], zeroed=inhibition)[0] < clean - 1.0


def test_function_vector_reads_at_most_max_prompts(llama):
    from headmech.headtypes.function_vector import FunctionVectorHead

    batches = build_probe("icl", llama, ProbeOptions(n_sequences=10, batch_size=4)).batches
    got = FunctionVectorHead(max_prompts=6).model_statistics(llama, batches)["aie"]
    want = indirect_effects(llama, [batches[0], batches[1].head(2)])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert batches[1].head(2).extras["answer"].shape == (2,)
    assert len(batches[1].head(2).extras["task"]) == 2
