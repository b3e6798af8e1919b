"""Negative name mover heads: attend to the indirect object and lower its logit (Wang et al. 2022)."""

from __future__ import annotations

from headmech.headtypes.name_mover import IOI_CIRCUIT, NameMoverHead


class NegativeNameMoverHead(NameMoverHead):
    """At the end of an IOI prompt, attend to the indirect object and write *against* it.

    The name mover's signature with the opposite sign: the attention mass from the last
    token to the IO name reaches ``threshold`` (and exceeds the mass on the subject),
    and the head's OV circuit suppresses names: Wang et al.'s copy score of the negated
    OV circuit (the share of names whose own logit is among the 5 *lowest* of the
    vocabulary, from the name's embedding after MLP 0) reaches ``copy_threshold``. Wang
    et al. found two such heads in GPT-2 small (10.7 and 11.10, negative copy scores
    above 0.98), later explained as copy suppression (McDougall et al. 2023; see
    :mod:`headmech.headtypes.copy_suppression`, whose score these heads also tend to pass).

    Threshold: as name movers (0.3 IO mass; negative copy score 0.5).

    Behavioural metric: as name movers, path patching to the logits on the IOI logit
    difference (``ioi`` task); these heads work against it, so patching their direct
    path should *raise* the logit difference — validation reports a negative effect.

    References:
        Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, "Interpretability in the
        Wild: a Circuit for Indirect Object Identification in GPT-2 small",
        arXiv:2211.00593; McDougall, Conmy, Rushing, McGrath, Nanda 2023, "Copy
        Suppression: Comprehensively Understanding an Attention Head", arXiv:2310.04625.
    """

    name = "negative_name_mover"
    circuit = tuple(t for t in IOI_CIRCUIT if t != "negative_name_mover")
    reference = "Wang et al. 2022"
    citation = (
        "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: "
        "a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593"
    )
    description = "at the end of an IOI prompt, attends to the indirect object and lowers its logit"
    copy_key = "negative_copy"
    threshold_note = "as name movers (IO mass ≥ 0.3, above the subject's) with a negative copy score ≥ 0.5; null: uniform attention, about 0.06"
    helps_task = False  # ablating them should raise the logit difference
    claim = (
        "Wang et al.: the heads' direct effect (path patching to the logits from ABC "
        "prompts) lowers the IOI logit difference, beyond random heads"
    )
