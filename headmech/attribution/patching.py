"""Activation patching and attribution patching of head outputs (``hook_z``).

Activation patching runs the model on one input while a head's output is copied in from
a run on another input of the same token length: *denoising* patches clean activations
into the corrupted run (how much of the clean behaviour does this head restore?),
*noising* patches corrupted activations into the clean run (how much does the behaviour
break without this head's clean output?). One forward pass per head (or head x position),
batched here as copies along the batch dimension.

Attribution patching (Nanda 2023; Syed et al. 2023) replaces those passes by a first-order
Taylor expansion around the run being patched: ``metric(patched) ≈ metric(base) +
(z_source - z_base) · ∂metric/∂z |_base``, one forward and one backward pass for every head
and position at once. It is exact when the metric is linear in the patched head's output
(a last-layer head read by a linear function of the residual stream) and an
approximation otherwise; :func:`spearman` measures the rank agreement.

The prompt-pair functions follow TransformerLens' ``patching.py`` semantics: the metric is
a function of the logits returning a scalar, the result holds the metric of each patched
run, ``[n_layers, n_heads]`` for all positions (``get_act_patch_attn_head_out_all_pos``)
or ``[n_layers, pos, n_heads]`` per position (``get_act_patch_attn_head_out_by_pos``).

References:
    Meng et al. 2022, "Locating and Editing Factual Associations in GPT" (causal tracing).
    Wang et al. 2022, "Interpretability in the Wild" (path/activation patching).
    Nanda 2023, "Attribution Patching: Activation Patching At Industrial Scale".
    Syed, Rager, Conmy 2023, "Attribution Patching Outperforms Automated Circuit Discovery".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headmech.attribution.ablation import Cost, Edit, capture_z, task_damage
from headmech.engine import ProbeBatch
from headmech.errors import InputError
from headmech.tasks import CallableTask, Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "activation_patching",
    "attribution_patching",
    "patching_importance",
    "prompt_pair_task",
    "spearman",
    "z_gradients",
]

Direction = Literal["denoising", "noising"]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two score tensors (flattened; NaN pairs dropped)."""
    from scipy.stats import spearmanr

    x, y = a.flatten().double().cpu().numpy(), b.flatten().double().cpu().numpy()
    keep = ~(torch.isnan(a.flatten().cpu()) | torch.isnan(b.flatten().cpu())).numpy()
    return float(spearmanr(x[keep], y[keep]).statistic)


def _as_batch(model: TransformerBridge, tokens: Int[Tensor, "batch pos"]) -> ProbeBatch:
    tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens[None]
    mask = torch.ones_like(tokens)
    special = torch.zeros_like(tokens, dtype=torch.bool)
    return ProbeBatch(tokens, mask, special)


def prompt_pair_task(
    model: TransformerBridge,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Callable[[Tensor], Tensor],
) -> tuple[CallableTask, ProbeBatch, ProbeBatch]:
    """A task holding one clean and one corrupted batch of equal token length."""
    clean, corrupt = _as_batch(model, clean_tokens), _as_batch(model, corrupted_tokens)
    if clean.input_ids.shape != corrupt.input_ids.shape:
        raise InputError(
            f"clean and corrupted prompts must have the same shape (token length), got "
            f"{tuple(clean.input_ids.shape)} and {tuple(corrupt.input_ids.shape)}"
        )
    task = CallableTask(
        lambda logits, batch: metric(logits),
        name="prompt_pairs",
        on="logits",
        metric=getattr(metric, "__name__", "metric"),
        batches=[clean],
        corrupt_batches=[corrupt],
    )
    return task, clean, corrupt


