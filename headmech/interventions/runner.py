"""The batched runner: many interventions on the same inputs in few forward passes.

Exact methods need many interventions on the same inputs (one per head, a control set,
...). :func:`run_variants` stacks ``k`` copies of a batch along the batch dimension and
the hooks apply variant ``i``'s interventions to copy ``i`` only, so one forward pass
serves ``k`` interventions; the clean run rides along as variant 0. The task
(:mod:`headmech.tasks`) turns each copy's output into its metric. :func:`evaluate` is the
one-variant case, :func:`gradients` one forward and backward pass with every head's
output tapped.

The cost floor: the clean run goes first and records what every block received; a chunk
of variants whose earliest intervened layer is ``l`` then runs only blocks ``l..`` from
that record (a head in layer ``l`` changes nothing below it), on the batch stacked once
per variant. Variants are grouped by that layer, so a chunk never pays for blocks it
cannot change, and the chunk size comes from a memory budget (on the CPU also from the
size of the largest activation: :data:`CPU_ACTIVATION_BYTES`). Token-loss tasks run the
last block's MLP and the unembedding only at the positions they score
(:func:`headmech.stream.forward.run_blocks` ``rows``, :func:`headmech.models.unembedding.token_losses`).
Where every variant edits the last position alone and the task reads only there (a
function vector patched into the query's last token), the blocks above the edit run at
that position alone, on the clean run's keys and values (:func:`_last_position_only`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from einops import rearrange
from torch import Tensor

from headmech.core import distributed
from headmech.core.errors import HeadmechError
from headmech.interventions.effects import Mean, Scale, Set, Tap, Zero
from headmech.interventions.intervention import Intervention, applied
from headmech.runs import resume
from headmech.stream.engine import ProbeBatch
from headmech.stream.forward import block_inputs, fast_attention, last_row_replay, starting_at

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import Task

__all__ = ["MEMORY_BUDGET", "Cost", "chunk_size", "evaluate", "gradients", "run_variants"]


@dataclass
class Cost:
    """Compute spent, in sequence-forward passes (a backward pass counts as two; a run of
    the last ``k`` of ``L`` blocks counts ``k / L``)."""

    sequences: int = 0  # sequences in the probe (the unit of one "forward-pass equivalent")
    forward: float = 0.0  # sequences run forward
    backward: float = 0.0  # sequences run backward
    t0: float = field(default_factory=time.perf_counter)

    def add(self, n_seq: float, backward: bool = False) -> None:
        """Count ``n_seq`` sequences run forward (and backward)."""
        self.forward += n_seq
        if backward:
            self.backward += n_seq

    @property
    def forward_equivalents(self) -> float:
        """Forward passes over the whole probe that the work equals."""
        return (self.forward + 2 * self.backward) / max(self.sequences, 1)


VariantsFor = Callable[[int, ProbeBatch], Sequence[Sequence[Intervention]]]

MEMORY_BUDGET = 1 << 30  # bytes of activations one stacked forward pass may hold (1 GiB)
MAX_CHUNK = 64
# On the CPU, also the size of the largest single activation of a stacked pass. glibc serves
# a large allocation from fresh pages (its mmap threshold is at most 32 MiB) and every first
# write to them faults: measured on smollm2-135m, 16 x 65-token copies, a block costs 36.5 ms
# per copy stacked 1-2 times, 40 ms at 3-4 and 44.6 ms at 8 (elementwise ops 40x slower per
# element); one copy (6.4 MB activations) ran 6% faster than two. Kept under a quarter of
# the threshold, freed activations are reused.
CPU_ACTIVATION_BYTES = 8 << 20


def chunk_size(
    model: TransformerBridge,
    batch: ProbeBatch,
    budget: int = MEMORY_BUDGET,
    *,
    last_row: bool = False,
) -> int:
    """Variants per forward pass that keep one stacked pass's activations within ``budget``
    (and, on the CPU, each single activation within :data:`CPU_ACTIVATION_BYTES`).

    Per copy of the batch, the largest live tensors of a block are eager attention's
    scores, masked scores and pattern (``3 x heads x pos²`` per sequence) and the MLP's
    hidden activations; the estimate counts those plus a few residual-width tensors.
    ``last_row``: the passes run the last position alone (one query row per sequence).
    """
    cfg = model.cfg
    n_seq, n_pos = (int(d) for d in batch.input_ids.shape)
    n_rows = 1 if last_row else n_pos
    d_mlp = int(getattr(cfg, "d_mlp", None) or 4 * int(cfg.d_model))
    per_token = 3 * int(cfg.n_heads) * n_pos + 3 * d_mlp + 8 * int(cfg.d_model)
    param = next(model.parameters())
    elem = max(param.element_size(), 4)
    per_copy = n_seq * n_rows * per_token * elem
    k = budget // max(per_copy, 1)
    if param.device.type == "cpu":
        largest = n_seq * n_rows * max(d_mlp, int(cfg.n_heads) * n_pos) * elem
        k = min(k, CPU_ACTIVATION_BYTES // max(largest, 1))
    return int(max(1, min(MAX_CHUNK, k)))


def _first_layer(variant: Sequence[Intervention]) -> int | None:
    """The earliest layer a variant touches (None: it touches nothing)."""
    layers = [h.layer for iv in variant for h in iv.heads]
    return min(layers) if layers else None


def _plan(firsts: Sequence[int | None], chunk: int) -> list[tuple[int, list[int]]]:
    """Variants that touch something, grouped by their first layer, each group cut into
    chunks of at most ``chunk`` of about equal size: ``(start layer, variant indices)``.

    A chunk never mixes first layers: a variant that starts at layer ``l`` in a chunk
    starting below ``l`` would pay for blocks that it cannot change.
    """
    by_layer: dict[int, list[int]] = {}
    for i, f in enumerate(firsts):
        if f is not None:
            by_layer.setdefault(f, []).append(i)
    out = []
    for layer, idx in sorted(by_layer.items()):
        n_chunks = -(-len(idx) // chunk)  # ceil
        size = -(-len(idx) // n_chunks)
        out += [(layer, idx[k : k + size]) for k in range(0, len(idx), size)]
    return out


def _last_position_only(batch: ProbeBatch, variants: Sequence[Sequence[Intervention]]) -> bool:
    """Whether every intervention edits a head's output, query, key or value at the last
    position alone with an effect that does not depend on the position, in a batch without
    padding (the blocks above can then run at the last position only)."""
    if not bool(batch.attention_mask.all()):
        return False

    def free(effect: Any) -> bool:
        if isinstance(effect, Set):  # heads first: [batch, heads, pos, ...], one position
            return effect.value.dim() < 3 or effect.value.shape[2] == 1
        return isinstance(effect, (Zero, Mean, Scale))

    ivs = [iv for v in variants for iv in v]
    return bool(ivs) and all(
        iv.pos == -1 and iv.site in ("z", "q", "k", "v") and free(iv.effect) for iv in ivs
    )


def _run_batch(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    ref: Any,
    variants: Sequence[Sequence[Intervention]],
    chunk: int,
    reuse_prefix: bool,
    fast: bool,
    cost: Cost | None,
) -> tuple[Tensor, Tensor]:
    """Metric sums and counts ``[1 + n_variants, units]`` for the clean run (row 0) and
    each variant."""
    n_layers, n_seq = int(model.cfg.n_layers), int(batch.input_ids.shape[0])
    firsts = [_first_layer(v) for v in variants]
    plan = _plan(firsts, chunk)
    starts = sorted({start for start, _ in plan if start > 0}) if reuse_prefix else []
    last = bool(starts) and fast and _last_position_only(batch, variants)
    with block_inputs(model, starts, kv=last) as record, fast_attention(model, fast):
        s0, c0 = task.metric(model, batch, reference=ref)  # the clean run, recorded
    # variants that touch nothing are the clean run: rows of s0
    sums = s0.double().cpu().repeat(len(variants) + 1, 1)
    counts = c0.double().cpu().repeat(len(variants) + 1, 1)
    if cost is not None:
        cost.add(n_seq)
    for start, idx in plan:
        first = start if reuse_prefix else 0
        chunk_variants = [variants[i] for i in idx]
        with (
            applied(model, chunk_variants),
            starting_at(record, first, last_row=last),
            fast_attention(model, fast),
        ):
            s, c = task.metric(model, batch, copies=len(idx), reference=ref)
        where = torch.tensor(idx) + 1
        sums[where], counts[where] = s.double().cpu(), c.double().cpu()
        if cost is not None:  # a last-position replay runs one of the batch's positions
            rows = (
                batch.input_ids.shape[1] if last and last_row_replay(record, first, n_layers) else 1
            )
            cost.add(len(idx) * n_seq * (n_layers - first) / n_layers / rows)
    return sums, counts


def _progress(
    items: Sequence[int], progress: bool | str, batches: Sequence[ProbeBatch]
) -> Iterable[int]:
    if not progress or not distributed.is_main():
        return items
    from headmech.core.progress import bar

    desc = progress if isinstance(progress, str) else "batches"
    return bar(items, desc, len(items), tokens=lambda i: int(batches[i].attention_mask.sum()))


def _gathered(parts: dict[int, tuple[Tensor, Tensor]], n_batches: int) -> tuple[Tensor, Tensor]:
    """This rank's per-batch ``(sums, counts)``, each ``[rows, units of the batch]``, as
    every batch's, concatenated along the units in batch order (on every rank)."""
    sums = distributed.gather_units({i: s for i, (s, _) in parts.items()}, n_batches)
    counts = distributed.gather_units({i: c for i, (_, c) in parts.items()}, n_batches)
    return sums, counts


