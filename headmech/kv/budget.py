"""How a KV budget is spent (:func:`split_budget`) and which KV heads a catalog ranks
first for it (:func:`kv_ranking`); :class:`headmech.kv.plan.KVPlan` builds on both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import InputError

if TYPE_CHECKING:
    from headmech.classification.results import HeadCatalog

__all__ = ["kv_ranking", "model_windows", "split_beyond_windows", "split_budget"]


NOT_A_DECODER = (
    "{} is an encoder (bidirectional attention, no generation): it has no KV cache to "
    "compress; a KV plan needs a decoder"
)


def model_shape(model: Any) -> tuple[str, int, int, int]:
    """``(name, n_layers, n_heads, n_kv_heads)`` of a bridge or a Hugging Face model."""
    if hasattr(model, "cfg"):
        from headmech.models import model_info

        i = model_info(model)
        if not i.causal:
            raise InputError(NOT_A_DECODER.format(i.name))
        return i.name, i.n_layers, i.n_heads, i.n_kv_heads
    cfg = model.config
    n_heads = int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    n_layers = int(getattr(cfg, "num_hidden_layers", None) or cfg.n_layer)
    return str(getattr(cfg, "name_or_path", "") or "model"), n_layers, n_heads, n_kv


def positive_int(value: int, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def split_budget(
    budget: float,
    context: int,
    n_kv_total: int,
    sinks: int,
    window: int,
    n_full: int | None = None,
) -> tuple[int, int]:
    """How a KV budget is spent: ``(full KV heads, window)``.

    As many KV heads keep the whole cache as leave every other head at least ``sinks +
    window`` entries within ``budget`` (a fraction of the whole cache at ``context``
    tokens), or ``n_full`` if given; the window of the others then widens to spend what
    is left. Below ``(sinks + window) / context`` no head is full and the window shrinks.

    Raises:
        InputError: a budget outside (0, 1] or too small for one token beyond the sinks.
    """
    if not 0 < budget <= 1:
        raise InputError(f"a KV budget is a fraction in (0, 1], got {budget}")
    positive_int(context, "context", 1)
    total = budget * context * n_kv_total  # cached positions the budget allows
    small = min(context, sinks + window)
    if n_full is not None:
        k = n_full
    elif small >= context:
        return n_kv_total, window
    else:
        k = min(n_kv_total, max(0, math.floor((total - n_kv_total * small) / (context - small))))
    if k == n_kv_total:
        return k, window
    w = math.floor((total - k * context) / (n_kv_total - k) + 1e-9) - sinks
    if w < 1:
        raise InputError(f"a budget of {budget} at {context} tokens leaves no window")
    return k, min(w, context)


def kv_ranking(catalog: HeadCatalog, types: Sequence[str], group: int) -> list[tuple[int, int]]:
    """Every ``(layer, kv_head)``, best first: a KV head's score is its best query head's
    best score over ``types``, each score divided by its type's threshold (labelled heads
    first, then the rest by how close they come); ties by position."""
    scores = []
    for t in types:
        r = catalog[t]
        s = torch.nan_to_num(r.score.float(), nan=float("-inf"))
        scores.append(s / r.threshold if r.threshold > 0 else s)
    best = torch.stack(scores).amax(0)  # [n_layers, n_heads]
    kv = best.view(best.shape[0], -1, group).amax(-1)  # [n_layers, n_kv_heads]
    order = sorted(
        ((float(kv[la, k]), la, k) for la in range(kv.shape[0]) for k in range(kv.shape[1])),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    return [(la, k) for _, la, k in order]


def model_windows(model: Any) -> tuple[int, ...]:
    """Per layer, the model's own sliding window in tokens (0: the layer sees the whole
    context), from a bridge's or a Hugging Face model's config: Gemma 2/3 and gpt-oss
    name each layer's kind in ``layer_types``, Mistral windows every layer. A KV plan
    saves only what lies beyond these windows (:meth:`~headmech.kv.plan.KVPlan.kv_fraction`)."""
    hf = getattr(model, "original_model", model)
    cfg = getattr(hf, "config", None)
    n_layers = int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0) or 0)
    window = getattr(cfg, "sliding_window", None)
    if not window or not n_layers:
        return (0,) * n_layers
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention"] * n_layers
    # transformers' sliding mask lets a query see itself and the window - 1 keys before it
    return tuple(int(window) if k == "sliding_attention" else 0 for k in kinds)


def split_beyond_windows(
    budget: float,
    context: int,
    windows: Sequence[int],
    n_kv: int,
    sinks: int,
    window: int,
    ranking: Sequence[tuple[int, int]],
) -> tuple[set[int], int, int]:
    """How a budget is spent on a model whose layers may have their own sliding windows:
    ``(layers without one, full KV heads among theirs, window)``.

    ``budget`` is a fraction of the model's own cache at ``context`` tokens (windowed
    layers hold their window). What the windowed layers hold is subtracted; the rest is
    split among the other layers' KV heads (:func:`split_budget`), no more full than
    ``ranking`` names among them.
    """
    own = [min(context, w) if w else context for w in windows]
    glob = {la for la, w in enumerate(windows) if not w}
    if not glob:
        raise InputError("every layer of this model has its own sliding window: no plan")
    if not 0 < budget <= 1:
        raise InputError(f"a KV budget is a fraction in (0, 1], got {budget}")
    fixed = sum(o for la, o in enumerate(own) if la not in glob)
    share = (budget * sum(own) - fixed) / (len(glob) * context)
    if share <= 0:
        raise InputError(
            f"a KV budget of {budget:.0%} at {context} tokens is less than the model's own "
            f"sliding windows hold ({fixed / sum(own):.1%} of its cache)"
        )
    n = len(glob) * n_kv
    k, _ = split_budget(min(share, 1.0), context, n, sinks, window)
    k = min(k, sum(1 for la, _ in ranking if la in glob))
    _, w = split_budget(min(share, 1.0), context, n, sinks, window, n_full=k)
    return glob, k, w
