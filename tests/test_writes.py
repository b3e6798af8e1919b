"""What a head writes (:mod:`headmech.attribution.writes`): each next token's direct effect
and the promoted / suppressed tokens, against a hand computation on a tiny LLaMA, against
the library's direct effects on a logit difference (through Gemma 3's post-attention
norm), and the refusals."""

from __future__ import annotations

import pytest
import torch

import headmech
from headmech.attribution.writes import head_writes
from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex
from headmech.interventions import recording
from headmech.interventions.direct_effects import head_direct_effects
from headmech.stream.engine import ProbeBatch, run_blocks

IDS = [1, 17, 45, 9, 17, 45, 9, 30, 12]


def test_effects_and_tokens_equal_a_hand_computation(tiny_models):
    """Tiny LLaMA (RMSNorm, no norm after attention): the head's write z_h W_O removed
    from the final residual, the final norm recomputed, the centred logits compared."""
    m = tiny_models["llama"]
    heads = [HeadIndex(1, 2), HeadIndex(0, 1)]
    got = head_writes(m, IDS, heads, k=3)
    t = torch.tensor([IDS])
    with torch.no_grad(), recording(m, ["blocks.1.attn.hook_z", "blocks.0.attn.hook_z"]) as st:
        resid = run_blocks(m, t, torch.ones_like(t))[0]

        def centred(x):
            logits = m.ln_final(x) @ m.W_U + m.b_U
            return logits - logits.mean(-1, keepdim=True)

        for h in heads:
            w = (
                st[f"blocks.{h.layer}.attn.hook_z"][0][:, h.head]
                @ m.blocks[h.layer].attn.W_O[h.head]
            )
            diff = centred(resid) - centred(resid - w)  # [pos, vocab]
            want = diff[torch.arange(len(IDS) - 1), torch.tensor(IDS[1:])]
            g = got[h]
            assert g.effects[-1] is None and len(g.effects) == len(IDS)
            assert torch.allclose(torch.tensor(g.effects[:-1]), want, atol=1e-5)
            assert g.at == int(want.abs().argmax())
            top = diff[g.at].topk(3)
            assert [i for i, _ in g.promoted] == top.indices.tolist()
            assert [v for _, v in g.promoted] == pytest.approx(top.values.tolist(), abs=1e-5)
            low = (-diff[g.at]).topk(3)
            assert [i for i, _ in g.suppressed] == low.indices.tolist()
            assert g.suppressed[0][1] == pytest.approx(float(diff[g.at].min()), abs=1e-5)
            end = diff[-1].topk(3)  # the last position: no next token, its write all the same
            assert [i for i, _ in g.end[0]] == end.indices.tolist()
            assert g.end[1][0][1] == pytest.approx(float(diff[-1].min()), abs=1e-5)
    assert any(abs(e) > 1e-4 for e in got[heads[0]].effects[:-1])  # a live head moves logits


def test_through_a_post_attention_norm_it_agrees_with_the_direct_path_effects(tmp_path):
    """Gemma 3's sandwich norm: a token pair's change under the head's write equals
    :func:`head_direct_effects` (``ld(r) - ld(r - w)``, the norm recomputed) at that
    position."""
    from headmech.models.tiny import build_tiny

    m = headmech.load_model(str(build_tiny("gemma3", tmp_path / "gemma3")))
    assert getattr(m.blocks[0], "ln1_post", None) is not None
    vocab = int(m.cfg.d_vocab)
    ids = [i % vocab for i in IDS]
    h = HeadIndex(1, 0)
    w = head_writes(m, ids, [h], k=vocab // 2)[h]
    t = torch.tensor([ids])
    query = torch.zeros_like(t, dtype=torch.bool)
    query[0, w.at] = True
    good = torch.full_like(t, ids[w.at + 1])
    bad_id = (ids[w.at + 1] + 1) % vocab
    bad = torch.full_like(t, bad_id)
    batch = ProbeBatch(t, torch.ones_like(t), torch.zeros_like(t, dtype=torch.bool))
    de = head_direct_effects(m, batch, (query, good, bad))
    change = {i: v for i, v in [*w.promoted, *w.suppressed]}  # half the vocabulary each way
    assert ids[w.at + 1] in change and bad_id in change
    assert change[ids[w.at + 1]] - change[bad_id] == pytest.approx(float(de[0, 1, 0]), abs=1e-4)
    assert w.effects[w.at] == pytest.approx(change[ids[w.at + 1]], abs=1e-5)


def test_refuses_encoders_and_one_token(tiny_models):
    with pytest.raises(HeadmechError, match="causal"):
        head_writes(tiny_models["bert"], IDS, [HeadIndex(0, 0)])
    with pytest.raises(HeadmechError, match="two tokens"):
        head_writes(tiny_models["llama"], [5], [HeadIndex(0, 0)])
