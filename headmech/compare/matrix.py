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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.compare.definitions import DEFINITIONS
from headmech.compare.options import RECALL_TASKS, MatrixOptions
from headmech.core.errors import InputError, UnsupportedModelError
from headmech.core.head_index import HeadIndex, top_k
from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.records import TypeValidation
    from headmech.runs.resume import Units

__all__ = [
    "MATRIX_FILE",
    "RECALL_TASKS",
    "AgreementMatrix",
    "MatrixOptions",
    "agreement_matrix",
]

MATRIX_FILE = FileSchema(
    "agreement matrix", "definitions.json", SCHEMA_VERSION,
    required=("definitions", "jaccard", "effects"),
)  # fmt: skip


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
        kv: definition -> the KV compression its ranking buys as a full-cache plan
            (``benchmarks/bench_kv_plans.py --definitions --report`` writes it: context,
            budget, compression, criteria; compression None where no budget met them).

    ``save(folder)`` writes ``definitions.json`` and the Jaccard heatmap ``definitions.png``.
    """

    model: str
    n_layers: int
    options: MatrixOptions
    scores: dict[str, Tensor]
    notes: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    effects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)

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
            "kv_compression": self.kv,
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
            d.get("provenance", {}), d.get("kv_compression", {}),
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
                    f"{a} on {t}: {_fmt(c.get('effect'), '+.3f')} (controls' median "
                    f"{_fmt(c.get('random_median'), '+.3f')}), p {_fmt(test.get('p'))}, "
                    f"q {_fmt(test.get('q'))}, n {test.get('n', 0)}: {c.get('verdict')}"
                )
        return "\n".join(lines)


def _rows(score: Tensor) -> list[list[float | None]]:
    """A score grid as JSON rows (a head a definition cannot score, NaN: null)."""
    return [[None if v != v else v for v in row] for row in score.tolist()]


def _grid(rows: list[list[float | None]]) -> Tensor:
    return torch.tensor([[float("nan") if v is None else v for v in row] for row in rows])


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


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
    from headmech.classification.validation import apply_fdr
    from headmech.models import model_info
    from headmech.runs.provenance import provenance

    options = options or MatrixOptions()
    _check(model, options)
    info = model_info(model)
    scores, notes, seconds = _scores(model, options, progress, units)
    matrix = AgreementMatrix(
        getattr(info, "name", "") or "", info.n_layers, options, scores, notes, seconds
    )
    validations = _ablations(model, matrix, units)
    apply_fdr(validations)
    for claim, tested in validations.items():
        assert tested is not None
        name, task = claim.split("/")
        matrix.effects.setdefault(name, {})[task] = tested.parts()[0][1].to_json()
    matrix.provenance = provenance(
        model, options=options.probe_options(), settings={"agreement_matrix": options.to_json()}
    )
    return matrix


def _scores(
    model: TransformerBridge, options: MatrixOptions, progress: bool, units: Units | None
) -> tuple[dict[str, Tensor], dict[str, str], dict[str, float]]:
    """Every definition's score of every head, with its note and seconds (kept in ``units``
    as each finishes, read back from it on a resumed run)."""
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
    return scores, notes, seconds


def _ablations(
    model: TransformerBridge, matrix: AgreementMatrix, units: Units | None
) -> dict[str, TypeValidation | None]:
    """Each definition's set ablated on each task against its controls (the next ``k``
    heads of its ranking kept out of them): ``"<definition>/<task>"`` -> the test."""
    from headmech.classification.montecarlo import TestOptions
    from headmech.classification.records import TypeValidation
    from headmech.classification.validation import validate_heads
    from headmech.headtypes.registry import get_head_type

    options = matrix.options
    retrieval = get_head_type("retrieval")()
    validations: dict[str, TypeValidation | None] = {}
    test = TestOptions(n_max=options.n_random, control_tokens=options.control_tokens)
    for name in options.definitions:
        heads = matrix.top(name)
        near = [h for h in top_k(matrix.scores[name], 2 * options.k) if h not in heads]
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
    return validations
