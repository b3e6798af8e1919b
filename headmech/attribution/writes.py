"""What a head writes: its direct effect on each next token of a text, and the tokens its
write promotes and suppresses.

On one text, head ``h``'s write at position ``q`` is ``w = z_h @ W_O[h]``, or, where a norm
follows the attention (Gemma 3's sandwich norm), what removing that from the block's
attention output changes after the norm: ``norm(a) - norm(a - z_h @ W_O[h])``. Its
*direct effect* on a logit is what removing ``w`` from the final residual ``r`` does to the
logit, the final norm recomputed: ``logit(r) - logit(r - w)`` (Wang et al. 2022's direct
path to the logits; for a pre-norm model without a post-attention norm, the direct logit
attribution of Elhage et al. 2021 but for the final norm's change of scale, which freezing
would ignore). Logits are centred, the mean over the vocabulary subtracted: the part the
softmax reads. :func:`head_writes` gives, per head, the direct effect on each position's
next token and, at the position where that is largest in size and at the last position
(where a prompt's answer is read), the ``k`` tokens the write raises and lowers most over
the whole vocabulary: what the head writes, measured on the text rather than read from its
weights alone.

References:
    Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits".
    Wang et al. 2022, "Interpretability in the Wild" (direct paths to the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex
from headmech.core.placement import model_device
from headmech.interventions import recording
from headmech.interventions.direct_effects import layer_write, post_norm
from headmech.models import model_info
from headmech.stream.engine import run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["HeadWrite", "head_writes"]


@dataclass
class HeadWrite:
    """One head on one text.

    Attributes:
        effects: per position, the direct effect of its write on the centred logit of the
            next token (None at the last position, which has none).
        at: the position whose effect is largest in size.
        promoted: there, the ``k`` tokens its write raises most: ``(token id, centred
            logit change)``, the largest first.
        suppressed: the ``k`` it lowers most, the most lowered first.
        end: the same two lists at the last position (where a prompt's answer is read:
            an IOI prompt's end, where name movers write the indirect object), which has
            no next token to score.
    """

    effects: list[float | None]
    at: int
    promoted: list[tuple[int, float]]
    suppressed: list[tuple[int, float]]
    end: tuple[list[tuple[int, float]], list[tuple[int, float]]] = ([], [])


@torch.no_grad()
def head_writes(
    model: TransformerBridge, ids: Sequence[int] | Tensor, heads: Sequence[HeadIndex], k: int = 5
) -> dict[HeadIndex, HeadWrite]:
    """Each of ``heads``' direct effect on every next token of the text ``ids`` (one
    sequence, the model's special tokens included) and, at its largest, the tokens its
    write promotes and suppresses (module docstring). One forward pass.

    Raises:
        HeadmechError: an encoder (no next token), a final logit soft-cap (the logits are
            not what the norm and unembedding alone give), fewer than two tokens.
    """
    if not model_info(model).causal:
        raise HeadmechError("what a head writes to the next token needs a causal (decoder) model")
    if float(getattr(model.cfg, "output_logits_soft_cap", -1.0) or -1.0) > 0:
        raise HeadmechError("a final logit soft-cap: the logits are not linear in the unembedding")
    dev = model_device(model)
    t = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).to(dev)
    if t.shape[1] < 2:
        raise HeadmechError("what a head writes needs a text of at least two tokens")
    layers = sorted({h.layer for h in heads})
    posts = {la: post_norm(model, la) is not None for la in layers}
    names = [f"blocks.{la}.attn.hook_z" for la in layers]
    names += [f"blocks.{la}.ln1_post.hook_in" for la in layers if posts[la]]
    with recording(model, names) as st:
        resid = run_blocks(model, t, torch.ones_like(t))[0].float()  # [pos, d_model]
    W_U = model.W_U.float()
    centred = W_U - W_U.mean(1, keepdim=True)  # [d_model, d_vocab]
    nxt = centred[:, t[0, 1:]]  # [d_model, pos - 1]: each position's next token
    normed = model.ln_final(resid.to(model.W_U.dtype)).float()
    out: dict[HeadIndex, HeadWrite] = {}
    for h in heads:
        z = st[f"blocks.{h.layer}.attn.hook_z"][0].float()  # [pos, n_heads, d_head]
        a = st[f"blocks.{h.layer}.ln1_post.hook_in"][0] if posts[h.layer] else None
        dz = torch.zeros_like(z)
        dz[:, h.head] = z[:, h.head]
        w = -layer_write(model, h.layer, -dz, a).float()  # norm(a) - norm(a - z_h W_O)
        without = model.ln_final((resid - w).to(model.W_U.dtype)).float()
        diff = normed - without  # [pos, d_model]: what the head's write adds after the norm
        eff = (diff[:-1] * nxt.T).sum(-1)  # [pos - 1]
        at = int(eff.abs().argmax())
        out[h] = HeadWrite(
            [float(e) for e in eff] + [None], at, *_extremes(diff[at] @ centred, k),
            end=_extremes(diff[-1] @ centred, k),
        )  # fmt: skip
    return out


def _extremes(change: Tensor, k: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The ``k`` tokens a change of the centred logits raises most and lowers most."""
    up, down = change.topk(k), (-change).topk(k)
    return (
        [(int(i), float(v)) for v, i in zip(up.values, up.indices, strict=True)],
        [(int(i), -float(v)) for v, i in zip(down.values, down.indices, strict=True)],
    )
