"""Head masks, physical head removal and Michel et al.'s iterative pruning (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch

from headmech.cli import main
from headmech.interventions.ablation import ablation_hooks
from headmech.interventions.metrics import task_metric
from headmech.probes import ProbeOptions, build_probe
from headmech.pruning import HeadMask, head_mask, michel_prune, prune_heads
from headmech.tasks import get_task

TINY_PROBE = ProbeOptions(n_sentences=4, n_sequences=2, half_len=6, batch_size=4)


def _ids(n: int = 2, pos: int = 7) -> torch.Tensor:
    return torch.randint(5, 200, (n, pos))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_mask_of_ones_is_identity_and_zeros_are_zero_ablation(tiny_models, arch):
    model = tiny_models[arch]
    ids = _ids()
    with torch.no_grad():
        clean = model(ids)
        with head_mask(model, HeadMask.for_model(model)):
            ones = model(ids)
        heads = [(0, 1), (1, 0), (1, 3)]
        with head_mask(model, HeadMask.for_model(model).remove(heads)):
            masked = model(ids)
        with model.hooks(fwd_hooks=ablation_hooks(model, heads, "zero")):
            ablated = model(ids)
    assert torch.equal(clean, ones)
    torch.testing.assert_close(masked, ablated, atol=1e-6, rtol=0)
    assert not torch.allclose(masked, clean)


def test_soft_mask_gradient_flows(tiny_models):
    from headmech.pruning import head_mask_hooks

    model = tiny_models["gpt2"]
    xi = torch.full((2, 4), 0.5, requires_grad=True)
    with model.hooks(fwd_hooks=head_mask_hooks(xi)):
        model(_ids()).sum().backward()
    assert xi.grad is not None and xi.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "arch,heads,expect_heads",
    [
        # LLaMA groups are query heads {0,1} and {2,3}: group 1 goes in both layers,
        # (0, 0) stays in the weights, zeroed
        ("llama", [(0, 2), (0, 3), (0, 0), (1, 2), (1, 3)], 2),
        # GPT-2: one head per layer goes physically, (0, 3) is zeroed
        ("gpt2", [(0, 1), (0, 3), (1, 2)], 3),
    ],
)
def test_surgery_equals_masked_model(tiny_models, tiny_dirs, arch, heads, expect_heads, tmp_path):
    model = tiny_models[arch]
    hf = model.original_model
    small = prune_heads(model, heads)
    n_params = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in small.parameters()) < n_params
    ids = _ids()
    with torch.no_grad():
        with head_mask(model, HeadMask.for_model(model).remove(heads)):
            masked = model(ids)
        out = small(ids).logits
        full = hf(ids).logits
    torch.testing.assert_close(out, masked, atol=1e-5, rtol=0)
    assert not torch.allclose(out, full, atol=1e-4)
    if arch == "llama":
        from transformers import LlamaForCausalLM

        assert small.config.num_attention_heads == expect_heads
        assert small.config.num_key_value_heads == 1
        small.save_pretrained(tmp_path / "small")
        again = LlamaForCausalLM.from_pretrained(tmp_path / "small")
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, out, atol=1e-6, rtol=0)
    else:
        assert small.transformer.h[0].attn.num_heads == expect_heads
    # the original is untouched
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, full)


def test_surgery_refuses_bert(tiny_models):
    from headmech.pruning import UnsupportedPruningError

    with pytest.raises(UnsupportedPruningError):
        prune_heads(tiny_models["bert"], [(0, 0)])


@pytest.mark.parametrize("arch,task", [("gpt2", "induction"), ("bert", "lm")])
def test_michel_bookkeeping(tiny_models, arch, task, tmp_path):
    model = tiny_models[arch]
    r = michel_prune(model, task, fraction=0.25, probe_options=TINY_PROBE)
    kept = [s["n_kept"] for s in r.steps]
    assert kept[0] == 8 and kept[-1] == 0
    assert all(a > b for a, b in zip(kept, kept[1:], strict=False))
    # 25% of remaining, at least one: 8 -> 6 -> 5 -> 4 -> 3 -> 2 -> 1 -> 0
    assert kept == [8, 6, 5, 4, 3, 2, 1, 0]
    for prev, s in zip(r.steps, r.steps[1:], strict=False):
        assert len(s["heads_kept"]) == s["n_kept"]
        assert set(map(tuple, s["heads_kept"])) < set(map(tuple, prev["heads_kept"]))
    assert all(torch.isfinite(torch.tensor(float(s["metric"]))) for s in r.steps)
    # every step's metric is the task's metric with exactly the removed heads zero-ablated
    # (an independent computation through TransformerLens hooks)
    batches = get_task(task, model).batches(model, TINY_PROBE)
    all_heads = {(la, h) for la in range(2) for h in range(4)}
    for s in r.steps[1:4]:
        removed = sorted(all_heads - set(map(tuple, s["heads_kept"])))
        want = task_metric(model, task, batches, ablation_hooks(model, removed, "zero"))
        assert float(s["metric"]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    # removable_fraction: heads removed at the last step before the metric first exceeds
    # the bound (clean * 1.05, or 0.05 when the clean metric is 0), by hand
    clean = float(r.steps[0]["metric"])
    bound = clean * 1.05 if abs(clean) >= 1e-4 else 0.05
    first_bad = next((i for i, s in enumerate(r.steps) if float(s["metric"]) > bound), len(r.steps))
    want_kept = r.steps[first_bad - 1]["n_kept"] if first_bad > 0 else 8
    assert r.removable_fraction() == pytest.approx(1 - want_kept / 8)
    path = r.save(tmp_path)
    data = json.loads(path.read_text())
    assert {"method", "task", "steps", "survival"} <= set(data)
    assert data["method"] == "michel" and data["task"] == task
    assert set(data["steps"][0]) == {"n_kept", "heads_kept", "metric", "metric_interval"}
    lo, hi = data["steps"][1]["metric_interval"]
    assert lo <= data["steps"][1]["metric"] <= hi and lo < hi  # bootstrap over sequences
    assert (tmp_path / "pruning.png").stat().st_size > 0


def test_michel_steps_and_survival(tiny_models):

    model = tiny_models["gpt2"]
    from headmech.classification.classify import HeadCatalog, TypeResult
    from headmech.core.head_index import HeadIndex
    from headmech.models import model_info

    heads = [HeadIndex(0, 0), HeadIndex(1, 1)]
    catalog = HeadCatalog(
        model_info(model), {"x": TypeResult("x", "X 2020", 0.5, torch.zeros(2, 4), heads)}
    )
    r = michel_prune(model, "induction", steps=2, probe_options=TINY_PROBE, catalog=catalog)
    assert [s["n_kept"] for s in r.steps] == [8, 7, 6]
    assert len(r.survival["x"]) == 3 and r.survival["x"][0] == 1.0


def test_cli_prune(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "prune",
            str(tiny_dirs["gpt2"]),
            "--method",
            "michel",
            "--task",
            "induction",
            "--steps",
            "2",
            "--n-sequences",
            "2",
            "--half-len",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "pruning.json").read_text())
    assert [s["n_kept"] for s in data["steps"]] == [8, 7, 6]
    assert (out / "pruning.png").exists()


def test_cli_prune_l0_and_mae(tiny_dirs, tiny_models, tmp_path, capsys):
    out = tmp_path / "l0"
    rc = main(
        [
            "prune",
            str(tiny_dirs["gpt2"]),
            "--method",
            "l0",
            "--task",
            "induction",
            "--lams",
            "1000",
            "--l0-steps",
            "200",
            # 2 sequences, not 8 (the gate training's 200 steps each cost a quarter): at this
            # λ the penalty's gradient closes the gates whatever the probe's size
            "--n-sequences",
            "2",
            "--half-len",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "pruning.json").read_text())
    assert data["method"] == "l0" and data["steps"][0]["n_kept"] == 8
    kept = [s["n_kept"] for s in data["steps"]]
    assert kept == sorted(kept, reverse=True) and kept[-1] < 8  # a huge λ closes gates
    out = tmp_path / "mae"
    rc = main(
        [
            "prune",
            str(tiny_dirs["gpt2"]),
            "--method",
            "mae",
            "--n-sentences",
            "24",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "pruning.json").read_text())
    c = data["comparison"]
    # base: the untouched model's next-token loss on the held-out (last) probe batch, by
    # hand from its logits; 4 rounds x 5 model steps (lr 1e-4) lower it, with or without
    # the gates
    model = tiny_models["gpt2"]
    options = ProbeOptions(**data["provenance"]["probe_options"])
    held = build_probe("prose", model, options).batches[-1]
    ids, mask = held.input_ids, held.attention_mask
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)[:, :-1].float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    want = float(losses[mask[:, 1:].bool()].mean())
    assert c["base"] == pytest.approx(want, abs=1e-4)
    assert c["model_steps"] == 20 and data["options"]["rounds"] == 4
    assert c["mae"] < c["base"] - 0.01 and c["finetuned"] < c["base"] - 0.01
    assert data["mae_improves"] == (c["mae"] < c["finetuned"])


def test_removable_fraction():
    from headmech.pruning import PruningResult

    def steps(metrics):
        return [{"n_kept": 10 - i, "heads_kept": [], "metric": m} for i, m in enumerate(metrics)]

    r = PruningResult("michel", "lm", steps([2.0, 2.05, 2.3, 2.0]), n_heads_total=10)
    assert r.removable_fraction(0.05) == pytest.approx(0.1)  # stops at the first excess
    r = PruningResult("michel", "lm", steps([1e-8, 0.01, 0.04, 0.2]), n_heads_total=10)
    assert r.removable_fraction(0.05) == pytest.approx(0.2)  # absolute bound at clean 0


def test_a_mask_takes_heads_by_name():
    by_name = HeadMask.ones(2, 4).remove(["L1H0", "L0H3"])
    assert by_name.removed() == HeadMask.ones(2, 4).remove([(1, 0), (0, 3)]).removed()
    assert by_name.removed() == [(0, 3), (1, 0)]