def run_variants(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    variants: VariantsFor | Sequence[Sequence[Intervention]],
    *,
    chunk: int | None = None,
    reuse_prefix: bool = True,
    fast: bool = True,
    references: Sequence[Any] | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
    per_unit: bool = False,
) -> Any:
    """The task's mean metric under each variant, and under none (the clean run), chunks
    of variants stacked along the batch axis (the module docstring says how).

    Args:
        model: a ``TransformerBridge``.
        task: what is measured (:class:`headmech.tasks.Task`; higher is worse).
        batches: the probe batches.
        variants: a list of variants (each a list of interventions), or
            ``variants(batch_index, batch)`` building them per batch (for sources that
            depend on the batch, such as patching from a corrupted run).
        chunk: variants per forward pass (copies of the batch); default: as many as
            :func:`chunk_size` allows within :data:`MEMORY_BUDGET`.
        reuse_prefix: run only the blocks from each chunk's first intervened layer (off:
            every variant runs the whole model, for comparison).
        fast: when no intervention acts on the pattern, run attention as fused SDPA
            (:func:`headmech.stream.forward.fast_attention`; rotary-attention bridges only).
        references: per batch, the task's clean reference (default: computed).
        cost: accumulates the compute spent.
        progress: a tqdm bar over batches (a string names it).
        per_unit: also return the per-unit sums and counts.

    Returns:
        ``(metric per variant [n_variants], clean metric)``; with ``per_unit`` also
        ``sums`` and ``counts``, ``[1 + n_variants, n_units]`` (row 0: the clean run; units:
        the probe's sequences, or its batches for whole-batch metrics), for bootstrap
        intervals (:class:`headmech.stream.uncertainty.UnitValues`).
    """
    if not batches:
        raise HeadmechError("no batches to run")
    fixed = None if callable(variants) else list(variants)

    def one(bi: int) -> tuple[Tensor, Tensor]:
        batch = batches[bi]
        ref = references[bi] if references is not None else task.reference(model, batch)
        todo = fixed if fixed is not None else variants(bi, batch)  # type: ignore[operator]
        use_fast = fast and all(iv.site != "pattern" for v in todo for iv in v)
        last = reuse_prefix and use_fast and _last_position_only(batch, todo)  # one row a pass
        k = chunk or chunk_size(model, batch, last_row=last)
        return _run_batch(model, task, batch, ref, todo, k, reuse_prefix, use_fast, cost)

    with torch.no_grad(), resume.scope("variants"):  # a unit per batch: stored, or read back
        todo = _progress(distributed.mine(len(batches)), progress, batches)  # a rank's
        parts = {bi: resume.unit(f"batch{bi}", partial(one, bi)) for bi in todo}
    sums, counts = _gathered(parts, len(batches))
    mean = sums.sum(1) / counts.sum(1).clamp(min=1)
    return (mean[1:].float(), float(mean[0]), *((sums, counts) if per_unit else ()))


