"""Ablation importance: take a head out and measure how much the task gets worse.

The importance of a head (or a set of heads) is ``damage(ablated) - damage(clean)`` on
the task's probe. Four ways to take a head out, which can disagree:

* ``zero`` — its output ``hook_z`` is 0 (Michel et al. 2019's ξ_h = 0);
* ``mean`` — ``hook_z`` is its mean over the probe (keeps the average contribution);
* ``resample`` — ``hook_z`` is the head's output on *another* probe input at the same
  position (the next sequence of the batch; Chan et al. 2022's causal scrubbing
  resampling), which keeps the output on the data distribution;
* ``uniform`` — the head attends uniformly to every key it may see (Wu et al. 2024); only
  where the bridge honours ``hook_pattern`` edits (not BERT's).

Batching: a probe batch is stacked ``k`` times along the batch dimension and copy ``i``
carries ablation ``i`` (a hook indexes the copies), so one forward pass serves ``k``
ablations; ``n`` heads cost ``n + 1`` probe passes in ``ceil(n / k)`` forward calls.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
    Chan et al. 2022, "Causal Scrubbing" (Alignment Forum).
    Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.ablation import mean_head_outputs, pattern_edits_apply
from headmech.engine import ProbeBatch, run_blocks
from headmech.errors import HeadmechError
from headmech.heads import HeadIndex
from headmech.tasks import Task, is_causal

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "ABLATION_MODES",
    "Cost",
    "Edit",
    "ablate_sets",
    "ablation_importance",
    "capture_z",
    "edit_hooks",
    "task_damage",
]

Mode = Literal["zero", "mean", "resample", "uniform"]
ABLATION_MODES: tuple[str, ...] = ("zero", "mean", "resample", "uniform")


@dataclass
class Cost:
    """Compute spent, in sequence-forward passes (a backward pass counts as two)."""

    sequences: int = 0  # sequences in the probe (the unit of one "forward-pass equivalent")
    forward: int = 0  # sequences run forward
    backward: int = 0  # sequences run backward
    t0: float = field(default_factory=time.perf_counter)

    def add(self, n_seq: int, backward: bool = False) -> None:
        self.forward += n_seq
        if backward:
            self.backward += n_seq

    @property
    def forward_equivalents(self) -> float:
        return (self.forward + 2 * self.backward) / max(self.sequences, 1)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0


@dataclass(frozen=True)
class Edit:
    """One head's intervention in one copy: its ``hook_z`` at ``pos`` (all if None) becomes
    0 (``source is None``) or ``source`` (``[batch, pos, d_head]`` or ``[d_head]``); with
    ``uniform=True`` its attention pattern becomes uniform instead."""

    layer: int
    head: int
    source: Tensor | None = None
    pos: int | None = None
    uniform: bool = False


Hook = tuple[str, Callable[..., Tensor]]


def edit_hooks(
    model: TransformerBridge, copies: Sequence[Sequence[Edit]], batch_size: int
) -> list[Hook]:
    """Hooks applying ``copies[i]`` to copy ``i`` of a batch stacked ``len(copies)`` times."""
    k = len(copies)
    z_edits: dict[int, list[tuple[int, Edit]]] = {}
    p_edits: dict[int, list[tuple[int, Edit]]] = {}
    for i, edits in enumerate(copies):
        for e in edits:
            (p_edits if e.uniform else z_edits).setdefault(e.layer, []).append((i, e))
    if p_edits and not pattern_edits_apply(model):
        raise HeadmechError(
            "uniform-attention ablation is not possible on this model: its bridge ignores "
            "edits of hook_pattern; use zero, mean or resample ablation"
        )
    causal = is_causal(model)
    hooks: list[Hook] = []
    for layer, items in z_edits.items():

        def z_hook(z: Tensor, hook: Any, items: list[tuple[int, Edit]] = items) -> Tensor:
            # z: [copies * batch, pos, head_index, d_head]
            out = z.clone().view(k, batch_size, *z.shape[1:])  # [copies, batch, pos, head, d_head]
            for i, e in items:
                sl = slice(None) if e.pos is None else slice(e.pos, e.pos + 1)
                if e.source is None:
                    out[i, :, sl, e.head] = 0.0
                elif e.source.dim() == 1:  # [d_head]
                    out[i, :, sl, e.head] = e.source.to(z)
                else:  # [batch, pos, d_head]
                    out[i, :, sl, e.head] = e.source.to(z)[:, sl]
            return out.view_as(z)

        hooks.append((f"blocks.{layer}.attn.hook_z", z_hook))
    for layer, items in p_edits.items():

        def p_hook(pattern: Tensor, hook: Any, items: list[tuple[int, Edit]] = items) -> Tensor:
            # pattern: [copies * batch, head_index, query_pos, key_pos]
            n_q, n_k = pattern.shape[-2:]
            if causal:
                allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=pattern.device)
                allowed = allowed.tril(n_k - n_q)[None, None]
            else:
                allowed = (pattern > 0).any(1, keepdim=True)
            u = allowed.to(pattern.dtype)
            u = (u / u.sum(-1, keepdim=True).clamp(min=1)).expand_as(pattern)
            out = pattern.clone().view(k, batch_size, *pattern.shape[1:])
            u = u.reshape(k, batch_size, *pattern.shape[1:])  # [copies, batch, head, q, k]
            for i, e in items:
                out[i, :, e.head] = u[i, :, e.head]
            return out.view_as(pattern)

        hooks.append((f"blocks.{layer}.attn.hook_pattern", p_hook))
    return hooks


def capture_z(
    model: TransformerBridge, batch: ProbeBatch
) -> Float[Tensor, "n_layers batch pos n_heads d_head"]:
    """Every head's ``hook_z`` on one batch (no gradient)."""
    store: dict[int, Tensor] = {}

    def make(layer: int) -> Callable[..., None]:
        def grab(z: Tensor, hook: Any) -> None:
            store[layer] = z.detach()

        return grab

    n_layers = int(model.cfg.n_layers)
    dev = next(model.parameters()).device
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(f"blocks.{la}.attn.hook_z", make(la)) for la in range(n_layers)]),
    ):
        run_blocks(model, batch.input_ids.to(dev), batch.attention_mask.to(dev))
    return torch.stack([store[la] for la in range(n_layers)])


