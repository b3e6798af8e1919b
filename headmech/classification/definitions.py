"""Competing definitions of one head role, side by side: which heads each picks.

Four published definitions compete for "the heads that retrieve from context" (Wu et al.
2024's copy-paste retrieval score, QRHead's query-to-document attention, LOCOS's logit
contribution, causal retrieval importance). Each paper compares against its own baselines
only. This module scores heads by the definitions that are not catalog types and compares
any two rankings by the overlap of their top-``k`` sets (Jaccard), the first column of the
agreement matrix.

* :func:`qrhead_scores`: QRHead (Zhang, Yin, Yen, Chen, Ye 2025, "Query-Focused Retrieval
  Heads Improve Long-Context Reasoning and Re-ranking", EMNLP 2025, arXiv 2506.09944; code
  princeton-pli/QRHead): a head's attention mass from the question's tokens to the gold
  document, averaged over the question's tokens and over the questions, on the
  ``documents`` probe (:mod:`headmech.probes.documents`). The paper keeps the top 16.
  As the authors' detection (``src/qrretriever/attn_retriever.py``,
  ``score_docs_per_head_for_detection``), the score is *calibrated*: each key's attention,
  averaged over the question's tokens, minus the same with the question replaced by
  "N/A" (:func:`null_query_batch`); on the gold document the calibrated token scores below
  their mean minus two standard deviations are dropped and the rest summed
  (``calibrated=False``: the plain mass, what the matrices published before 2026-11-30
  used).

* :func:`locos_scores`: LOCOS (arXiv 2607.01002; code aryopg/locos,
  ``locos/detectors/logit_contrib.py``): what the head writes toward the answer from the
  needle, ``φ_j = α_j · u_yᵀ W_O v_j`` summed over the needle's keys (``L+``) minus the
  same sum over every other key rescaled to the needle's length (``L-``), on the trials
  the model answers, averaged; here the needle is the gold document of the ``documents``
  probe and the answer step its city.

Beyond retrieval, :func:`headmech.attribution.logit.subject_relation_scores` splits each
head's direct logit attribution to a fact's answer by the tokens it reads (Chughtai et al.
2024's subject and relation heads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.core.head_index import top_k as top_k  # re-exported: the rankings compared
from headmech.interventions.sources import locos_scores as locos_scores  # re-exported
from headmech.interventions.sources import needle_span as needle_span  # re-exported
from headmech.probes.documents import NULL_QUERY as NULL_QUERY  # re-exported
from headmech.probes.documents import null_query_batch as null_query_batch  # re-exported
from headmech.probes.documents import query_to_gold as query_to_gold  # re-exported

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.core.stats import ProbeBatch

__all__ = [
    "QRHEAD_TOP_K",
    "jaccard",
    "locos_scores",
    "needle_span",
    "null_query_batch",
    "qrhead_scores",
    "query_to_gold",
    "top_k",
]

QRHEAD_TOP_K = 16
"""Heads QRHead keeps (its paper's default on Llama-3.1-8B)."""


def qrhead_scores(
    model: TransformerBridge,
    n_questions: int = 40,
    *,
    seed: int = 0,
    batches: list[ProbeBatch] | None = None,
    calibrated: bool = True,
) -> Tensor:
    """QRHead's score of every head, ``[n_layers, n_heads]``, over ``n_questions`` of the
    ``documents`` probe (or the given ``batches`` of it): the calibrated, outlier-trimmed
    attention of the question to its gold document (module docstring), averaged over the
    questions (the ``qrhead`` type's streamed reducer, each question beside its null twin
    in one pass: :func:`headmech.probes.documents.with_null_twins`); ``calibrated=False``:
    the plain mean attention mass from the question's tokens to the gold document."""
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream.engine import stream_statistics
    from headmech.stream.reducers import target_reducer

    if batches is None:
        options = ProbeOptions(n_sequences=n_questions, seed=seed)
        batches = build_probe("documents", model, options).batches
    if not calibrated:
        reducer = target_reducer("qrhead", query_to_gold, hits=False)
        return stream_statistics(model, batches, [reducer]).mean("qrhead.mass")
    from headmech.headtypes.qrhead import QRHead
    from headmech.probes.documents import with_null_twins

    twins = [with_null_twins(b, model.tokenizer) for b in batches]  # one pass of both
    return stream_statistics(model, twins, QRHead().reducers()).mean("qrhead.score")


def jaccard(a: list[HeadIndex] | set[HeadIndex], b: list[HeadIndex] | set[HeadIndex]) -> float:
    """``|a ∩ b| / |a ∪ b|`` of two head sets (1.0 for two empty sets)."""
    x, y = set(a), set(b)
    return len(x & y) / len(x | y) if x | y else 1.0
