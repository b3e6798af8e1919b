"""The agreement matrix of retrieval-head definitions on one model (:func:`agreement_matrix`).

Each definition (:data:`DEFINITIONS`) is its paper's own score of every head, higher = more
of the role; the matrix keeps each ranking's top ``k`` (QRHead's own k is 16) and compares
the sets two by two (Jaccard) and by what removing each does to each recall task
(:data:`RECALL_TASKS`), against control sets of as many heads from the same layers that
are not in the definition's top ``2k`` (the heads that may be of the role by that
definition stay out of its controls). Every ablation is a claim of the sequential Monte
Carlo test (p = (1 + exceedances) / (1 + n)); Benjamini-Hochberg's q is taken over every
definition and task of the matrix, and a set is ``validated`` on a task where q <= 0.05
and the effect's interval is above 0 (:meth:`ClaimRecord.decide`).

The definitions' costs differ by orders of magnitude: QRHead and LOCOS read one forward
pass per question; Wu et al.'s score classifies the needle probe; CRI patches every head
into a corrupted run per question (``cri_questions``, fewer than the others); the KV
ranking runs the model once per KV head with that head's cache windowed. Each score and
each ablation test is kept as it finishes when a :class:`~headmech.runs.resume.Units`
store is given, so a stopped run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError, UnsupportedModelError
from headmech.core.head_index import HeadIndex, top_k
from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.core.options import ProbeOptions
    from headmech.runs.resume import Units

__all__ = [
    "DEFINITIONS",
    "MATRIX_FILE",
    "RECALL_TASKS",
    "AgreementMatrix",
    "Definition",
    "MatrixOptions",
    "agreement_matrix",
]

RECALL_TASKS = {
    "documents": "multi-document recall: the gold document's city after five documents "
    "(QRHead's setting)",
    "retrieval": "literal needle recall: the needle's answer in a haystack (Wu et al.'s setting)",
    "nonliteral": "non-literal needle recall: a hidden name asked without the needle's words "
    "(NoLiMa's design, LOCOS's task)",
    "literal": "literal needle recall: the same needles asked with their own words",
    "facts": "parametric recall: a fact's answer with no context (the control a retrieval "
    "head should not move)",
}
"""The tasks every set is ablated on (:mod:`headmech.tasks.data`): two that need the
context, one that does not."""

MATRIX_FILE = FileSchema(
    "agreement matrix", "definitions.json", SCHEMA_VERSION,
    required=("definitions", "jaccard", "effects"),
)  # fmt: skip


@dataclass(frozen=True)
class MatrixOptions:
    """What the matrix is measured on.

    Attributes:
        definitions: the definitions compared (names of :data:`DEFINITIONS`).
        tasks: the recall tasks each set is ablated on (names of :data:`RECALL_TASKS`;
            the needle tasks ``nonliteral`` and ``literal`` on request: at 135M-0.5B the
            models answer no non-literal needle).
        k: heads in each definition's set (QRHead keeps 16).
        n_questions: questions of the ``documents`` probe the scores and the ablations are
            measured on (also the number of facts and of needle trials' sequences).
        cri_questions: questions CRI patches every head on (a patched pass per head each).
        locos_probe: what LOCOS is scored on: the ``documents`` probe's gold document, or
            the needle sentence of ``nonliteral`` (LOCOS's own setting) or ``literal``
            needles, on the trials the model answers.
        context: the needle haystacks' lengths (Wu et al.'s score and the ``retrieval`` task).
        kv_context, kv_window: the KV ranking's trials and the window a KV head is cut to.
        n_random: control sets per claim at most (the sequential test stops earlier).
        control_tokens: each test measured on every k-th piece of the task's batches that
            still holds this many tokens (0: on every batch; ``TestOptions.test_batches``).
        mode: the ablation (``mean``: LOCOS's; ``zero``).
        seed: seeds the probes and the control sets.
    """

    definitions: tuple[str, ...] = ("wu", "qrhead", "locos", "cri", "kv")
    tasks: tuple[str, ...] = ("documents", "retrieval", "facts")
    k: int = 16
    n_questions: int = 40
    cri_questions: int = 10
    locos_probe: str = "documents"
    context: tuple[int, ...] = (300,)
    kv_context: int = 512
    kv_window: int = 64
    n_random: int = 99
    control_tokens: int = 0
    mode: str = "mean"
    seed: int = 0

    def __post_init__(self) -> None:
        if unknown := [d for d in self.definitions if d not in DEFINITIONS]:
            raise InputError(
                f"unknown definition {', '.join(unknown)}; known: {', '.join(DEFINITIONS)}"
            )
        if unknown := [t for t in self.tasks if t not in RECALL_TASKS]:
            raise InputError(f"unknown task {', '.join(unknown)}; known: {', '.join(RECALL_TASKS)}")
        if len(self.definitions) < 2 and not self.tasks:
            raise InputError("nothing to compare: give two definitions or a task")
        for name in ("k", "n_questions", "cri_questions", "kv_context", "kv_window", "n_random"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.locos_probe not in ("documents", "nonliteral", "literal"):
            raise InputError(
                f"unknown LOCOS probe {self.locos_probe!r}; known: documents, nonliteral, literal"
            )
        if self.control_tokens < 0:
            raise InputError(f"control_tokens must be 0 or more, got {self.control_tokens}")
        if self.mode not in ("mean", "zero"):
            raise InputError(f"unknown ablation {self.mode!r}; known: mean, zero")

    def probe_options(self) -> ProbeOptions:
        """The probes' sizes: ``n_questions`` questions, facts and needle sequences."""
        from headmech.core.options import ProbeOptions

        return ProbeOptions(
            n_sequences=self.n_questions, needle_lengths=self.context, seed=self.seed
        )

    def to_json(self) -> dict[str, Any]:
        """The options as JSON (tuples as lists): definitions.json's and the resume manifest's."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MatrixOptions:
        """The options back from :meth:`to_json` (keys it does not know left out)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kept: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields
        }
        return cls(**kept)


# --- the definitions -------------------------------------------------------------------
Scorer = Callable[["TransformerBridge", MatrixOptions, bool], tuple[Tensor, str]]


@dataclass(frozen=True)
class Definition:
    """One published definition of retrieval heads: its citation, its score in words, and
    ``measure(model, options, progress) -> (score [n_layers, n_heads], note)``."""

    name: str
    citation: str
    score: str
    measure: Scorer


def _wu(model: TransformerBridge, o: MatrixOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.classification.classify import classify

    cat = classify(
        model, ["retrieval"], n_boot=0, progress=progress, needle_lengths=o.context,
        n_sequences=o.n_questions, seed=o.seed,
    )  # fmt: skip
    return cat.types["retrieval"].score.float(), f"needle haystacks of {list(o.context)} tokens"


def _qrhead(model: TransformerBridge, o: MatrixOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.classification.definitions import qrhead_scores

    return qrhead_scores(model, o.n_questions, seed=o.seed).float(), f"{o.n_questions} questions"


def _documents(model: TransformerBridge, n: int, seed: int) -> list[Any]:
    from headmech.probes import ProbeOptions, build_probe

    return build_probe("documents", model, ProbeOptions(n_sequences=n, seed=seed)).batches


def _locos(model: TransformerBridge, o: MatrixOptions, progress: bool) -> tuple[Tensor, str]:
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


def _cri(model: TransformerBridge, o: MatrixOptions, progress: bool) -> tuple[Tensor, str]:
    from headmech.headtypes.cri import cri_scores

    out = cri_scores(model, _documents(model, o.cri_questions, o.seed))
    note = (
        f"{o.cri_questions} questions, each head patched clean into the run with the gold "
        "document removed (the cri type's score)"
    )
    return out["cri"].float(), note


def _kv(model: TransformerBridge, o: MatrixOptions, progress: bool) -> tuple[Tensor, str]:
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


# --- the result ------------------------------------------------------------------------
@dataclass(eq=False)
class AgreementMatrix(ResultFile):
    """Definitions of one role compared on one model.

    Attributes:
        model: the model's short name; ``n_layers`` its depth (relative depths).
        options: what it was measured on.
        scores: definition -> its score of every head, ``[n_layers, n_heads]``.
        notes: definition -> what its score was measured on.
        seconds: definition -> wall time of its score (not written to JSON).
        effects: definition -> task -> the ablation claim
            (:class:`~headmech.classification.records.ClaimRecord` as JSON: effect,
            interval, controls, test with p, q and n, verdict); ``clean``: task -> the
            unablated metric.
    """

    model: str
    n_layers: int
    options: MatrixOptions
    scores: dict[str, Tensor]
    notes: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    effects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    SCHEMA = MATRIX_FILE

    def top(self, name: str) -> list[HeadIndex]:
        """Definition ``name``'s ``k`` highest-scoring heads, best first."""
        return top_k(self.scores[name], self.options.k)

    def depth(self, name: str) -> float:
        """The mean relative depth of ``name``'s set (0 the first layer, 1 the last)."""
        heads = self.top(name)
        return sum(h.layer for h in heads) / len(heads) / max(self.n_layers - 1, 1)

    def kv_ranking(self, name: str, group: int) -> list[tuple[int, int]]:
        """Definition ``name``'s ranking of the KV heads (``(layer, kv_head)``, best first)
        for a KV plan (:meth:`headmech.kv.KVPlan.from_ranking`): each KV head by the highest
        score among its ``group`` query heads (a head it cannot score, NaN, last)."""
        score = self.scores[name]
        n_layers, n_heads = score.shape
        if group < 1 or n_heads % group:
            raise InputError(f"{n_heads} query heads do not split into KV groups of {group}")
        kv = torch.nan_to_num(score.float(), nan=float("-inf"))
        best = kv.reshape(n_layers, n_heads // group, group).amax(-1)
        return [(h.layer, h.head) for h in top_k(best, best.numel())]

    def jaccard(self) -> dict[str, dict[str, float]]:
        """``|a ∩ b| / |a ∪ b|`` of every two definitions' sets."""
        from headmech.classification.definitions import jaccard

        sets = {d: self.top(d) for d in self.scores}
        return {a: {b: jaccard(sets[a], sets[b]) for b in sets} for a in sets}

    def _body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "n_layers": self.n_layers,
            "options": self.options.to_json(),
            "definitions": {
                d: {
                    "citation": DEFINITIONS[d].citation,
                    "score_is": DEFINITIONS[d].score,
                    "note": self.notes.get(d, ""),
                    "top": [str(h) for h in self.top(d)],
                    "depth": self.depth(d),
                    "score": _rows(s),
                }
                for d, s in self.scores.items()
            },
            "jaccard": self.jaccard(),
            "effects": self.effects,
        }

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> AgreementMatrix:
        options = MatrixOptions.from_json(d["options"])
        defs = d["definitions"]  # JSON's keys sorted: back in the order compared
        order = [n for n in options.definitions if n in defs]
        scores = {n: _grid(defs[n]["score"]) for n in order}
        notes = {n: defs[n]["note"] for n in order}
        effects = {
            n: {t: d["effects"][n][t] for t in options.tasks if t in d["effects"][n]}
            for n in order
            if n in d["effects"]
        }
        return cls(
            d["model"], int(d["n_layers"]), options, scores, notes, {}, effects,
            d.get("provenance", {}),
        )  # fmt: skip

    def _figures(self, folder: Path) -> None:
        import matplotlib.pyplot as plt
        import seaborn as sns

        from headmech.core.plot import finish

        names, jac = list(self.scores), self.jaccard()
        grid = [[jac[a][b] for b in names] for a in names]
        fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(names), 1.2 + 0.8 * len(names)))
        sns.heatmap(
            grid, annot=True, fmt=".2f", vmin=0, vmax=1, cmap="viridis", square=True,
            xticklabels=names, yticklabels=names, ax=ax, cbar_kws={"label": "Jaccard"},
        )  # fmt: skip
        ax.set_title(f"{self.model}: top {self.options.k} heads of each definition")
        finish(fig, folder / "definitions.png")

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/definitions.json`` and ``out/definitions.png`` (the Jaccard
        heatmap); ``out`` ending in ``.json``: that file alone."""
        return super().save(out)

    def table(self) -> str:
        """The matrix as text: each definition's set, depth and Jaccard with the others,
        then each set's effect per task against its controls, with p, q and n."""
        names = list(self.scores)
        jac = self.jaccard()
        lines = [f"{self.model}: top {self.options.k} heads of each definition"]
        width = max(len(n) for n in names)
        lines.append(" " * (width + 2) + "  ".join(f"{n:>7}" for n in names) + "   depth  set")
        for a in names:
            row = "  ".join(f"{jac[a][b]:7.2f}" for b in names)
            top = " ".join(str(h) for h in self.top(a)[:8])
            lines.append(f"{a:<{width}}  {row}   {self.depth(a):5.2f}  {top} ...")
        for a, tasks in self.effects.items():
            for t, c in tasks.items():
                test = c.get("test") or {}
                lines.append(
                    f"{a} on {t}: {_signed(c.get('effect'))} (controls' median "
                    f"{_signed(c.get('random_median'))}), p {_num(test.get('p'))}, "
                    f"q {_num(test.get('q'))}, n {test.get('n', 0)}: {c.get('verdict')}"
                )
        return "\n".join(lines)


def _rows(score: Tensor) -> list[list[float | None]]:
    """A score grid as JSON rows (a head a definition cannot score, NaN: null)."""
    return [[None if v != v else v for v in row] for row in score.tolist()]


def _grid(rows: list[list[float | None]]) -> Tensor:
    return torch.tensor([[float("nan") if v is None else v for v in row] for row in rows])


def _signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.3f}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