def task_damage(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    copies_for: Callable[[int, ProbeBatch], Sequence[Sequence[Edit]]],
    n_interventions: int,
    *,
    chunk: int = 8,
    cost: Cost | None = None,
    references: Sequence[Any] | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, " n"], float]:
    """Mean damage under each of ``n_interventions`` interventions, and the clean damage.

    ``copies_for(batch_index, batch)`` lists, per intervention, its edits on that batch
    (it may build batch-specific sources). Interventions run ``chunk`` at a time as copies
    of each batch; the clean run rides along as one more copy.
    """
    sums = torch.zeros(n_interventions + 1, dtype=torch.float64)
    counts = torch.zeros(n_interventions + 1, dtype=torch.float64)
    it: Iterable[int] = range(len(batches))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=progress if isinstance(progress, str) else "batches", leave=False)
    with torch.no_grad():
        for bi in it:
            batch = batches[bi]
            ref = references[bi] if references is not None else task.reference(model, batch)
            all_edits: list[Sequence[Edit]] = [(), *copies_for(bi, batch)]
            for start in range(0, len(all_edits), chunk):
                group = all_edits[start : start + chunk]
                hooks = edit_hooks(model, group, batch.input_ids.shape[0])
                s, c = task.damage(model, batch, hooks, copies=len(group), reference=ref)
                sums[start : start + len(group)] += s.double().cpu()
                counts[start : start + len(group)] += c.double().cpu()
                if cost is not None:
                    cost.add(len(group) * batch.input_ids.shape[0])
    mean = sums / counts.clamp(min=1)
    return mean[1:].float(), float(mean[0])


