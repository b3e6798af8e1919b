"""Ships (headmech.interventions.ships) and its refusal probe and task: the score against
the authors' definition computed by hand (KL of the last token's distribution with one
head's query scaled by 0), the pattern form against the query form, and the probe's
refusals (a tokenizer without a chat template)."""

from __future__ import annotations

import pytest
import torch

from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex
from headmech.interventions import Intervention, applied
from headmech.interventions.effects import Scale
from headmech.interventions.ships import refuses, ships_scores
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.refusal import REQUESTS, is_refusal


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2  # an instruct model: its chat template, a reply that moves


@pytest.fixture(scope="module")
def batches(model):
    return build_probe("refusal", model, ProbeOptions(n_sequences=6, batch_size=4)).batches


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]  # SmolLM2-Instruct's tokenizer: its chat template


def _by_hand(model, batches, layer: int, head: int) -> float:
    """The authors' steps: per harmful request, the last token's distribution clean and
    with the head's query scaled by 0, KL(p || p') with 1e-12 added to both, averaged."""
    zero = torch.ones(int(model.cfg.n_layers), int(model.cfg.n_heads))
    zero[layer, head] = 0
    out = []
    with torch.no_grad():
        for b in batches:
            for row in range(b.input_ids.shape[0]):
                if not bool(b.extras["harmful"][row]):
                    continue
                ids = b.input_ids[row : row + 1, : int(b.extras["end_pos"][row]) + 1]
                p = torch.softmax(model(ids)[0, -1].float(), -1) + 1e-12
                with applied(model, [Intervention.on([(layer, head)], Scale(zero), site="q")]):
                    q = torch.softmax(model(ids)[0, -1].float(), -1) + 1e-12
                out.append(float((p * (p.log() - q.log())).sum()))
    return sum(out) / len(out)


def test_the_probe_pairs_each_harmful_request_with_its_benign_twin(tiny):
    batches = build_probe("refusal", tiny, ProbeOptions(n_sequences=6, batch_size=4)).batches
    rows = [(int(b.extras["pair"][i]), bool(b.extras["harmful"][i])) for b in batches for i in range(len(b.input_ids))]  # fmt: skip
    assert sorted(rows) == [(p, h) for p in range(3) for h in (False, True)]
    tok = tiny.tokenizer
    b = batches[0]
    text = tok.decode(b.input_ids[0, : int(b.extras["end_pos"][0]) + 1])
    pair, harmful = int(b.extras["pair"][0]), bool(b.extras["harmful"][0])
    assert (
        REQUESTS[pair][0 if harmful else 1] in text and "assistant" in text.rstrip().split("\n")[-1]
    )


@pytest.mark.slow
def test_ships_is_the_authors_kl_with_the_query_scaled_by_zero(model, batches):
    heads = [HeadIndex(0, 1), HeadIndex(23, 4)]
    got = ships_scores(model, batches=batches, heads=heads, ablation="query")
    assert got["requests"] == 3 and got["per_request"].shape == (3, 2)
    for h in heads:
        assert float(got["ships"][h.layer, h.head]) == pytest.approx(_by_hand(model, batches, *h), rel=1e-3, abs=1e-7)  # fmt: skip
    assert torch.isnan(got["ships"][0, 0])  # not measured
    # the query scaled by 0 leaves the head's attention uniform over the causal keys
    uniform = ships_scores(model, batches=batches, heads=heads)
    assert torch.allclose(uniform["per_request"], got["per_request"], rtol=1e-3, atol=1e-7)
    assert float(got["per_request"].min()) > 1e-6  # a real shift, not rounding


@pytest.mark.slow
def test_refusal_is_read_from_the_greedy_reply_and_bad_input_is_refused(model, batches):
    refused, replies = refuses(model, batches[:1], n_tokens=3)
    assert len(replies) == len(refused) == batches[0].input_ids.shape[0]
    # SmolLM2-135M-Instruct writes the bullying message ("Hey buddy,") and the benign ones
    assert not bool(refused.any()), replies
    with pytest.raises(InputError, match="unknown Ships ablation"):
        ships_scores(model, batches=batches, heads=[HeadIndex(0, 0)], ablation="zero")


def test_a_base_models_tokenizer_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(tiny.tokenizer, "chat_template", None)
    with pytest.raises(InputError, match="needs an instruct model's chat template"):
        build_probe("refusal", tiny, ProbeOptions(n_sequences=2))


@pytest.mark.parametrize(
    ("reply", "refused"),
    [
        ("I'm sorry, but I can't help with that.", True),
        ("  I cannot assist with that request.", True),
        ("I\u2019m sorry, but I can\u2019t", True),  # typographic apostrophe
        ("As an AI language model, I", True),
        ("Sure! Here is a message", False),
        ("Here's how to pick a lock:", False),
        ("You can't be serious", False),  # a refusal word, not at the start
        ("", False),
    ],
)
def test_a_refusal_is_a_reply_that_starts_with_a_refusal_prefix(reply, refused):
    assert is_refusal(reply) is refused
