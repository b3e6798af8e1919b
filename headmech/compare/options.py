"""What an agreement matrix is measured on (:class:`MatrixOptions`) and the recall tasks
each definition's set is ablated on (:data:`RECALL_TASKS`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headmech.compare.definitions import DEFINITIONS
from headmech.core.errors import InputError

if TYPE_CHECKING:
    from headmech.core.options import ProbeOptions

__all__ = ["RECALL_TASKS", "MatrixOptions"]

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
