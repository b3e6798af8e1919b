"""The pieces the hand-built control models are made of (:mod:`headmech.testing.controls`,
:mod:`headmech.testing.recall_controls`): a random 2-layer, 4-head attention-only LLaMA with
SmolLM2's tokenizer, a head's weights set by hand, positional and still rotary dimensions,
unit-RMS embedding rows, and the bridge loaded back from a scratch folder.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.head_index import HeadIndex
from headmech.core.scratch import scratch_folder

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "ORD",
    "PLANTED",
    "llama",
    "load",
    "random_rows",
    "rotary_freqs",
    "rotary_qk",
    "set_head",
    "smollm2",
    "still_dims",
    "unit_rms",
]

PLANTED = HeadIndex(1, 2)  # the head that does the job, in every control model

# --- hand-built positive controls ------------------------------------------------------
# A type scored from weights (copy_suppression, successor) or from runs of the model
# itself (function_vector, inactive) is not found by replacing an attention pattern: its
# positive control is a tiny model built by hand in which head PLANTED does the job, and
# the type's score is computed from that model as from any other. Each is a 2-layer,
# 4-head attention-only LLaMA (MLPs zeroed, as in headmech.models.toys) with SmolLM2's tokenizer,
# random wherever it is not set. Embedding rows have unit RMS, so block 0 reads them as
# they are, and a constant dimension (ORD) lets a head read a fixed query or key at every
# position: with rotary embeddings, a fixed query and key score by the distance between
# the positions alone (rotary_qk), which is how the positional heads below are built.

ORD = 0  # embedding dimension holding the same value for every ordinary token


@functools.lru_cache(maxsize=1)
def smollm2() -> Any:
    """SmolLM2's tokenizer, which every control model uses (loaded once)."""
    from headmech.models.bundled import smollm2_tokenizer

    return smollm2_tokenizer()


def llama(d_model: int, d_head: int, rope_theta: float, seed: int) -> Any:
    """The random attention-only LLaMA a control model starts from (weights from ``seed``,
    the caller's random stream untouched)."""
    from headmech.models.tiny import tiny_hf

    model, _ = tiny_hf(
        "llama",
        seed=seed,
        tokenizer=smollm2(),
        init=0.02,  # transformers' own
        d_model=d_model,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        d_mlp=4,  # zeroed below: attention-only
        n_ctx=256,
        head_dim=d_head,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=None,  # SmolLM2's pad token is no padding row of the embedding
        tie_word_embeddings=False,
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
    return model


def load(model: Any, name: str) -> TransformerBridge:
    """The hand-set Hugging Face ``model`` as headmech loads any folder: saved with the
    tokenizer into a scratch folder (removed at exit) and loaded back as a bridge."""
    from headmech.models import load_model

    path = scratch_folder(f"headmech-{name}-")  # removed at exit
    model.save_pretrained(path)
    smollm2().save_pretrained(path)
    return load_model(str(path))


@torch.no_grad()
def set_head(model: Any, layer: int, head: int, **weights: torch.Tensor) -> None:
    """Set what head ``head`` of block ``layer`` reads (``q``, ``k``, ``v``: ``[d_head,
    d_model]``, from the normalised residual) and writes (``o``: ``[d_model, d_head]``)."""
    attn = model.model.layers[layer].self_attn
    d_head = int(model.config.head_dim)
    rows = slice(head * d_head, (head + 1) * d_head)
    for name in ("q", "k", "v"):
        if name in weights:
            getattr(attn, f"{name}_proj").weight[rows] = weights[name]
    if "o" in weights:
        attn.o_proj.weight[:, rows] = weights["o"]


def rotary_freqs(model: Any) -> torch.Tensor:
    """The rotation per position of each pair of head dimensions ``(i, i + d_head / 2)``."""
    d_head = int(model.config.head_dim)
    theta = float(model.config.rope_parameters["rope_theta"])
    return theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)


def rotary_qk(model: Any, offset: int, pairs: range) -> tuple[torch.Tensor, torch.Tensor]:
    """A query and a key in head space whose rotary score is ``sum over pairs of
    cos((i - j - offset) * freq)`` for query position i and key position j: largest at
    ``i - j = offset``, whatever the tokens."""
    freq = rotary_freqs(model)
    half = len(freq)
    q = torch.zeros(2 * half, dtype=torch.float64)
    k = torch.zeros_like(q)
    p = torch.tensor(list(pairs))
    q[p], q[p + half] = torch.cos(offset * freq[p]), -torch.sin(offset * freq[p])
    k[p] = 1.0
    return q.float(), k.float()


def still_dims(model: Any, n: int, span: int = 256) -> list[int]:
    """``n`` head dimensions that rotary embeddings turn by under 0.1 radian over ``span``
    positions: a query and key there score by content alone."""
    freq = rotary_freqs(model)
    pairs = (freq * span < 0.1).nonzero()[:, 0].tolist()
    dims = [d for p in pairs for d in (p, p + len(freq))]
    assert len(dims) >= n, f"only {len(dims)} head dimensions stay still over {span} positions"
    return sorted(dims[:n])


def unit_rms(emb: torch.Tensor, fill: list[int]) -> None:
    """Scale each row's ``fill`` columns so that the row has unit RMS (in place)."""
    d_model = emb.shape[1]
    rest = emb.pow(2).sum(1) - emb[:, fill].pow(2).sum(1)
    assert bool((rest < d_model).all()), "the fixed part of an embedding is too large"
    emb[:, fill] *= ((d_model - rest) / emb[:, fill].pow(2).sum(1).clamp(min=1e-12)).sqrt()[:, None]


def random_rows(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random unit vectors of ``d`` dimensions (rows), drawn from ``g``."""
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=1, keepdim=True)