def evaluate(
    model: TransformerBridge,
    task: Task,
    batches: Iterable[ProbeBatch],
    interventions: Sequence[Intervention] = (),
    *,
    references: Sequence[Any] | None = None,
    per_unit: bool = False,
) -> Any:
    """The task's mean metric over the batches with ``interventions`` applied (references:
    the clean model's, computed per batch unless given); with ``per_unit`` also its
    per-unit sums and counts as :class:`~headmech.stream.uncertainty.UnitValues`."""
    from headmech.stream.uncertainty import UnitValues

    batches = list(batches)
    if not batches:
        raise HeadmechError("no batches to evaluate")
    parts: dict[int, tuple[Tensor, Tensor]] = {}
    with torch.no_grad():
        for i in distributed.mine(len(batches)):  # all batches, or this rank's share
            ref = references[i] if references is not None else task.reference(model, batches[i])
            with applied(model, list(interventions)):
                s, c = task.metric(model, batches[i], reference=ref)
            parts[i] = (s.double().cpu().reshape(1, -1), c.double().cpu().reshape(1, -1))
    sums, counts = _gathered(parts, len(batches))
    units = UnitValues(sums[0], counts[0])
    value = float(units.num.sum() / units.den.sum().clamp(min=1))
    return (value, units) if per_unit else value


