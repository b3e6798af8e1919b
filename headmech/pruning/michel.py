"""Iterative head pruning by mask-gradient importance (Michel et al. 2019).

Each step scores the remaining heads by ``I_h = E_x |∂L/∂ξ_h|`` *under the current mask*
(recomputed every step unless ``recompute=False``), removes the lowest-scoring
``max(1, int(fraction * remaining))`` heads (the paper prunes 10% per step) and records
the task's metric with the new mask. The curve metric-vs-heads-kept and how many heads go
before the metric degrades by 5% are the paper's headline numbers.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS,
    section 4 (iterative pruning, 10% of heads per step, importance recomputed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.attribution.patching import z_gradients
from headmech.engine import ProbeBatch
from headmech.probes import ProbeOptions
from headmech.pruning.mask import HeadMask, head_mask_hooks
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classify import HeadCatalog

__all__ = ["PruningResult", "masked_metric", "masked_importance", "michel_prune"]


@dataclass
class PruningResult:
    """A pruning trajectory; ``save(dir)`` writes ``pruning.json`` (DESIGN.md) and a curve.

    Attributes:
        method, task: names.
        steps: ``{"n_kept", "heads_kept", "metric"}`` per step; step 0 is the full model.
        survival: head type → fraction of its labelled heads kept at each step.
        n_heads_total: heads in the model.
        metric: what ``metric`` measures (higher is worse).
        model: the model's short name.
    """

    method: str
    task: str
    steps: list[dict[str, Any]]
    survival: dict[str, list[float]] = field(default_factory=dict)
    n_heads_total: int = 0
    metric: str = ""
    model: str = ""

    def removable_fraction(self, tolerance: float = 0.05) -> float:
        """Fraction of heads removed at the last step before the metric first exceeds
        ``clean * (1 + tolerance)``.

        A metric that is 0 on the clean model (the encoder ``lm`` task's ``1 - cos``
        against the clean embedding; ``|clean| < 1e-4``) has no relative scale, so the
        bound is then ``tolerance`` itself (cosine to the clean embedding >= 0.95).
        """
        clean = float(self.steps[0]["metric"])
        bound = clean * (1.0 + tolerance) if abs(clean) >= 1e-4 else tolerance
        best = self.n_heads_total
        for s in self.steps:
            if float(s["metric"]) > bound:
                break
            best = int(s["n_kept"])
        return 1.0 - best / max(self.n_heads_total, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "task": self.task,
            "steps": [
                {
                    "n_kept": int(s["n_kept"]),
                    "heads_kept": [[int(a), int(b)] for a, b in s["heads_kept"]],
                    "metric": round(float(s["metric"]), 6),
                }
                for s in self.steps
            ],
            "survival": {k: [round(float(v), 6) for v in vs] for k, vs in self.survival.items()},
            "model": self.model,
            "metric_description": self.metric,
            "removable_at_5pct": round(self.removable_fraction(0.05), 6),
        }

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/pruning.json`` and ``out/pruning.png``; returns the JSON path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import seaborn as sns

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "pruning.json"
        path.write_text(json.dumps(self.to_dict(), indent=1))
        fig, ax = plt.subplots(figsize=(5, 3.5))
        kept = [int(s["n_kept"]) for s in self.steps]
        sns.lineplot(x=kept, y=[float(s["metric"]) for s in self.steps], marker="o", ax=ax)
        ax.invert_xaxis()
        ax.set_xlabel("heads kept")
        ax.set_ylabel(f"{self.task} metric (lower is better)")
        ax.set_title(f"{self.model} {self.method} pruning / {self.task}")
        fig.tight_layout()
        fig.savefig(out / "pruning.png", dpi=110)
        plt.close(fig)
        return path


def masked_metric(
    model: TransformerBridge,
    task: Task,
    batches: list[ProbeBatch],
    mask: HeadMask,
    references: list[Any],
) -> float:
    """The task's mean damage with ``mask`` applied."""
    s_tot, c_tot = 0.0, 0.0
    hooks = head_mask_hooks(mask)
    with torch.no_grad():
        for batch, ref in zip(batches, references, strict=True):
            s, c = task.damage(model, batch, hooks, reference=ref)
            s_tot += float(s.sum())
            c_tot += float(c.sum())
    return s_tot / max(c_tot, 1.0)


