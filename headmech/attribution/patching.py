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
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headmech.attribution.ablation import paired_units
from headmech.core.errors import InputError
from headmech.interventions import Cost, Intervention, Patch, capture_z, gradients, run_variants
from headmech.runs import resume
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues
from headmech.tasks import CallableTask, Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "activation_patching",
    "attribution_patching",
    "exact_patching",
    "patching_importance",
    "prompt_pair_task",
    "spearman",
]

Direction = Literal["denoising", "noising"]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two score tensors (flattened; NaN pairs dropped)."""
    from scipy.stats import spearmanr

    x, y = a.flatten().double().cpu().numpy(), b.flatten().double().cpu().numpy()
    keep = ~(torch.isnan(a.flatten().cpu()) | torch.isnan(b.flatten().cpu())).numpy()
    return float(spearmanr(x[keep], y[keep]).statistic)


def _as_batch(tokens: Int[Tensor, "batch pos"]) -> ProbeBatch:
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
    clean, corrupt = _as_batch(clean_tokens), _as_batch(corrupted_tokens)
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


def _head_patches(
    model: TransformerBridge,
    source_z: Tensor,
    positions: Sequence[int | None],
    heads: Sequence[tuple[int, int]] | None = None,
) -> list[list[Intervention]]:
    """One variant per (layer, position, head), TransformerLens' by_pos order (or per
    head of ``heads``, in their order)."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    patch = Patch(source_z)
    if heads is not None:
        return [[Intervention.on([h], patch)] for h in heads]
    return [
        [Intervention.on([(la, h)], patch, pos=p)]
        for la in range(n_layers)
        for p in positions
        for h in range(n_heads)
    ]


def activation_patching(
    model: TransformerBridge,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Callable[[Float[Tensor, "batch pos d_vocab"]], Tensor],
    *,
    per_position: bool = False,
    direction: Direction = "denoising",
    chunk: int | None = None,
) -> Float[Tensor, "n_layers ..."]:
    """The metric of every run with one head's output (at one position) patched.

    Args:
        model: a ``TransformerBridge``.
        clean_tokens, corrupted_tokens: prompt pairs of equal token length.
        metric: logits -> scalar (e.g. a logit difference of two answer tokens).
        per_position: patch each head at each position separately.
        direction: ``denoising`` (clean outputs into the corrupted run, as
            TransformerLens' ``get_act_patch_attn_head_out_*``) or ``noising``.
        chunk: patched runs per forward pass (default: from the runner's memory budget).

    Returns:
        ``[n_layers, n_heads]``, or ``[n_layers, pos, n_heads]`` with ``per_position``.
    """
    task, clean, corrupt = prompt_pair_task(model, clean_tokens, corrupted_tokens, metric)
    base, source = (corrupt, clean) if direction == "denoising" else (clean, corrupt)
    n_pos = int(base.input_ids.shape[1])
    positions: Sequence[int | None] = range(n_pos) if per_position else [None]
    variants = _head_patches(model, capture_z(model, source), positions)
    values, _ = run_variants(model, task, [base], variants, chunk=chunk)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if per_position:
        return values.view(n_layers, n_pos, n_heads)  # [layer * pos * head] -> grid
    return values.view(n_layers, n_heads)


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
    z, grad, values, _ = gradients(model, task, base)
    value = values.sum()
    contrib = ((z_src - z) * grad).sum(-1).sum(1)  # [n_layers, pos, n_heads]
    if not per_position:
        contrib = contrib.sum(1)  # [n_layers, n_heads]
    return float(value) + contrib


def patching_pairs(
    model: TransformerBridge, task: Task, batches: Sequence[ProbeBatch], direction: str, seed: int
) -> list[tuple[ProbeBatch, ProbeBatch]]:
    """Per batch, ``(base, source)``: noising patches corrupted outputs into the clean run,
    denoising clean outputs into the corrupted run (corruption seed per batch)."""
    pairs = []
    for bi, batch in enumerate(batches):
        corrupt = task.corrupt(batch, model, seed * 1_000_003 + bi)
        pairs.append((batch, corrupt) if direction == "noising" else (corrupt, batch))
    return pairs


