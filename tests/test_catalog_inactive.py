"""Inactive heads (Sandoval-Segura et al. 2025): the output norms against a hand
computation on the Hugging Face modules of a tiny model, a head made quiet by hand is the
one labelled, the domains probe, and the "costs little" validation record."""

from __future__ import annotations

import contextlib

import pytest
import torch

from headmech.classification.claim_types import Ablation, ClaimRecord
from headmech.classification.montecarlo import ControlTest
from headmech.classification.records import ControlAccounting, TypeValidation
from headmech.core.head_index import HeadIndex
from headmech.headtypes.inactive import InactiveHead
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.domains import DOMAINS, code_snippets
from headmech.testing import check_causal, tiny_model

OPTIONS = ProbeOptions(n_sequences=6, half_len=8, batch_size=4, seed=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("causal")


@pytest.fixture(scope="module")
def probe(model):
    return build_probe("domains", model, OPTIONS)


def _hand_norms(model, batches) -> dict[str, torch.Tensor]:
    """Per domain, each head's mean ‖input of o_proj, head slice @ o_proj's columns‖ over
    real non-special tokens, with the Hugging Face model's own modules and loops."""
    hf = model.original_model
    n_heads = int(model.cfg.n_heads)
    d_head = int(model.cfg.d_head)
    layers = hf.model.layers
    seen: dict[int, torch.Tensor] = {}

    def keep(la):
        def hook(module, args):
            seen[la] = args[0].detach().float()

        return hook

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for la, layer in enumerate(layers):
            stack.enter_context(_hooked(layer.self_attn.o_proj, keep(la)))
        for b in batches:
            with torch.no_grad():
                hf(input_ids=b.input_ids, attention_mask=b.attention_mask)
            total = torch.zeros(len(layers), n_heads, dtype=torch.float64)
            n = 0
            for row in range(b.input_ids.shape[0]):
                for pos in range(b.input_ids.shape[1]):
                    if b.special[row, pos] or not b.attention_mask[row, pos]:
                        continue
                    n += 1
                    for la, layer in enumerate(layers):
                        w = layer.self_attn.o_proj.weight.detach().float()
                        for h in range(n_heads):
                            cols = slice(h * d_head, (h + 1) * d_head)
                            out = w[:, cols] @ seen[la][row, pos, cols]
                            total[la, h] += float(out.norm())
            d = b.extras["domain"]
            sums[d] = sums.get(d, 0) + total
            counts[d] = counts.get(d, 0) + n
    return {d: sums[d] / counts[d] for d in sums}


@contextlib.contextmanager
def _hooked(module, hook):
    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_domains_probe_has_each_domain(model, probe):
    per = {
        d: sum(b.input_ids.shape[0] for b in probe.batches if b.extras["domain"] == d)
        for d in DOMAINS
    }
    assert per == dict.fromkeys(DOMAINS, OPTIONS.n_sequences)
    assert code_snippets(5, 3) == code_snippets(5, 3) != code_snippets(5, 4)
    assert all("def " in s or "print(" in s for s in code_snippets(20, 0))


def test_output_norms_match_a_hand_computation(model, probe):
    stats = InactiveHead().model_statistics(model, probe.batches)
    hand = _hand_norms(model, probe.batches)
    assert sorted(hand) == sorted(DOMAINS)
    for d, norms in hand.items():
        torch.testing.assert_close(stats[f"norm.{d}"].double(), norms, rtol=1e-4, atol=1e-6)
        ratio = norms / norms.mean(1, keepdim=True)
        torch.testing.assert_close(stats[f"ratio.{d}"].double(), ratio, rtol=1e-4, atol=1e-6)
    worst = torch.stack([hand[d] / hand[d].mean(1, keepdim=True) for d in hand]).amax(0)
    torch.testing.assert_close(stats["ratio"].double(), worst, rtol=1e-4, atol=1e-6)


def test_a_head_made_quiet_by_hand_is_the_one_labelled(model, probe):
    """Shrinking one head's output columns tenfold makes it the only inactive head; the
    random model's heads, untouched, are none of them."""
    t = InactiveHead()
    from headmech.headtypes.registry import collect_statistics

    before = collect_statistics([t], model, probe.batches)
    assert t.select(t.score(before), before) == []
    o_proj = model.original_model.model.layers[1].self_attn.o_proj
    d_head = int(model.cfg.d_head)
    cols = slice(2 * d_head, 3 * d_head)
    saved = o_proj.weight.data[:, cols].clone()
    try:
        o_proj.weight.data[:, cols] *= 0.1
        stats = collect_statistics([t], model, probe.batches)
    finally:
        o_proj.weight.data[:, cols] = saved
    score = t.score(stats)
    assert t.select(score, stats) == [HeadIndex(1, 2)]
    details = t.details(stats, score, [HeadIndex(1, 2)])
    assert all(r < 0.5 for r in details["ratio_by_domain"]["L1H2"].values())
    assert set(details["first_token_mass"]) == {"L1H2"}


def test_validation_expects_little_for_inactive_heads():
    """Zeroing inactive heads: the effect within 1% of the clean metric, and smaller (in
    absolute value) than random sets' in a Monte Carlo test: validated; beyond 1%: not."""
    from types import SimpleNamespace

    assert InactiveHead().expected() == "little"
    record = ClaimRecord("ablation", "", "loss", "zero", "little", 1, effect=0.02, clean=4.0)
    Ablation().finish(SimpleNamespace(head_type=InactiveHead()), record)  # type: ignore[arg-type]
    assert record.extra["tolerance"] == 0.01
    assert record.extra["relative_effect"] == pytest.approx(0.005)
    record.test = ControlTest(0.02, [0.5] * 99, 0, 0.01, 0.01, "n_max", 99, 5, 10**6, "u", "little")
    assert record.decide(0.05) == "validated"
    record.extra["relative_effect"] = 0.02  # beyond the tolerance
    assert record.decide(0.05) == "not validated"


def test_check_causal_fails_when_zeroing_costs_more_than_random(monkeypatch, model):
    """check_causal's "little" rule, on records standing in for classify's."""
    import importlib

    classify_module = importlib.import_module("headmech.classification.classify")

    def record(effect, random_mean, relative):
        extra = {"relative_effect": relative, "tolerance": 0.01}
        c = ClaimRecord("ablation", "", "loss", "zero", "little", 2, effect=effect, extra=extra)
        c.shown_controls = [random_mean]  # one control set: its mean
        v = TypeValidation(c, ControlAccounting("same_layers", "", 10, 45))

        class Fake:
            validation = v

        return lambda *a, **k: {"inactive": Fake()}

    monkeypatch.setattr(classify_module, "classify", record(0.002, 0.1, 0.0005))
    check_causal(InactiveHead(), model)
    for bad in (record(0.2, 0.1, 0.04), record(0.05, 0.1, 0.02)):
        monkeypatch.setattr(classify_module, "classify", bad)
        with pytest.raises(AssertionError):
            check_causal(InactiveHead(), model)