# --- the measurement -------------------------------------------------------------------
def _check(model: TransformerBridge, options: MatrixOptions) -> None:
    """The cheap refusals, before any score is measured: an encoder, more heads asked for
    than the model has, a probe the model cannot be given."""
    from headmech.models import model_info
    from headmech.probes import build_probe

    info = model_info(model)
    if not info.causal:
        raise UnsupportedModelError(
            "the retrieval definitions read a decoder's answer; this model is an encoder"
        )
    if 2 * options.k > info.n_layers * info.n_heads:
        raise InputError(
            f"k={options.k}: the sets and the heads kept from their controls (2k) need more "
            f"than the model's {info.n_layers * info.n_heads} heads"
        )
    probe = options.probe_options()
    for name in {"documents", *(t if t != "retrieval" else "needle" for t in options.tasks)}:
        build_probe(name, model, probe)


def agreement_matrix(
    model: TransformerBridge,
    options: MatrixOptions | None = None,
    *,
    progress: bool = True,
    units: Units | None = None,
) -> AgreementMatrix:
    """Score every head by each definition, keep each top ``k``, and ablate each set on each
    recall task against control sets (module docstring).

    Raises:
        UnsupportedModelError: an encoder.
        InputError: options the model cannot be measured at (checked before any score),
            or a definition that cannot be measured on it (LOCOS where the model answers
            no question).
    """
    from headmech.classification.montecarlo import TestOptions
    from headmech.classification.records import TypeValidation
    from headmech.classification.validation import apply_fdr, validate_heads
    from headmech.headtypes.registry import get_head_type
    from headmech.models import model_info
    from headmech.runs.provenance import provenance

    options = options or MatrixOptions()
    _check(model, options)
    info = model_info(model)
    scores: dict[str, Tensor] = {}
    notes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name in options.definitions:
        done, record = units.load(("score", name)) if units is not None else (False, None)
        if done and record is not None:
            score = _grid(record["score"])
            notes[name], seconds[name] = record["note"], record["seconds"]
        else:
            t0 = time.perf_counter()
            score, notes[name] = DEFINITIONS[name].measure(model, options, progress)
            seconds[name] = time.perf_counter() - t0
            if units is not None:
                unit = {"score": _rows(score), "note": notes[name], "seconds": seconds[name]}
                units.save(("score", name), unit)
        scores[name] = score
    matrix = AgreementMatrix(
        getattr(info, "name", "") or "", info.n_layers, options, scores, notes, seconds
    )

    retrieval = get_head_type("retrieval")()
    validations: dict[str, TypeValidation | None] = {}
    test = TestOptions(n_max=options.n_random, control_tokens=options.control_tokens)
    for name in options.definitions:
        heads = matrix.top(name)
        near = [h for h in top_k(scores[name], 2 * options.k) if h not in heads]
        for task in options.tasks:
            key = ("ablate", name, task)
            done, record = units.load(key) if units is not None else (False, None)
            if not done or record is None:
                record = validate_heads(
                    model, retrieval, heads, options.probe_options(), mode=options.mode,
                    task=task, excluded=near, one_by_one=[], test=test,
                ).to_json()  # fmt: skip
                if units is not None:
                    units.save(key, record)
            validations[f"{name}/{task}"] = TypeValidation.from_json(record)
    apply_fdr(validations)
    for claim, tested in validations.items():
        assert tested is not None
        name, task = claim.split("/")
        matrix.effects.setdefault(name, {})[task] = tested.parts()[0][1].to_json()
    matrix.provenance = provenance(
        model, options=options.probe_options(), settings={"agreement_matrix": options.to_json()}
    )
    return matrix
