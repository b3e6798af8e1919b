"""S-inhibition heads: at the end of an IOI prompt, attend to the repeated subject and steer name movers away from it (Wang et al. 2022)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.name_mover import IOI_CIRCUIT
from headmech.headtypes.registry import HeadType
from headmech.probes.ioi import end_targets
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer, target_reducer


class SInhibitionHead(HeadType):
    """At the end of an IOI prompt, attend to the second mention of the subject (S2),
    below the name movers whose queries they inform.

    Probe: ``ioi`` (:mod:`headmech.probes.ioi`).

    Score: the attention mass from the prompt's last token to S2 (Wang et al.: S-inhibition
    heads attend to S2 and their output, read by the name movers' queries, makes them
    attend to the IO rather than S). A head is labelled when the mass reaches
    ``threshold``, exceeds its mass on the IO, and the head sits in a layer below every
    name-copying head (Wang et al.'s copy score >= 0.5, the name movers' OV signature;
    :func:`headmech.headtypes.name_mover.name_copying`): only there can its output reach
    the name movers' queries. A model without name-copying heads leaves the layer
    condition open.

    The paper identifies these heads by path patching into the name movers' queries. That
    edge is measured by :func:`headmech.circuits.path_patching.path_patch` (component ``"q"``,
    receivers: the labelled name movers; tutorial 09 does it on SmolLM2-135M); the score
    above is its attention signature, which a planted head in a random model can carry
    (the conformance checks) where a path to name movers cannot exist.

    Threshold: 0.3 S2 mass (none published; about 5x uniform attention over a 16-token
    prompt, as for name movers).

    Behavioural metric: the IOI logit difference (``ioi`` task), which ablating
    S-inhibition heads should lower (Wang et al.'s knockouts).

    References:
        Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, "Interpretability in the
        Wild: a Circuit for Indirect Object Identification in GPT-2 small",
        arXiv:2211.00593.
    """

    name = "s_inhibition"
    reference = "Wang et al. 2022"
    citation = (
        "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: "
        "a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593"
    )
    description = (
        "at the end of an IOI prompt, attends to the repeated subject, below the name movers"
    )
    probe = "ioi"
    default_threshold = 0.3
    threshold_note = "attention ≥ 0.3 from the last token to the second subject mention, above its attention to the IO, below the first name mover's layer; null: uniform attention over a 16-token prompt, about 0.06"
    causal_only = True
    task = "ioi"
    circuit = tuple(t for t in IOI_CIRCUIT if t != "s_inhibition")

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        return end_targets(batch, "s2_pos")

    def reducers(self) -> list[Reducer]:
        return [
            target_reducer(self.name, self.targets),
            target_reducer(f"{self.name}.io", lambda b: end_targets(b, "io_pos")),
        ]

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        from headmech.headtypes.name_mover import name_copying

        copy, _ = name_copying(model)
        copying = copy >= 0.5
        n_layers, n_heads = copy.shape
        first = int(copying.any(1).float().argmax()) if copying.any() else n_layers
        below = (torch.arange(n_layers) < first).float()[:, None].expand(n_layers, n_heads)
        return {"below_name_movers": below.clone()}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.mass")

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        io = stats.mean(f"{self.name}.io.mass")
        below = stats.mean(f"{self.name}.below_name_movers")
        out: dict[HeadIndex, str] = {}
        for a, b in (~(below > 0)).nonzero().tolist():
            out[HeadIndex(a, b)] = (
                "not in a layer below the first name mover (Wang et al.: S-inhibition heads "
                "feed the name movers' queries)"
            )
        for a, b in (~(score > io)).nonzero().tolist():
            h = HeadIndex(a, b)
            why = f"S2 mass {float(score[a, b]):.2f} <= IO mass {float(io[a, b]):.2f}"
            out[h] = f"{out[h]}; {why}" if h in out else why
        return out

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        attending = self.above(score)
        io = stats.mean(f"{self.name}.io.mass")
        below = stats.mean(f"{self.name}.below_name_movers")
        return {
            "s2_mass": {str(h): round(float(score[h]), 4) for h in attending},
            "io_mass": {str(h): round(float(io[h]), 4) for h in attending},
            "above_name_movers": [[h.layer, h.head] for h in attending if below[h] == 0],
        }