def masked_importance(
    model: TransformerBridge,
    task: Task,
    batches: list[ProbeBatch],
    mask: HeadMask,
    references: list[Any],
) -> Float[Tensor, "n_layers n_heads"]:
    """Michel et al.'s ``E|∂L/∂ξ_h|`` (absolute value per token) at ξ = ``mask``."""
    n_layers, n_heads = mask.shape
    dev = next(model.parameters()).device
    score = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    n_tokens = 0
    for batch, ref in zip(batches, references, strict=True):
        xi = mask.values.to(dev).clone().requires_grad_(True)
        z, grad, _, _ = z_gradients(model, task, batch, reference=ref, linear=True, head_mask=xi)
        per_tok = (z * grad).sum(-1)  # [n_layers, batch, pos, n_heads]
        real = batch.attention_mask.to(dev).bool()[None, :, :, None]
        score += (per_tok.abs() * real).sum((1, 2)).double().cpu()
        n_tokens += batch.n_tokens
    return (score / max(n_tokens, 1)).float()


def michel_prune(
    model: TransformerBridge,
    task: str | Task = "lm",
    *,
    fraction: float = 0.1,
    steps: int | None = None,
    recompute: bool = True,
    batches: list[ProbeBatch] | None = None,
    probe_options: ProbeOptions | None = None,
    catalog: HeadCatalog | None = None,
    progress: bool = False,
) -> PruningResult:
    """Prune heads iteratively by mask-gradient importance (Michel et al. 2019).

    Args:
        model: a ``TransformerBridge``.
        task: ``lm``, ``induction``, ``retrieval`` or a :class:`headmech.tasks.Task`.
        fraction: share of the *remaining* heads removed per step (at least one).
        steps: stop after this many pruning steps (default: until no head is left).
        recompute: rescore the heads under the current mask each step (the paper); else
            use the full model's scores throughout.
        batches: probe batches (default: the task's probe under ``probe_options``).
        probe_options: probe sizes.
        catalog: a :class:`headmech.classify.HeadCatalog`; fills ``survival`` per type.
        progress: print one line per step to stderr.

    Returns:
        A :class:`PruningResult`: step 0 is the unpruned model, then one entry per step.

    References:
        Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    t = get_task(task, model)
    if batches is None:
        batches = t.batches(model, probe_options or ProbeOptions())
    references = [t.reference(model, b) for b in batches]
    mask = HeadMask.for_model(model)
    n_total = mask.n_kept

    def record() -> dict[str, Any]:
        return {
            "n_kept": mask.n_kept,
            "heads_kept": mask.kept(),
            "metric": masked_metric(model, t, batches, mask, references),
        }

    history = [record()]
    fixed = None if recompute else masked_importance(model, t, batches, mask, references)
    step = 0
    while mask.n_kept > 0 and (steps is None or step < steps):
        score = (
            fixed if fixed is not None else masked_importance(model, t, batches, mask, references)
        )
        score = score.clone()
        score[mask.values == 0] = float("inf")
        k = max(1, int(fraction * mask.n_kept))
        idx = score.flatten().argsort()[:k]
        n_heads = mask.shape[1]
        mask = mask.remove([(int(i) // n_heads, int(i) % n_heads) for i in idx])
        history.append(record())
        step += 1
        if progress:
            import sys

            print(
                f"step {step}: {mask.n_kept} heads kept, metric {history[-1]['metric']:.4f}",
                file=sys.stderr,
            )

    from headmech.models import model_info
    from headmech.pruning.survival import survival as type_survival

    survival = type_survival([s["heads_kept"] for s in history], catalog) if catalog else {}

    return PruningResult(
        method="michel",
        task=t.name,
        steps=history,
        survival=survival,
        n_heads_total=n_total,
        metric=t.metric,
        model=model_info(model).name,
    )
