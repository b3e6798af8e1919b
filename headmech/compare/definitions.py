"""The definitions of retrieval heads the agreement matrix compares (:data:`DEFINITIONS`).

Each is its paper's own score of every head, higher = more of the role, measured by
``measure(model, options, progress) -> (score [n_layers, n_heads], note)`` on the matrix's
options (:class:`headmech.compare.options.MatrixOptions`, read as :class:`ScoreOptions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from headmech.core.errors import InputError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge


__all__ = ["DEFINITIONS", "Definition", "ScoreOptions"]


# --- the definitions -------------------------------------------------------------------
class ScoreOptions(Protocol):
    """What a definition's score reads of the matrix's options
    (:class:`headmech.compare.options.MatrixOptions`)."""

    @property
    def n_questions(self) -> int: ...
    @property
    def cri_questions(self) -> int: ...
    @property
    def context(self) -> tuple[int, ...]: ...
    @property
    def locos_probe(self) -> str: ...
    @property
    def kv_context(self) -> int: ...
    @property
    def kv_window(self) -> int: ...
    @property
    def seed(self) -> int: ...


Scorer = Callable[["TransformerBridge", ScoreOptions, bool], tuple[Tensor, str]]


@dataclass(frozen=True)
class Definition:
    """One published definition of retrieval heads: its citation, its score in words, and
    ``measure(model, options, progress) -> (score [n_layers, n_heads], note)``."""

    name: str
    citation: str
    score: str
    measure: Scorer


def _wu(model: TransformerBridge, o: ScoreOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.classification.classify import classify

    cat = classify(
        model, ["retrieval"], n_boot=0, progress=progress, needle_lengths=o.context,
        n_sequences=o.n_questions, seed=o.seed,
    )  # fmt: skip
    return cat.types["retrieval"].score.float(), f"needle haystacks of {list(o.context)} tokens"


def _qrhead(model: TransformerBridge, o: ScoreOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.classification.definitions import qrhead_scores

    return qrhead_scores(model, o.n_questions, seed=o.seed).float(), f"{o.n_questions} questions"


def _documents(model: TransformerBridge, n: int, seed: int) -> list[Any]:
    from headmech.probes import ProbeOptions, build_probe

    return build_probe("documents", model, ProbeOptions(n_sequences=n, seed=seed)).batches


def _locos(model: TransformerBridge, o: ScoreOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.classification.definitions import locos_scores
    from headmech.probes import ProbeOptions, build_probe

    probe = ProbeOptions(n_sequences=o.n_questions, seed=o.seed)
    out = locos_scores(model, batches=build_probe(o.locos_probe, model, probe).batches)
    if not out["answered"]:
        raise InputError(
            f"LOCOS averages over the questions the model answers: it answers none of "
            f"{out['asked']} ({o.locos_probe} probe)"
        )
    note = f"{out['answered']} of {out['asked']} {o.locos_probe} questions answered"
    return out["score"].float(), note


def _cri(model: TransformerBridge, o: ScoreOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.headtypes.cri import cri_scores

    out = cri_scores(model, _documents(model, o.cri_questions, o.seed))
    note = (
        f"{o.cri_questions} questions, each head patched clean into the run with the gold "
        "document removed (the cri type's score)"
    )
    return out["cri"].float(), note


def _kv(model: TransformerBridge, o: ScoreOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.kv import hf_model, kv_importance, needle_batches, prose_batches
    from headmech.models import model_info

    needle = needle_batches(model, o.kv_context, seeds=(o.seed,))
    prose = prose_batches(model, o.kv_context, n=1, seed=o.seed)
    imp = kv_importance(hf_model(model), needle, prose, window=o.kv_window, progress=progress)
    info = model_info(model)
    group = info.n_heads // imp.score.shape[1]
    note = (
        f"each KV head's score given to its {group} query heads; {len(needle)} needle trials "
        f"and prose of {o.kv_context} tokens, window {o.kv_window}"
    )
    return imp.score.float().repeat_interleave(group, dim=1), note


DEFINITIONS: dict[str, Definition] = {
    d.name: d
    for d in (
        Definition(
            "wu", "Wu et al. 2024, Retrieval Head Mechanistically Explains Long-Context "
            "Factuality (arXiv 2404.15574)",
            "copy-paste score: how often the head attends to the needle token it copies",
            _wu,
        ),
        Definition(
            "qrhead", "Zhang et al. 2025, Query-Focused Retrieval Heads Improve Long-Context "
            "Reasoning and Re-ranking (arXiv 2506.09944)",
            "the question's attention to the gold document, minus a null ('N/A') question's, "
            "outlying token scores dropped (the authors' calibrated QRScore)",
            _qrhead,
        ),
        Definition(
            "locos", "LOCOS (arXiv 2607.01002)",
            "logit contribution toward the answer from the needle's keys, minus the rest's "
            "rescaled, on the answered questions",
            _locos,
        ),
        Definition(
            "cri", "causal retrieval importance (LOCOS's baseline, locos/detectors/cri.py)",
            "the answer's first-token logit lead over the removed run's favourite restored "
            "when the head's output is patched from the clean run into one without the needle",
            _cri,
        ),
        Definition(
            "kv", "Xiao et al. 2024, DuoAttention (the quantity its gates stand for)",
            "loss added when the head's KV cache alone is cut to its sinks and a window",
            _kv,
        ),
    )
}  # fmt: skip
"""The definitions of retrieval heads the matrix compares, by name."""
