"""Validation on each type's own claim: direct paths, K-composition, backups and the controls' space.

:mod:`headmech.classification.validation` ablates a type's labelled heads and random control sets
and measures the type's task; some types' papers test their claim another way, and a
type names its way in ``HeadType.claims`` (:mod:`headmech.classification.claim_types`):

* ``direct_path`` (name movers, negative name movers; Wang et al. 2022): the labelled
  heads' direct effect on the IOI logit difference, path patching to the logits (each
  head of the set writes its output on the corrupted ABC prompt, and only the logits read
  the change), against control sets patched the same way
  (:func:`direct_path_values`); for heads that serve the task, the *backup* heads too:
  heads whose own direct effect rises when the labelled heads are knocked out (their
  outputs patched from the ABC prompts; :func:`backup_heads`);
* ``k_composition`` (previous-token heads; Olsson et al. 2022): the ablation effect on
  the induction task, and the labelled heads' writes patched into the induction heads'
  keys (path patching, corrupted first halves) against the control sets' writes
  (:func:`k_composition`).

Controls: :func:`control_space` counts the heads a control set may draw from (the pool)
and the distinct sets there are; where there are fewer than the sets asked for, the
controls are *degenerate* (toy-induction's induction heads fill layer 1, so every control
set is layer 0's four heads) and :func:`verdict` does not judge the labels against them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from math import comb, prod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import LogitDiffTask

__all__ = [
    "backup_heads",
    "control_space",
    "direct_path_values",
    "k_composition",
]

BACKUP_SHARE = 0.1  # a backup's rise: at least this share of the labelled heads' direct effect
MAX_BACKUPS = 8


def control_space(
    heads: Sequence[Sequence[int]],
    n_layers: int,
    n_heads: int,
    kind: str,
    excluded: Sequence[Sequence[int]] = (),
) -> tuple[int, int]:
    """``(pool, n_possible)``: the heads control sets of ``kind`` draw from (every head
    but those ``excluded``: the other heads that may be of the type, and its circuit's;
    the labelled heads are in the pool, as a random relabelling may keep some of them;
    ``same_layers``: those of the labelled heads' layers; ``any_layer``: all), and how
    many distinct control sets of ``len(heads)`` heads there are, the labelled set itself
    not counted (per layer as many as labelled there, for ``same_layers``;
    ``layers_within_d``: any eligible heads of the layers within ``d`` of a labelled
    head's)."""
    labelled = {(int(a), int(b)) for a, b in heads}
    banned = {(int(a), int(b)) for a, b in excluded} - labelled
    per_layer: dict[int, int] = {}
    for la, _ in labelled:
        per_layer[la] = per_layer.get(la, 0) + 1
    if kind == "same_layers":
        free = {la: sum((la, h) not in banned for h in range(n_heads)) for la in per_layer}
        return sum(free.values()), prod(comb(free[la], k) for la, k in per_layer.items()) - 1
    if kind == "any_layer":
        pool = n_layers * n_heads - len(banned)
        return pool, comb(pool, len(labelled)) - 1
    if kind.startswith("layers_within_"):  # the labelled heads' layers and their neighbours
        near = near_layers(per_layer, n_layers, int(kind.rsplit("_", 1)[1]))
        pool = sum((la, h) not in banned for la in near for h in range(n_heads))
        return pool, comb(pool, len(labelled)) - 1
    return 0, 0


def near_layers(layers: Collection[int], n_layers: int, distance: int) -> list[int]:
    """The layers within ``distance`` of any of ``layers``."""
    return [la for la in range(n_layers) if any(abs(la - x) <= distance for x in layers)]


def n_distinct(control_sets: Sequence[Sequence[Sequence[int]]]) -> int:
    """How many different head sets ``control_sets`` holds (order within a set ignored)."""
    return len({frozenset((int(a), int(b)) for a, b in s) for s in control_sets})


# --- direct paths to the logits -----------------------------------------------------------


def _pairs(task: Any, model: TransformerBridge, batches: Sequence[ProbeBatch], seed: int) -> list:
    """Per batch, its corrupted counterpart (the seeds of path patching's noising pairs)."""
    return [task.corrupt(b, model, seed * 1_000_003 + bi) for bi, b in enumerate(batches)]


def direct_path_values(
    model: TransformerBridge,
    task: LogitDiffTask,
    batches: Sequence[ProbeBatch],
    sets: Sequence[Sequence[HeadIndex]],
    seed: int,
) -> tuple[Tensor, float, Tensor]:
    """Per head set, the task's metric with the set's heads patched to the logits from the
    corrupted prompts (:func:`headmech.interventions.direct_effects.direct_path_effects`); returns
    ``(metric per set [n_sets], clean metric, per-prompt effects [n_sets, n_prompts])``."""
    from headmech.interventions.direct_effects import direct_path_effects

    effects, cleans = [], []
    for batch, corrupt in zip(batches, _pairs(task, model, batches, seed), strict=True):
        contrast = task.contrast(batch)
        clean, eff = direct_path_effects(model, batch, corrupt, contrast, sets)
        cleans.append(clean.cpu())
        effects.append(eff.cpu())
    per = torch.cat(effects, 1)  # [n_sets, n_prompts]
    mean = float(torch.cat(cleans).mean())
    return mean + per.mean(1), mean, per


def backup_heads(
    model: TransformerBridge,
    task: LogitDiffTask,
    batches: Sequence[ProbeBatch],
    heads: Sequence[HeadIndex],
    seed: int,
) -> dict[str, Any]:
    """Heads whose direct effect on the logit difference rises when ``heads`` are knocked
    out (their outputs patched from the corrupted prompts, everything downstream
    recomputed): Wang et al.'s backup name movers. Kept: heads after the first labelled
    layer, not labelled, whose mean rise is at least :data:`BACKUP_SHARE` of the labelled
    heads' summed clean direct effect, best first (at most :data:`MAX_BACKUPS`)."""
    from headmech.interventions import Intervention, Patch, capture_z
    from headmech.interventions.direct_effects import head_direct_effects

    clean, knocked = [], []
    for batch, corrupt in zip(batches, _pairs(task, model, batches, seed), strict=True):
        contrast = task.contrast(batch)
        out = Intervention.on(heads, Patch(capture_z(model, corrupt)))
        clean.append(head_direct_effects(model, batch, contrast))
        knocked.append(head_direct_effects(model, batch, contrast, [out]))
    before, after = torch.cat(clean).mean(0), torch.cat(knocked).mean(0)  # [n_layers, n_heads]
    own = float(sum(before[h.layer, h.head] for h in heads))
    floor = BACKUP_SHARE * abs(own)
    first = min(h.layer for h in heads)
    rise = after - before
    rows = [
        {"head": [la, h], "clean": round(float(before[la, h]), 6),
         "knocked_out": round(float(after[la, h]), 6), "rise": round(float(rise[la, h]), 6)}
        for la in range(first + 1, rise.shape[0]) for h in range(rise.shape[1])
        if HeadIndex(la, h) not in heads and float(rise[la, h]) >= floor and rise[la, h] > 0
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["rise"])
    return {
        "labelled_direct_effect": round(own, 6),
        "rise_floor": round(floor, 6),
        "heads": rows[:MAX_BACKUPS],
        "method": "per-head direct effect on logit(IO) - logit(S) (the head's write removed "
        "from the final residual), clean vs labelled heads patched from the ABC prompts",
    }


# --- K-composition into the induction heads ----------------------------------------------


def _deltas(
    model: TransformerBridge,
    base: ProbeBatch,
    source: ProbeBatch,
    sets: Sequence[Sequence[HeadIndex]],
) -> list[dict[int, Tensor]]:
    """Per set, per sender layer, the set's heads' summed write change source - base there
    ``[batch, pos, d_model]`` (through the post-attention norm where there is one)."""
    from headmech.interventions.direct_effects import all_z, layer_write

    z, attn = all_z(model, base)
    z_src, _ = all_z(model, source)
    out = []
    for heads in sets:
        per: dict[int, Tensor] = {}
        for la in sorted({h.layer for h in heads}):
            idx = torch.tensor(sorted({h.head for h in heads if h.layer == la}))
            dz = torch.zeros_like(z[la])
            dz[..., idx, :] = z_src[la][..., idx, :] - z[la][..., idx, :]
            per[la] = layer_write(model, la, dz, attn[la])
        out.append(per)
    return out


def k_composition(
    model: TransformerBridge,
    sets: Sequence[Sequence[HeadIndex]],
    receivers: Sequence[HeadIndex],
    batches: Sequence[ProbeBatch],
    task: Any,
    seed: int,
) -> tuple[list[float], list[float] | None]:
    """Per sender set, the induction task's metric change (noising) when the receivers'
    keys read the set's writes from the corrupted run (first halves replaced: no repeat),
    along the direct path only; each receiver sees the senders of earlier layers. Also
    the first set's 95% bootstrap interval over sequences (None with fewer than 2)."""
    from headmech.interventions import Intervention, PathPatch, run_variants
    from headmech.stream.uncertainty import UnitValues

    n_heads = int(model.cfg.n_heads)
    group = n_heads // int(getattr(model.cfg, "n_key_value_heads", None) or n_heads)
    by_layer: dict[int, set[int]] = {}
    for r in receivers:
        by_layer.setdefault(r.layer, set()).add(r.head // group)  # the KV head of the key
    corrupt = _pairs(task, model, batches, seed)

    def variants(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        out = []
        for per in _deltas(model, batch, corrupt[bi], sets):
            ivs = []
            for la, kv in sorted(by_layer.items()):
                ds = [d for sl, d in per.items() if sl < la]
                if ds:
                    delta = torch.stack(ds).sum(0)
                    ivs.append(Intervention.on([(la, k) for k in sorted(kv)], PathPatch(model, delta, "k"), "k"))  # fmt: skip
            out.append(ivs)
        return out

    values, clean, sums, counts = run_variants(model, task, list(batches), variants, per_unit=True)
    paired = UnitValues(sums[1] - sums[0], counts[0]).interval(seed=seed)
    interval = None if paired is None else [float(paired[0]), float(paired[1])]
    return [float(v) - clean for v in values], interval
