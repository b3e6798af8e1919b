"""Relation heads: write a fact's answer from the relation's tokens (Chughtai et al. 2024)."""

from __future__ import annotations

from headmech.headtypes.subject import FactSourceHead


class RelationHead(FactSourceHead):
    """At a fact's last token, the head writes the answer from the relation's tokens.

    Probe: ``facts`` (:mod:`headmech.probes.facts`), as the ``subject`` type: "The Eiffel
    Tower is located in the city of" → " Paris"; the relation is "is located in the city
    of".

    Score: the relation's share of the head's direct logit attribution to the answer
    (Chughtai et al.'s split by source, :class:`headmech.headtypes.subject.SubjectHead`
    has the details), averaged over the facts the model completes. Chughtai et al. find
    relation heads distinct from subject heads: the answer is the sum of what each
    writes (an additive mechanism).

    Threshold: 0.25 nats from the relation alone (no published cut), with the sign test
    over facts and Benjamini-Hochberg across heads. Refused where DLA does not hold.

    Behaviour: the ``facts`` task, which mean-ablating the heads should raise.

    Args:
        threshold: the effect from the relation needed, in nats (default 0.25).
        alpha: the false discovery rate (default 0.05).

    References:
        Chughtai, Cooney, Nanda 2024, "Summing Up the Facts: Additive Mechanisms Behind
        Factual Recall in LLMs", arXiv:2402.07321 (relation heads).
    """

    name = "relation"
    group = "relation"
    reference = "Chughtai et al. 2024"
    citation = (
        "Chughtai, Cooney, Nanda 2024, Summing Up the Facts: Additive Mechanisms Behind "
        "Factual Recall in LLMs, arXiv:2402.07321"
    )
    description = "writes a fact's answer from the relation's tokens (direct logit attribution)"
    threshold_note = "direct logit attribution to the answer from the relation's tokens at the last position, over the facts the model completes, ≥ 0.25 nats (no published cut); null: 0, with a sign test over facts and Benjamini-Hochberg across heads"
    claim = (
        "mean-ablating the labelled heads raises the loss of a fact's answer more than as "
        "many random heads (Chughtai et al.: the answer is also written from the relation)"
    )
