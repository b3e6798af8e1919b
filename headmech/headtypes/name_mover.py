"""Name mover heads: at the end of an IOI prompt, attend to the indirect object and copy it (Wang et al. 2022)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.probes.ioi import end_targets
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer, target_reducer

TOP_K = 5  # Wang et al.'s copy score: the name among the 5 highest logits

IOI_CIRCUIT = (
    "name_mover",
    "negative_name_mover",
    "s_inhibition",
    "duplicate_token",
    "induction",
    "previous_token",
)
"""Wang et al.'s IOI circuit (their Fig. 2): the roles its three end-of-prompt types share
one mechanism with; heads of each leave the others' control sets."""


def name_copying(model: Any) -> tuple[Tensor, Tensor]:
    """Wang et al.'s copy score and its negative, per head ``[n_layers, n_heads]``: the
    share of the probe's single-token names whose own logit is among the ``TOP_K``
    highest (copy) or lowest (negative copy) of the vocabulary when the name's effective
    embedding (after MLP 0) goes through the head's OV circuit."""
    from headmech.models.weights import own_token_ranks
    from headmech.probes.ioi import ioi_names

    above, below = own_token_ranks(model, torch.tensor(ioi_names(model.tokenizer)))
    return (above < TOP_K).float().mean(-1), (below < TOP_K).float().mean(-1)


class NameMoverHead(HeadType):
    """At the end of an IOI prompt, attend to the indirect object and write it to the logits.

    Probe: ``ioi`` (:mod:`headmech.probes.ioi`), Wang et al.'s templates with
    single-token names ("When Mary and John went to the store, John gave a drink to").

    Score: the attention mass from the prompt's last token to the IO name (Wang et al.'s
    characterisation of the heads they found by path patching to the logits). A head is
    labelled when the mass reaches ``threshold``, exceeds its mass on the subject (S1 and
    S2 together), and its OV circuit copies names: Wang et al.'s copy score (the share of
    names whose own logit is among the top 5 of the vocabulary after the head's OV
    circuit, from the name's embedding after MLP 0) reaches ``copy_threshold``. The sign
    of the copy score is what separates name movers from negative name movers
    (:mod:`headmech.headtypes.negative_name_mover`), which attend the same way.

    Threshold: 0.3 IO mass (none published; Wang et al.'s name movers put most of their
    attention on the IO; 0.3 is about 5x uniform attention over a 16-token prompt);
    copy score 0.5 (theirs are above 0.95: a majority of names, far above chance 5/vocab).

    Behavioural metric: Wang et al.'s path patching to the logits: the labelled heads'
    outputs on the ABC prompts (three other names) reach the logits, along the direct
    path only, and the IOI logit difference (the ``ioi`` task: logit(S) - logit(IO) at the
    last token, higher is worse) is measured against control sets patched the same way.
    The validation record also names the *backup* name movers: heads whose own direct
    effect on the logit difference rises when the labelled heads are knocked out.

    References:
        Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, "Interpretability in the
        Wild: a Circuit for Indirect Object Identification in GPT-2 small",
        arXiv:2211.00593 (code: redwoodresearch/Easy-Transformer).
    """

    name = "name_mover"
    reference = "Wang et al. 2022"
    citation = (
        "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: "
        "a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593"
    )
    description = "at the end of an IOI prompt, attends to the indirect object and copies it"
    probe = "ioi"
    default_threshold = 0.3
    threshold_note = "attention ≥ 0.3 from the last token to the indirect object, above its attention to the subject, with Wang et al.'s copy score ≥ 0.5; null: uniform attention over a 16-token prompt, about 0.06"
    causal_only = True
    task = "ioi"
    claims = ("direct_path",)
    circuit = tuple(t for t in IOI_CIRCUIT if t != "name_mover")
    claim = (
        "Wang et al.: the heads' direct effect on the IOI logit difference (path patching "
        "to the logits from ABC prompts) exceeds random heads'; backups compensate"
    )
    copy_key = "copy"  # which weight statistic must reach copy_threshold

    def __init__(
        self,
        threshold: float | None = None,
        copy_threshold: float = 0.5,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.copy_threshold = float(copy_threshold)

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        return end_targets(batch, "io_pos")

    def reducers(self) -> list[Reducer]:
        return [
            target_reducer(self.name, self.targets),
            target_reducer(f"{self.name}.s1", lambda b: end_targets(b, "s1_pos")),
            target_reducer(f"{self.name}.s2", lambda b: end_targets(b, "s2_pos")),
        ]

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        copy, negative = name_copying(model)
        return {"copy": copy, "negative_copy": negative}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.mass")

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        s = stats.mean(f"{self.name}.s1.mass") + stats.mean(f"{self.name}.s2.mass")
        copy = stats.mean(f"{self.name}.{self.copy_key}")
        what = "copy score" if self.copy_key == "copy" else "negative copy score"
        out: dict[HeadIndex, str] = {}
        for a, b in (~(copy >= self.copy_threshold)).nonzero().tolist():
            out[HeadIndex(a, b)] = (
                f"{what} {float(copy[a, b]):.3f} < {self.copy_threshold:g} (Wang et al.: the "
                f"head's OV circuit {'copies' if self.copy_key == 'copy' else 'suppresses'} "
                "the names it attends to)"
            )
        for a, b in (~(score > s)).nonzero().tolist():
            h = HeadIndex(a, b)
            why = f"IO mass {float(score[a, b]):.2f} <= subject mass {float(s[a, b]):.2f}"
            out[h] = f"{out[h]}; {why}" if h in out else f"{why} (it attends to S, not IO)"
        return out

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        attending = self.above(score)  # the mass threshold alone
        mean = {k: stats.mean(f"{self.name}.{k}") for k in ("s1.mass", "s2.mass", "copy")}
        neg = stats.mean(f"{self.name}.negative_copy")
        return {
            "io_mass": {str(h): round(float(score[h]), 4) for h in attending},
            "s1_mass": {str(h): round(float(mean["s1.mass"][h]), 4) for h in attending},
            "s2_mass": {str(h): round(float(mean["s2.mass"][h]), 4) for h in attending},
            "copy_score": {str(h): round(float(mean["copy"][h]), 4) for h in attending},
            "negative_copy_score": {str(h): round(float(neg[h]), 4) for h in attending},
            "copy_threshold": self.copy_threshold,
        }
