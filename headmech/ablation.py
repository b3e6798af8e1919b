"""Head ablation through hooks: zero, mean and uniform-attention.

Three ways to take heads out, which can disagree (REFERENCES.md, "implications"):

* ``zero`` — the head's output ``hook_z`` is set to 0 (Michel et al. 2019's mask ξ_h = 0);
* ``mean`` — ``hook_z`` is replaced by its mean over a probe set (keeps the average
  contribution, removes the input dependence);
* ``uniform`` — the head attends uniformly to every key it may see (Wu et al. 2024 mask
  retrieval heads this way); its value path stays.

Each function returns TransformerLens ``fwd_hooks`` (``(hook_name, fn)`` pairs) for
``model.hooks(fwd_hooks=...)``; hooks return a modified copy and never write into the
activation they receive.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.engine import ProbeBatch, run_blocks
from headmech.errors import HeadmechError
from headmech.heads import HeadIndex

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["AblationMode", "ablation_hooks", "mean_head_outputs", "random_heads"]

AblationMode = Literal["zero", "mean", "uniform"]
Hook = tuple[str, Callable[..., Tensor]]


def _by_layer(heads: Iterable[HeadIndex | Sequence[int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for layer, head in heads:
        out.setdefault(int(layer), []).append(int(head))
    return out


def ablation_hooks(
    model: TransformerBridge,
    heads: Iterable[HeadIndex | Sequence[int]],
    mode: AblationMode = "zero",
    means: Float[Tensor, "n_layers n_heads d_head"] | None = None,
) -> list[Hook]:
    """Hooks that ablate ``heads``.

    Args:
        model: the bridge the hooks are for (its config says causal or not).
        heads: ``(layer, head)`` pairs (query heads under grouped-query attention).
        mode: ``"zero"``, ``"mean"`` or ``"uniform"``.
        means: per-head mean ``hook_z`` for ``"mean"`` (see :func:`mean_head_outputs`).

    Returns:
        ``fwd_hooks`` for ``model.hooks``.
    """
    layers = _by_layer(heads)
    if mode == "uniform" and layers and not pattern_edits_apply(model):
        raise HeadmechError(
            "uniform-attention ablation is not possible on this model: its bridge ignores "
            "edits of hook_pattern; use zero or mean ablation"
        )
    causal = getattr(model.cfg, "attention_dir", "causal") != "bidirectional"
    hooks: list[Hook] = []
    if mode == "mean" and means is None:
        raise ValueError("mean ablation needs `means` (headmech.ablation.mean_head_outputs)")
    for layer, hs in sorted(layers.items()):
        idx = torch.tensor(sorted(set(hs)))
        if mode in ("zero", "mean"):

            def z_hook(z: Tensor, hook: Any, idx: Tensor = idx, layer: int = layer) -> Tensor:
                # z: [batch, pos, head_index, d_head]
                z = z.clone()
                if mode == "zero":
                    z[:, :, idx] = 0.0
                else:
                    assert means is not None
                    z[:, :, idx] = means[layer, idx].to(z.dtype).to(z.device)
                return z

            hooks.append((f"blocks.{layer}.attn.hook_z", z_hook))
        elif mode == "uniform":

            def p_hook(pattern: Tensor, hook: Any, idx: Tensor = idx) -> Tensor:
                # pattern: [batch, head_index, query_pos, key_pos]
                n_q, n_k = pattern.shape[-2:]
                if causal:  # keys up to the query (offset for cached keys)
                    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=pattern.device)
                    allowed = allowed.tril(n_k - n_q)[None, None]
                else:  # real keys: padding gets exactly zero weight from every head
                    allowed = (pattern > 0).any(1, keepdim=True)
                u = allowed.to(pattern.dtype)
                u = u / u.sum(-1, keepdim=True).clamp(min=1)
                out = pattern.clone()
                out[:, idx] = u[:, 0, None].expand(-1, len(idx), -1, -1)
                return out

            hooks.append((f"blocks.{layer}.attn.hook_pattern", p_hook))
        else:
            raise ValueError(f"unknown ablation mode '{mode}' (zero, mean, uniform)")
    return hooks


def pattern_edits_apply(model: TransformerBridge) -> bool:
    """Whether an edited ``hook_pattern`` changes the model's output.

    Some bridges (BERT's) let the wrapped Hugging Face attention consume the original
    pattern and discard hook edits; uniform-attention ablation cannot work there.
    """
    cached = getattr(model, "_headmech_pattern_edits_apply", None)
    if cached is not None:
        return bool(cached)
    ids = torch.tensor([[model.tokenizer.bos_token_id or 1, 5, 6, 7, 8]]).clamp(
        max=int(model.cfg.d_vocab) - 1
    )
    ids = ids.to(next(model.parameters()).device)

    def flat(p: Tensor, hook: Any) -> Tensor:
        return torch.ones_like(p) / p.shape[-1]

    with torch.inference_mode():
        clean = model(ids)
        with (
            model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", flat)]),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            edited = model(ids)
    ok = not torch.allclose(clean, edited)
    model._headmech_pattern_edits_apply = ok
    return ok


def mean_head_outputs(
    model: TransformerBridge, batches: Iterable[ProbeBatch]
) -> Float[Tensor, "n_layers n_heads d_head"]:
    """Mean ``hook_z`` of every head over the real tokens of a probe (for mean ablation)."""
    cfg = model.cfg
    sums = torch.zeros(int(cfg.n_layers), int(cfg.n_heads), int(cfg.d_head), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    real = torch.ones(0, dtype=torch.bool)

    def hook(z: Tensor, hook: Any) -> None:
        # z: [batch, pos, head_index, d_head]
        sums[int(hook.name.split(".")[1])] += z[real.to(z.device)].sum(0).double().cpu()

    device = next(model.parameters()).device
    with (
        torch.inference_mode(),
        model.hooks(fwd_hooks=[(lambda n: n.endswith("attn.hook_z"), hook)]),
    ):
        for batch in batches:
            real = batch.attention_mask.bool()
            count += real.sum()
            run_blocks(model, batch.input_ids.to(device), batch.attention_mask.to(device))
    return (sums / count).float()


def random_heads(
    n_layers: int,
    n_heads: int,
    k: int,
    *,
    exclude: Iterable[HeadIndex | Sequence[int]] = (),
    generator: torch.Generator,
    like: Sequence[HeadIndex | Sequence[int]] | None = None,
) -> list[HeadIndex]:
    """``k`` distinct heads drawn uniformly from those not in ``exclude``.

    With ``like`` (a head set to mimic), draw layer-matched controls instead: for each
    layer, as many heads from that layer as ``like`` has there (topping up from other
    layers where a layer has too few unexcluded heads). Ablation effects depend strongly on
    depth, so a layer-matched control is the fair comparison for labelled heads.
    """
    banned = {(int(a), int(b)) for a, b in exclude}
    free = [
        HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads) if (la, h) not in banned
    ]
    if k > len(free):
        raise ValueError(f"cannot draw {k} heads from {len(free)}")

    def draw(pool: list[HeadIndex], m: int) -> list[HeadIndex]:
        perm = torch.randperm(len(pool), generator=generator)[:m]
        return [pool[int(i)] for i in perm]

    if like is None:
        return draw(free, k)
    per_layer = _by_layer(like)
    chosen: list[HeadIndex] = []
    for layer, hs in sorted(per_layer.items()):
        pool = [h for h in free if h.layer == layer]
        chosen += draw(pool, min(len(hs), len(pool)))
    rest = [h for h in free if h not in chosen]
    return chosen + draw(rest, k - len(chosen))
