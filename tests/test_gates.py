"""Hard Concrete L0 gates (Voita et al. 2019) and MAE gates (Peng et al. 2020)."""

from __future__ import annotations

import math

import pytest
import torch

import headmech
from headmech.probes import ProbeOptions, build_probe
from headmech.pruning.l0 import (
    GAMMA,
    ZETA,
    _outputs,
    distillation_loss,
    gate_intervention,
    hard_concrete_eval,
    hard_concrete_sample,
    prob_nonzero,
    train_l0_gates,
)

OPTS = ProbeOptions(n_sentences=8, batch_size=4)


def test_hard_concrete_sample_range_and_prob_nonzero():
    log_alpha = torch.tensor([-2.0, -0.5, 0.0, 1.0, 2.5])
    n = 20000
    g = hard_concrete_sample(log_alpha.expand(n, -1), generator=torch.Generator().manual_seed(0))
    assert g.min() >= 0.0 and g.max() <= 1.0
    empirical = (g > 0).float().mean(0)
    assert torch.allclose(empirical, prob_nonzero(log_alpha), atol=0.015)
    assert ((g > 0) & (g < 1)).any()  # not degenerate


def test_hard_concrete_eval_formula():
    la = torch.tensor([-10.0, 0.0, 1.0, 10.0])
    expected = [0.0, 0.5 * (ZETA - GAMMA) + GAMMA, None, 1.0]
    ev = hard_concrete_eval(la)
    assert ev[0] == 0.0 and ev[3] == 1.0
    assert math.isclose(float(ev[1]), expected[1], rel_tol=1e-6)
    s = 1 / (1 + math.exp(-1.0))
    assert math.isclose(float(ev[2]), s * (ZETA - GAMMA) + GAMMA, rel_tol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_open_gates_equal_base_model(tiny_models, name):
    model = tiny_models[name]
    b = build_probe("prose", model, OPTS).batches[0]
    la = torch.full((model.cfg.n_layers, model.cfg.n_heads), 20.0)
    g = hard_concrete_sample(la)
    assert torch.all(g == 1.0) and torch.all(hard_concrete_eval(la) == 1.0)
    with torch.no_grad():
        base = _outputs(model, b, [])
        gated = _outputs(model, b, [gate_intervention(model, g)])
        assert torch.allclose(base, gated, atol=1e-6)
        assert float(distillation_loss(model, gated, base)) < 1e-5


def test_gates_keep_the_heads_that_matter(tiny_models):
    """Plant very unequal head importances in the tiny GPT-2 (head outputs scaled by 40 or
    0.05 through ``base`` interventions), distil it to itself under a strong L0 penalty: log α
    ranks the heads as their zero-ablation damage does."""
    model = tiny_models["gpt2"]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    scale = torch.ones(n_layers, n_heads)
    scale[0, 1], scale[1, 2] = 40.0, 40.0
    scale[0, 3], scale[1, 0] = 0.05, 0.05
    planted = [gate_intervention(model, scale)]
    res = train_l0_gates(model, lam=0.02, steps=60, lr=0.1, probe_options=OPTS, base=planted)
    batches = build_probe("prose", model, OPTS).batches
    damage = torch.zeros(n_layers, n_heads)
    with torch.no_grad():
        teacher = [_outputs(model, b, planted) for b in batches]
        for layer in range(n_layers):
            for h in range(n_heads):
                m = torch.ones(n_layers, n_heads)
                m[layer, h] = 0.0
                ivs = [*planted, gate_intervention(model, m)]
                kl = [
                    float(distillation_loss(model, _outputs(model, b, ivs), t))
                    for b, t in zip(batches, teacher, strict=True)
                ]
                damage[layer, h] = sum(kl) / len(kl)
    la, d = res.log_alpha.flatten(), damage.flatten()
    rank = lambda x: x.argsort().argsort().float()  # noqa: E731
    rho = float(torch.corrcoef(torch.stack([rank(la), rank(d)]))[0, 1])  # Spearman
    assert rho > 0.6, (rho, la, d)
    assert set(d.topk(2).indices.tolist()) <= set(la.topk(4).indices.tolist())
    assert res.curve[-1]["expected_heads"] < res.curve[0]["expected_heads"]
    assert res.heads_kept == int((res.eval_gates > 0).sum())
    assert all(p.requires_grad for p in model.parameters())


def test_mae_gate_scales_sum_and_start_at_identity(tiny_models):
    from headmech.pruning.mae import MAEGates, mae_intervention

    model = tiny_models["gpt2"]
    n_layers, n_heads, d = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model
    gates = MAEGates(n_layers, n_heads, d)
    b = build_probe("prose", model, OPTS).batches[0]
    with torch.no_grad():
        base = _outputs(model, b, [])
        gated = _outputs(model, b, [mae_intervention(model, gates, b.attention_mask)])
    assert torch.allclose(base, gated, atol=1e-5)  # uniform p: every head scale is 1
    torch.nn.init.normal_(gates.w2)
    p = gates.probs(0, torch.randn(3, d))
    assert torch.allclose(p.sum(-1), torch.ones(3), atol=1e-6)
    scales = gates.head_scales(p)
    assert torch.allclose(scales.sum(-1), torch.full((3,), float(n_heads)), atol=1e-5)
    # the mixture of "all but head i" experts, each rescaled by n/(n-1)
    experts = (1 - torch.eye(n_heads)) * n_heads / (n_heads - 1)  # [expert, head]
    assert torch.allclose(p @ experts, scales, atol=1e-6)
    record: list = []
    with torch.no_grad():
        _outputs(model, b, [mae_intervention(model, gates, b.attention_mask, record)])
    assert len(record) == n_layers and record[0].shape == (b.input_ids.shape[0], n_heads)


def test_mae_training_runs_and_changes_metric(tiny_models):
    from headmech.pruning.mae import compare_mae

    model = tiny_models["gpt2"]
    before = [p.detach().clone() for p in model.parameters()]
    res = compare_mae(
        model,
        probe_options=ProbeOptions(n_sentences=12, batch_size=4),
        rounds=2,
        gate_steps=3,
        model_steps=3,
        lr_model=1e-3,
        lr_gate=0.05,
    )
    assert res.model_steps == 6 and len(res.mae_curve) == 12 and len(res.finetune_curve) == 6
    assert res.mae != res.base and res.finetuned != res.base
    assert res.finetuned < res.base  # fine-tuning on the task lowers its loss
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.requires_grad for p in model.parameters())