def _patch_runs(
    model: TransformerBridge,
    task: Task,
    base: ProbeBatch,
    source_z: Tensor,
    per_position: bool,
    chunk: int,
    cost: Cost | None,
) -> tuple[Tensor, float]:
    """Damage (task value) of ``base`` with each head (x position) patched from ``source_z``."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    n_pos = int(base.input_ids.shape[1])
    positions: Sequence[int | None] = range(n_pos) if per_position else [None]
    # order: layer, pos, head (TransformerLens' by_pos layout)
    index = [(la, p, h) for la in range(n_layers) for p in positions for h in range(n_heads)]

    def copies_for(bi: int, batch: ProbeBatch) -> list[list[Edit]]:
        return [[Edit(la, h, source_z[la, :, :, h], pos=p)] for la, p, h in index]

    values, clean = task_damage(model, task, [base], copies_for, len(index), chunk=chunk, cost=cost)
    if per_position:
        return values.view(n_layers, n_pos, n_heads), clean  # [layer * pos * head] -> grid
    return values.view(n_layers, n_heads), clean


def activation_patching(
    model: TransformerBridge,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Callable[[Float[Tensor, "batch pos d_vocab"]], Tensor],
    *,
    per_position: bool = False,
    direction: Direction = "denoising",
    chunk: int = 8,
) -> Float[Tensor, "n_layers ..."]:
    """The metric of every run with one head's output (at one position) patched.

    Args:
        model: a ``TransformerBridge``.
        clean_tokens, corrupted_tokens: prompt pairs of equal token length.
        metric: logits -> scalar (e.g. a logit difference of two answer tokens).
        per_position: patch each head at each position separately.
        direction: ``denoising`` (clean outputs into the corrupted run, as
            TransformerLens' ``get_act_patch_attn_head_out_*``) or ``noising``.
        chunk: patched runs per forward pass.

    Returns:
        ``[n_layers, n_heads]``, or ``[n_layers, pos, n_heads]`` with ``per_position``.
    """
    task, clean, corrupt = prompt_pair_task(model, clean_tokens, corrupted_tokens, metric)
    base, source = (corrupt, clean) if direction == "denoising" else (clean, corrupt)
    z_src = capture_z(model, source)  # [n_layers, batch, pos, n_heads, d_head]
    return _patch_runs(model, task, base, z_src, per_position, chunk, None)[0]


def z_gradients(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    *,
    reference: Any = None,
    linear: bool = True,
    head_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward and backward pass: every head's output and the damage's gradient.

    Args:
        head_mask: optional ``[n_layers, n_heads]`` leaf multiplying each head's output;
            its gradient is returned too (Michel et al.'s ξ).

    Returns:
        ``(z, grad, damage_sum, count)``: ``z`` and ``∂(damage sum)/∂z`` are
        ``[n_layers, batch, pos, n_heads, d_head]``; with ``head_mask`` the gradient is
        taken with respect to the masked output ``ξ·z``.
    """
    n_layers = int(model.cfg.n_layers)
    zs: dict[int, Tensor] = {}
    deltas: dict[int, Tensor] = {}

    def make(layer: int) -> Callable[..., Tensor]:
        def hook(z: Tensor, hook: Any) -> Tensor:
            # z: [batch, pos, head_index, d_head]
            zs[layer] = z.detach()
            delta = torch.zeros_like(z, requires_grad=True)  # d(damage)/d(delta) = d/dz
            deltas[layer] = delta
            if head_mask is not None:
                z = z * head_mask[layer].to(z.dtype)[None, None, :, None]
            return z + delta

        return hook

    hooks = [(f"blocks.{la}.attn.hook_z", make(la)) for la in range(n_layers)]
    with torch.enable_grad():
        s, c = task.damage(model, batch, hooks, reference=reference, linear=linear)
        leaves = [deltas[la] for la in range(n_layers)]
        if head_mask is not None:
            leaves.append(head_mask)
        grads = torch.autograd.grad(s.sum(), leaves, allow_unused=True)
    g = [torch.zeros_like(leaves[i]) if grads[i] is None else grads[i] for i in range(len(leaves))]
    z = torch.stack([zs[la] for la in range(n_layers)])
    grad = torch.stack(g[:n_layers])
    if head_mask is not None:
        head_mask.grad = g[-1] if head_mask.grad is None else head_mask.grad + g[-1]
    return z, grad, s.detach().sum(), c.sum()


def attribution_patching(
    model: TransformerBridge,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Callable[[Float[Tensor, "batch pos d_vocab"]], Tensor],
    *,
    per_position: bool = False,
    direction: Direction = "denoising",
) -> Float[Tensor, "n_layers ..."]:
    """First-order estimate of :func:`activation_patching` (same arguments and layout).

    ``metric(base) + Σ (z_source - z_base)·∂metric/∂z`` at the base run, summed over
    ``d_head`` (and positions unless ``per_position``): one forward + backward pass on the
    base run and one forward pass on the source run.
    """
    task, clean, corrupt = prompt_pair_task(model, clean_tokens, corrupted_tokens, metric)
    base, source = (corrupt, clean) if direction == "denoising" else (clean, corrupt)
    z_src = capture_z(model, source)  # [n_layers, batch, pos, n_heads, d_head]
    z, grad, value, _ = z_gradients(model, task, base)
    contrib = ((z_src - z) * grad).sum(-1).sum(1)  # [n_layers, pos, n_heads]
    if not per_position:
        contrib = contrib.sum(1)  # [n_layers, n_heads]
    return float(value) + contrib


def patching_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    *,
    direction: Direction = "noising",
    approximate: bool = False,
    seed: int = 0,
    chunk: int = 8,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float]:
    """Head importance from patching between the task's clean and corrupted inputs.

    ``noising`` (default): ``damage(clean run, head from corrupted) - damage(clean)``,
    directly comparable with ablation. ``denoising``: ``damage(corrupted) -
    damage(corrupted run, head from clean)``, the damage the head's clean output repairs.
    With ``approximate`` the patched damages are attribution-patching estimates.

    Returns:
        ``(score [n_layers, n_heads], damage of the unpatched base run)``.
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    pairs = []
    for bi, batch in enumerate(batches):
        corrupt = task.corrupt(batch, model, seed * 1_000_003 + bi)
        pairs.append((batch, corrupt) if direction == "noising" else (corrupt, batch))
    bases = [b for b, _ in pairs]
    sign = 1.0 if direction == "noising" else -1.0
    if not approximate:
        current: dict[int, Tensor] = {}

        def copies_for(bi: int, batch: ProbeBatch) -> list[list[Edit]]:
            current.clear()
            current[bi] = capture_z(model, pairs[bi][1])  # [n_layers, batch, pos, heads, d_head]
            if cost is not None:
                cost.add(int(batch.input_ids.shape[0]))
            z_src = current[bi]
            return [
                [Edit(la, h, z_src[la, :, :, h])] for la in range(n_layers) for h in range(n_heads)
            ]

        values, base_damage = task_damage(
            model,
            task,
            bases,
            copies_for,
            n_layers * n_heads,
            chunk=chunk,
            cost=cost,
            progress=progress,
        )
        return sign * (values - base_damage).view(n_layers, n_heads), base_damage
    total = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    base_sum, base_count = 0.0, 0.0
    it: Any = pairs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(pairs, desc=progress if isinstance(progress, str) else "batches", leave=False)
    for base, source in it:
        n_seq = int(base.input_ids.shape[0])
        z_src = capture_z(model, source)  # [n_layers, batch, pos, n_heads, d_head]
        z, grad, s, c = z_gradients(model, task, base, linear=True)
        if cost is not None:
            cost.add(n_seq)  # the source run
            cost.add(n_seq, backward=True)  # forward + backward on the base run
        total += ((z_src - z) * grad).sum((-1, 1, 2)).double().cpu()  # [n_layers, n_heads]
        base_sum += float(s)
        base_count += float(c)
    return (sign * total / max(base_count, 1.0)).float(), base_sum / max(base_count, 1.0)
