"""Induction heads: attend to the token after an earlier copy of the current token, and copy it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch


class InductionHead(HeadType):
    """Prefix matching plus copying (Olsson et al. 2022).

    Probe: BOS + n random tokens + the same n tokens again. In the repeated half, the
    query at position i should attend to i - n + 1, the token that followed the earlier
    copy of the current token (the "induction target"). The score is the mean attention
    mass on that target — Olsson et al.'s prefix-matching score, TransformerLens'
    ``induction_head`` pattern. A head is labelled when the prefix-matching score reaches
    ``threshold`` *and* it copies, measured: ablated alone (on the probe's own sequences,
    every head at or above the threshold in the same batched passes), it raises the loss
    of predicting the token after the earlier copy — the lower end of the 95% bootstrap
    interval of its own effect exceeds ``copying_threshold`` (0 nats). Its effect counts
    whatever path it takes to the logits: a head whose output later heads read copies as
    surely as one that writes the logit itself.

    Olsson et al. test copying on the weights: the copying score Σλ/Σ|λ| over the
    eigenvalues of ``W_E W_V W_O W_U`` (Elhage et al. 2021; norm weights folded in). It
    is kept as evidence (``ov_copying_score``), not as a criterion: measured on Gemma 3
    and Qwen2.5 it rejects heads whose own effect on the task is among the largest
    (Qwen2.5's layer-16 heads: OV scores -0.37 to -0.68, own effects up to +0.09 nats; its
    L23H2: OV +0.83, own effect -0.04, a copy suppressor).

    Behavioural metric: next-token loss on the repeated half (every repeated token but
    the first), which induction heads make predictable.

    References:
        Olsson et al. 2022, "In-context Learning and Induction Heads", Transformer
        Circuits Thread; Elhage et al. 2021, "A Mathematical Framework for Transformer
        Circuits".
    """

    name = "induction"
    reference = "Olsson et al. 2022"
    citation = (
        "Olsson et al. 2022, In-context Learning and Induction Heads, Transformer Circuits Thread"
    )
    description = "attends to the token after an earlier copy of the current token and copies it"
    probe = "repeated_random"
    default_threshold = 0.4
    threshold_note = "prefix-matching mass ≥ 0.4 on the token after the earlier copy (no cut published; the TransformerLens detector's examples use similar bars), and it copies: ablated alone it raises the repeated half's loss (the 95% interval of its own effect above 0 nats); null: uniform attention over the prefix, under 0.03 at 32 random tokens"
    causal_only = True
    task = "induction"  # loss on the repeated half of random-token sequences
    circuit = ("previous_token",)  # Olsson et al.'s induction circuit: the two roles together

    def __init__(
        self,
        threshold: float | None = None,
        copying_threshold: float = 0.0,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        # nats: the lower end of the interval of the head's own effect must exceed it
        self.copying_threshold = float(copying_threshold)

    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        from headmech.probes.broad import after_earlier_copy

        return after_earlier_copy(batch)  # the token after an earlier copy of this one

    def targets(self, batch: ProbeBatch) -> Tensor:
        half, off = int(batch.extras["half_len"]), int(batch.extras["offset"])
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        tgt = pos - half + 1
        ok = (pos >= off + half) & (pos < off + 2 * half)
        return torch.where(ok, tgt, -1).expand_as(batch.input_ids).masked_fill(batch.special, -1)

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        from headmech.models.weights import ov_copying_scores

        return {"ov_copying": ov_copying_scores(model)}

    def candidate_statistics(
        self, model: Any, batches: Sequence[ProbeBatch], heads: Sequence[HeadIndex]
    ) -> dict[str, Tensor]:
        """Each head at or above the threshold ablated alone on the probe's sequences: its
        own effect on the loss of the repeated half, with its interval."""
        from headmech.interventions.ablation import own_effects
        from headmech.tasks import get_task

        own = own_effects(model, get_task(self.task, model), batches, heads, self.ablation)
        return {
            "own_effect": own["effect"],
            "own_effect_low": own["low"],
            "own_effect_high": own["high"],
        }

    def _copying(self, stats: HeadStats) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Own effect, its interval, and the value the criterion tests (the interval's
        lower end, or the effect where no interval was drawn)."""
        effect, low, high = (
            stats.mean(f"{self.name}.own_effect{k}") for k in ("", "_low", "_high")
        )
        return effect, low, high, torch.where(low.isnan(), effect, low)

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        effect, low, high, tested = self._copying(stats)
        out = {}
        for h in self.above(score):
            if not float(tested[h]) > self.copying_threshold:  # NaN (not measured): rejected
                out[h] = (
                    f"own effect {float(effect[h]):+.3f} nats [{float(low[h]):+.3f}, "
                    f"{float(high[h]):+.3f}], not above {self.copying_threshold:g}: copying not "
                    "measured (ablated alone, it does not raise the repeated half's loss; "
                    "Olsson et al.: an induction head copies the token it attends to)"
                )
        return out

    def own_effects(self, details: dict[str, Any]) -> dict[HeadIndex, tuple[float, list[float]]]:
        """Every head above the threshold ablated alone (``copying_effect``)."""
        return {
            HeadIndex.parse(h): (v[0], [v[1], v[2]])
            for h, v in details.get("copying_effect", {}).items()
            if v[1] == v[1]  # an interval was drawn (not NaN)
        }

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        hit = stats.mean(f"{self.name}.hit")
        effect, low, high, _ = self._copying(stats)
        ov = stats.mean(f"{self.name}.ov_copying")
        passed = self.above(score)
        return {
            "argmax_hit_rate": {str(h): round(float(hit[h]), 4) for h in heads},
            "copying_effect": {
                str(h): [round(float(v[h]), 4) for v in (effect, low, high)] for h in passed
            },
            "copying_threshold": self.copying_threshold,
            "ov_copying_score": {str(h): round(float(ov[h]), 4) for h in passed},
            "prefix_matching_only": [[h.layer, h.head] for h in passed if h not in heads],
        }