def test_mae_gates_learn_which_head_to_drop(tiny_dirs):
    """A planted toy: the tiny GPT-2 with head L1H2's output scaled by 50 and the final norm
    by 30 (so the next-token loss feels the heads). Gate training alone (the model frozen)
    must find what a brute-force search over the 16 ways to drop one head per layer
    (others scaled by n/(n-1), as the experts are) finds: per layer, the gates put their
    weight p on the best combination's dropped head, keep the planted head (every
    combination that drops it is worse than the base model), and the gated loss is the
    best combination's, below the untrained gates' (the base model) and a random
    combination's (the median)."""
    import itertools

    from headmech.interventions import applied, evaluate
    from headmech.pruning.mae import MAEGates, mae_intervention, train_mae
    from headmech.tasks import get_task

    model = headmech.load_model(str(tiny_dirs["gpt2"]))  # a copy: its weights change
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    d_head = int(model.cfg.d_head)
    with torch.no_grad():
        c_proj = model.blocks[1].attn.original_component.c_proj.weight  # [heads * d_head, d]
        c_proj[2 * d_head : 3 * d_head] *= 50.0
        model.ln_final.original_component.weight.mul_(30.0)
    task = get_task("lm", model)
    batches = task.batches(model, ProbeOptions(n_sentences=12, batch_size=4))
    base = evaluate(model, task, batches)
    rescale = n_heads / (n_heads - 1)
    combos = {}
    for dropped in itertools.product(range(n_heads), repeat=n_layers):
        scale = torch.full((n_layers, n_heads), rescale)
        scale[range(n_layers), list(dropped)] = 0.0
        combos[dropped] = evaluate(model, task, batches, [gate_intervention(model, scale)])
    best = min(combos, key=combos.get)
    median = sorted(combos.values())[len(combos) // 2]
    # the planted head matters: every combination that drops it is worse than the base
    assert all(loss > base for d, loss in combos.items() if d[1] == 2)
    assert best[1] != 2 and combos[best] < base - 0.05

    gates = MAEGates(
        n_layers, n_heads, int(model.cfg.d_model), generator=torch.Generator().manual_seed(0)
    )
    frozen_before = [p.detach().clone() for p in model.parameters()]
    train_mae(model, gates, task, batches, [None] * len(batches), rounds=1, gate_steps=40,
              model_steps=0, lr_gate=0.1)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, model.parameters(), strict=True))
    record: list = []
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            with applied(model, [mae_intervention(model, gates, b.attention_mask, record)]):
                s, c = task.metric(model, b)
            total, count = total + float(s.sum()), count + float(c.sum())
    mae = total / count
    p = torch.stack([torch.cat(record[layer::n_layers]) for layer in range(n_layers)])
    assert p.shape == (n_layers, 12, n_heads)  # per layer, per sequence: weights p
    for layer, head in enumerate(best):
        assert bool((p[layer].argmax(-1) == head).all()), (layer, p[layer])
        assert float(p[layer, :, head].min()) > 0.9
    assert float(p[1, :, 2].max()) < 0.01  # the planted head is kept (scale n/(n-1))
    assert mae == pytest.approx(combos[best], abs=0.01)
    assert mae < base - 0.05 and mae < median - 0.05