def _exact(
    model: TransformerBridge,
    task: Task,
    pairs: list[tuple[ProbeBatch, ProbeBatch]],
    chunk: int | None,
    cost: Cost | None,
    progress: bool | str,
    heads: Sequence[tuple[int, int]] | None = None,
) -> tuple[Tensor, float, UnitValues]:
    def variants(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        z_src = capture_z(model, pairs[bi][1])  # [n_layers, batch, pos, heads, d_head]
        if cost is not None:
            cost.add(int(batch.input_ids.shape[0]))
        return _head_patches(model, z_src, [None], heads)

    bases = [b for b, _ in pairs]
    values, base, sums, counts = run_variants(
        model, task, bases, variants, chunk=chunk, cost=cost, progress=progress, per_unit=True
    )
    width = int(model.cfg.n_heads) if heads is None else len(heads)
    return values - base, base, paired_units(sums, counts, width)


def _approximate(
    model: TransformerBridge,
    task: Task,
    pairs: list[tuple[ProbeBatch, ProbeBatch]],
    cost: Cost | None,
    progress: bool | str,
) -> tuple[Tensor, float, UnitValues]:
    def one(pair: tuple[ProbeBatch, ProbeBatch]) -> tuple[Tensor, Tensor]:
        base, source = pair
        n_seq = int(base.input_ids.shape[0])
        z_src = capture_z(model, source)  # [n_layers, batch, pos, n_heads, d_head]
        ref = task.reference(model, base)
        z, grad, s, c = gradients(model, task, base, reference=ref)
        if cost is not None:
            cost.add(n_seq)  # the source run
            cost.add(n_seq, backward=True)  # forward + backward on the base run
        contrib = ((z_src - z) * grad).sum((-1, 2)).double().cpu()  # [n_layers, batch, heads]
        s, c = s.double().cpu().reshape(-1), c.double().cpu().reshape(-1)
        if c.numel() == n_seq:  # per sequence; den rows: (count, clean metric sum)
            return contrib.permute(1, 0, 2), torch.stack([c, s], 1)
        # a whole-batch metric: one unit
        return contrib.sum(1)[None], torch.stack([c.sum(), s.sum()])[None]

    # under torchrun: this rank's share of the pairs, every pair's rows gathered
    desc = progress if isinstance(progress, str) else "batches"
    num, den = resume.sharded_units(pairs, one, desc if progress else False)
    units = UnitValues(num, den[:, 0])
    return units.point().flatten(), float(den[:, 1].sum() / den[:, 0].sum().clamp(min=1)), units


def exact_patching(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    heads: Sequence[tuple[int, int]],
    *,
    direction: Direction = "noising",
    seed: int = 0,
) -> Float[Tensor, " n_heads_given"]:
    """Exact patching importance of the given heads only (``(layer, head)`` pairs or
    ``"L18H6"`` strings; the same corruption, sign and units as
    :func:`patching_importance`)."""
    from headmech.core.head_index import check_heads

    heads = check_heads(heads, int(model.cfg.n_layers), int(model.cfg.n_heads), "heads")
    pairs = patching_pairs(model, task, batches, direction, seed)
    delta, _, _ = _exact(model, task, pairs, None, None, False, heads)
    return (1.0 if direction == "noising" else -1.0) * delta


def patching_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    *,
    direction: Direction = "noising",
    approximate: bool = False,
    seed: int = 0,
    chunk: int | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float, UnitValues]:
    """Head importance from patching between the task's clean and corrupted inputs.

    ``noising`` (default): ``metric(clean run, head from corrupted) - metric(clean)``,
    directly comparable with ablation. ``denoising``: ``metric(corrupted) -
    metric(corrupted run, head from clean)``, the loss the head's clean output repairs.
    With ``approximate`` the patched metrics are attribution-patching estimates.

    Returns:
        ``(score [n_layers, n_heads], metric of the unpatched base run, per-unit values)``
        (the unit values are unsigned: each sequence's metric change).
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    pairs = patching_pairs(model, task, batches, direction, seed)
    if approximate:
        delta, base, units = _approximate(model, task, pairs, cost, progress)
    else:
        delta, base, units = _exact(model, task, pairs, chunk, cost, progress)
    sign = 1.0 if direction == "noising" else -1.0
    units = UnitValues(sign * units.num, units.den)
    return sign * delta.view(n_layers, n_heads), base, units
