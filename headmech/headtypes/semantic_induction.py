"""Semantic induction heads: attend to the head word of a relation and raise its tail's logit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.probes.relations import RELATIONS
from headmech.stream.engine import HeadStats, ProbeBatch


class SemanticInductionHead(HeadType):
    """Recall a relation's tail from its head word (Ren et al. 2024).

    Probe: ``prose`` with spaCy parses. A case is a dependency arc (nsubj, dobj, amod,
    advmod, det, pobj, poss, aux, mark) whose syntactic head word comes before its
    dependent, the *tail*, and is not the word just before it
    (:mod:`headmech.probes.relations`): at the token just before the tail, a semantic
    induction head attends to the head word (its last token) and its OV circuit, fed the
    head word, raises the tail's logit.

    Score: Ren et al.'s relation index, attention times logit gain: the mean attention
    mass from the query to the head word, times the mean standardised gain of the tail
    token in the head's OV output of the head word — ``(x W_V W_O W_U)[tail]`` minus its
    mean over the vocabulary, over its standard deviation over the vocabulary, with ``x``
    the head word's normalised residual at the layer's input (norm weights folded,
    Gemma's post-attention norm weight included; the mean and deviation come from the
    unembedding's column mean and covariance, exact without the full logits).

    Threshold: 0.5, e.g. half the attention on the head word with the tail one standard
    deviation above the vocabulary's mean logit (Ren et al. rank heads by the index and
    publish no cut).

    Behavioural metric: the ``relation_tail`` task, next-token loss of the tail token at
    the cases' queries, which zero-ablating the labelled heads should raise more than as
    many random heads.

    References:
        Ren, Guo, Yan, Liu, Qiu, Lin 2024, "Identifying Semantic Induction Heads to
        Understand In-Context Learning", Findings of ACL 2024, arXiv:2402.13055.
    """

    name = "semantic_induction"
    reference = "Ren et al. 2024"
    citation = (
        "Ren, Guo, Yan, Liu, Qiu, Lin 2024, Identifying Semantic Induction Heads to "
        "Understand In-Context Learning, Findings of ACL 2024, arXiv:2402.13055"
    )
    description = "attends to a relation's head word and raises its tail's logit"
    probe = "prose"
    default_threshold = 0.5
    threshold_note = "relation index ≥ 0.5: half the attention on the head word with the tail's logit one standard deviation above the vocabulary's mean (Ren et al. rank heads, no cut); null: 0"
    causal_only = True
    task = "relation_tail"
    claim = (
        "zero-ablating the labelled heads raises the loss of the relations' tail tokens "
        "more than as many random heads (Ren et al.: the heads raise the tail's logit)"
    )
    score_range = (-1.0, 1.0)

    def targets(self, batch: ProbeBatch) -> Tensor:
        from headmech.probes.relations import relation_cases

        c = relation_cases(batch, RELATIONS)
        out = torch.full_like(batch.input_ids, -1)
        out[c.seq.to(out.device), c.query.to(out.device)] = c.key.to(out.device)
        return out

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        return {"tail_gain": tail_gains(model, batches)}

    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        mass = stats.mean(f"{self.name}.mass").nan_to_num(0.0)
        return mass * stats.mean(f"{self.name}.tail_gain")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        mass = stats.mean(f"{self.name}.mass")
        gain = stats.mean(f"{self.name}.tail_gain")
        order = score.flatten().argsort(descending=True)[:10].tolist()
        top = [HeadIndex(i // score.shape[1], i % score.shape[1]) for i in order]
        n = f"{self.name}.mass"
        return {
            "relation_index": {str(h): round(float(score[h]), 4) for h in top},
            "head_word_mass": {str(h): round(float(mass[h]), 4) for h in top},
            "tail_gain": {str(h): round(float(gain[h]), 4) for h in top},
            "n_cases": int(stats.counts[n].max()) if n in stats else 0,
        }

    def check_model(self, info: Any) -> str | None:
        """Dependency parses need spaCy and its English pipeline (the ``syntactic`` extra)."""
        from headmech.probes.text import parser_problem

        return parser_problem(self.name) or super().check_model(info)


@torch.no_grad()
def tail_gains(model: Any, batches: Sequence[ProbeBatch]) -> Float[Tensor, "n_layers n_heads"]:
    """Per head, the mean standardised logit of each case's tail token in the head's OV
    output of the head word's normalised residual (class docstring)."""
    from headmech.interventions import capture
    from headmech.models.weights import head_weights
    from headmech.probes.relations import relation_cases

    w = head_weights(model)  # W_V reads the normalised residual; W_U has the final norm
    mu = w.W_U.mean(1)  # [d_model]
    centred = w.W_U - mu[:, None]
    cov = centred @ centred.T / w.W_U.shape[1]  # [d_model, d_model]
    n_layers, n_heads = w.W_V.shape[:2]
    # what W_V reads: the normalised residual, or the residual itself where no norm comes
    # before attention (OLMo 2 normalises the attention's output instead)
    hooks = model.hook_dict
    names = [
        f"blocks.{la}.ln1.hook_normalized"
        if f"blocks.{la}.ln1.hook_normalized" in hooks
        else f"blocks.{la}.hook_resid_pre"
        for la in range(n_layers)
    ]
    total = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    count = 0
    for b in batches:
        c = relation_cases(b, RELATIONS)
        if not len(c.seq):
            continue
        got = capture(model, b, names)
        cols = w.W_U[:, c.tail].T  # [n, d_model]
        for la in range(n_layers):
            x = got[names[la]].cpu()[c.seq, c.key]  # [n, d_model]
            out = torch.einsum("nd,hde,hef->nhf", x, w.W_V[la], w.W_O[la])  # [n, H, d_model]
            gain = (out * cols[:, None]).sum(-1) - out @ mu  # [n, H]
            sd = torch.einsum("nhd,de,nhe->nh", out, cov, out).clamp(min=1e-12).sqrt()
            total[la] += (gain / sd).double().sum(0)
        count += len(c.seq)
    return (total / max(count, 1)).float()
