"""Induction heads: attend to the token after an earlier copy of the current token, and copy it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headmech.engine import HeadStats, ProbeBatch
from headmech.heads import HeadIndex, HeadType


class InductionHead(HeadType):
    """Prefix matching plus copying (Olsson et al. 2022).

    Probe: BOS + n random tokens + the same n tokens again. In the repeated half, the
    query at position i should attend to i - n + 1, the token that followed the earlier
    copy of the current token (the "induction target"). The score is the mean attention
    mass on that target — Olsson et al.'s prefix-matching score, TransformerLens'
    ``induction_head`` pattern. A head is labelled when the prefix-matching score reaches
    ``threshold`` *and* its OV circuit copies: the copying score Σλ/Σ|λ| over the
    eigenvalues of ``W_E W_V W_O W_U`` (Elhage et al. 2021; norm weights folded in)
    reaches ``copying_threshold``.

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
    threshold_note = "prefix-matching mass ≥ 0.4 on the token after the earlier copy (no cut published; the TransformerLens detector's examples use similar bars), and an OV circuit that copies (copying score ≥ 0); null: uniform attention over the prefix, under 0.03 at 32 random tokens"
    causal_only = True
    task = "induction"  # loss on the repeated half of random-token sequences

    def __init__(
        self,
        threshold: float | None = None,
        copying_threshold: float = 0.0,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        # > 0: the OV circuit's eigenvalues are mostly positive (it copies rather than suppresses)
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
        from headmech.weights import ov_copying_scores

        return {"copying": ov_copying_scores(model)}

    def ideal_weight_statistics(self) -> dict[str, float]:
        return {"copying": 1.0}

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        copying = stats.mean(f"{self.name}.copying")
        return {
            HeadIndex(a, b): f"copying score {float(copying[a, b]):.3f} < "
            f"{self.copying_threshold:g} (Olsson et al.: an induction head copies the token "
            "it attends to)"
            for a, b in (~(copying >= self.copying_threshold)).nonzero().tolist()
        }

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        hit = stats.mean(f"{self.name}.hit")
        copying = stats.mean(f"{self.name}.copying")
        passed = self.above(score)
        return {
            "argmax_hit_rate": {str(h): round(float(hit[h]), 4) for h in heads},
            "copying_score": {str(h): round(float(copying[h]), 4) for h in passed},
            "copying_threshold": self.copying_threshold,
            "prefix_matching_only": [[h.layer, h.head] for h in passed if h not in heads],
        }