def _sources(
    model: TransformerBridge, batches: Sequence[ProbeBatch], mode: str, cost: Cost | None
) -> Callable[[int, ProbeBatch], Callable[[int, int], Tensor | None]]:
    """Per batch, a function (layer, head) -> the replacement of that head's output."""
    if mode == "zero" or mode == "uniform":
        return lambda bi, batch: lambda layer, head: None
    if mode == "mean":
        means = mean_head_outputs(model, batches)  # [n_layers, n_heads, d_head]
        if cost is not None:
            cost.add(sum(int(b.input_ids.shape[0]) for b in batches))
        return lambda bi, batch: lambda layer, head: means[layer, head]
    if mode == "resample":
        cache: dict[int, Tensor] = {}

        def for_batch(bi: int, batch: ProbeBatch) -> Callable[[int, int], Tensor]:
            if batch.input_ids.shape[0] < 2:
                raise HeadmechError(
                    "resample ablation needs at least 2 sequences per batch (another input's "
                    "head output); raise the batch size"
                )
            if bi not in cache:
                # another input of the same batch (same padded length): roll by one sequence
                cache.clear()
                z = capture_z(model, batch)  # [n_layers, batch, pos, n_heads, d_head]
                cache[bi] = z.roll(1, dims=1)
                if cost is not None:
                    cost.add(int(batch.input_ids.shape[0]))
            zb = cache[bi]
            return lambda layer, head: zb[layer, :, :, head]

        return for_batch
    raise HeadmechError(f"unknown ablation mode '{mode}' (have: {', '.join(ABLATION_MODES)})")


def ablate_sets(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    head_sets: Sequence[Iterable[HeadIndex | Sequence[int]]],
    mode: Mode = "zero",
    *,
    chunk: int = 8,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, " n_sets"], float]:
    """Damage with each set of heads ablated together, and the clean damage.

    Args:
        model: a ``TransformerBridge``.
        task: a :class:`headmech.tasks.Task`.
        batches: the task's probe batches.
        head_sets: sets of ``(layer, head)`` pairs; each is one intervention.
        mode: ``zero``, ``mean``, ``resample`` or ``uniform``.
        chunk: interventions per forward pass (copies of the batch).
        cost: accumulates the compute spent.
        progress: tqdm bar over batches.

    Returns:
        ``(damage per set, clean damage)``.
    """
    sets = [[(int(la), int(h)) for la, h in s] for s in head_sets]
    if mode == "uniform" and any(sets) and not pattern_edits_apply(model):
        raise HeadmechError(
            "uniform-attention ablation is not possible on this model: its bridge ignores "
            "edits of hook_pattern; use zero, mean or resample ablation"
        )
    source_for = _sources(model, batches, mode, cost)
    uniform = mode == "uniform"

    def copies_for(bi: int, batch: ProbeBatch) -> list[list[Edit]]:
        src = source_for(bi, batch)
        return [[Edit(la, h, src(la, h), uniform=uniform) for la, h in s] for s in sets]

    return task_damage(
        model, task, batches, copies_for, len(sets), chunk=chunk, cost=cost, progress=progress
    )


def ablation_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mode: Mode = "zero",
    *,
    chunk: int = 8,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float]:
    """Per-head ablation importance ``damage(head ablated) - damage(clean)``.

    Returns:
        ``(score [n_layers, n_heads], clean damage)``.

    Examples:
        >>> score, clean = ablation_importance(model, get_task("lm", model), batches)  # doctest: +SKIP
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    heads = [[(la, h)] for la in range(n_layers) for h in range(n_heads)]
    damage, clean = ablate_sets(
        model, task, batches, heads, mode, chunk=chunk, cost=cost, progress=progress
    )
    return (damage - clean).view(n_layers, n_heads), clean  # [n_layers * n_heads] -> grid