def gradients(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    *,
    reference: Any = None,
    scale: Tensor | None = None,
    linear: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward and backward pass: every head's output and the metric's gradient.

    Args:
        model: a ``TransformerBridge``.
        task: the metric (its gradient form with ``linear``: see :mod:`headmech.tasks`).
        batch: one probe batch.
        reference: the task's clean reference for this batch.
        scale: optional leaf multiplying each head's output (Michel et al.'s ξ),
            ``[n_layers, n_heads]`` or per sequence ``[batch, n_layers, n_heads]``; its
            gradient is accumulated into ``scale.grad``.
        linear: use the task's gradient metric.

    Returns:
        ``(z, grad, metric_sums, counts)``: ``z`` (after ``scale``) and ``∂(metric sum)/∂z``,
        both ``[n_layers, batch, pos, n_heads, d_head]``; the metric's sums and counts per
        unit (``[units]``: sequences, or one for a whole-batch metric).
    """
    n_layers = int(model.cfg.n_layers)
    store: dict[int, tuple[Tensor, Tensor]] = {}
    ivs = [] if scale is None else [Intervention.all_heads(model, Scale(scale))]
    ivs.append(Intervention.all_heads(model, Tap(store)))
    with torch.enable_grad():
        with applied(model, ivs):
            s, c = task.metric(model, batch, reference=reference, linear=linear)
        leaves = [store[la][1] for la in range(n_layers)]
        if scale is not None:
            leaves.append(scale)
        grads = torch.autograd.grad(s.sum(), leaves, allow_unused=True)
    g = [torch.zeros_like(leaves[i]) if grads[i] is None else grads[i] for i in range(len(leaves))]
    # heads first [batch, head, pos, d] -> hook layout [batch, pos, head, d]
    z = torch.stack([rearrange(store[la][0], "b h p d -> b p h d") for la in range(n_layers)])
    grad = torch.stack([rearrange(gi, "b h p d -> b p h d") for gi in g[:n_layers]])
    if scale is not None:
        scale.grad = g[-1] if scale.grad is None else scale.grad + g[-1]
    return z, grad, s.detach()[0], c.detach()[0]
