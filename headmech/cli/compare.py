"""``headmech compare-definitions``: competing definitions of retrieval heads on one model.

Every argument is checked before the model loads (:class:`~headmech.compare.MatrixOptions`
refuses an unknown definition or task and a count below 1; the probes are built for the
model before any score is measured); each definition's score and each ablation test is
kept in ``DIR/.headmech-partial/`` as it finishes, so ``--resume`` continues a stopped run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from headmech.cli.base import (
    RESULT_FILES,
    check_run,
    load_model_of,
    resumable,
    save_result,
    staging,
)
from headmech.core import checks as V
from headmech.core.errors import InputError

__all__ = [
    "DEFAULT_TASKS",
    "DEFINITION_NAMES",
    "TASK_NAMES",
    "add_parser",
    "cmd_compare_definitions",
    "matrix_options",
]

# the names of headmech.compare's DEFINITIONS and RECALL_TASKS, here so that --help and the
# name checks import no torch (tests/test_compare_definitions.py keeps them equal)
DEFINITION_NAMES = ("wu", "qrhead", "locos", "cri", "kv")
TASK_NAMES = ("documents", "retrieval", "nonliteral", "literal", "facts")
DEFAULT_TASKS = ("documents", "retrieval", "facts")


def _names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    """``"wu,qrhead"`` -> ``("wu", "qrhead")``; a one-line error for a name not ``known``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if unknown := [n for n in names if n not in known]:
        raise InputError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def matrix_options(args: argparse.Namespace) -> Any:
    """The :class:`~headmech.compare.MatrixOptions` of the command line (one-line errors)."""
    definitions = _names(args.definitions, DEFINITION_NAMES, "definition")
    tasks = _names(args.tasks, TASK_NAMES, "task")
    V.number_list(args.context, "--context", int, low=1)
    from headmech.compare import MatrixOptions

    return MatrixOptions(
        definitions=definitions, tasks=tasks,
        k=args.k, n_questions=args.n_questions, cri_questions=args.cri_questions,
        locos_probe=args.locos_probe,
        context=V.number_list(args.context, "--context", int, low=1),
        n_random=args.n_random, control_tokens=args.control_tokens, mode=args.mode,
        seed=V.seed(args.seed),
    )  # fmt: skip


def cmd_compare_definitions(args: argparse.Namespace) -> int:
    """``headmech compare-definitions``: options -> load -> score, ablate -> save."""
    check_run(args, "compare-definitions", sizes=False)  # fail fast, before loading
    options = matrix_options(args)
    from headmech.compare import agreement_matrix
    from headmech.runs.resume import bind_weights

    units = staging(args, "compare-definitions", options)
    loaded = load_model_of(args)
    bind_weights(units, loaded.model)  # --resume: the same weights
    with resumable(args, units):
        result = agreement_matrix(loaded.model, options, progress=True, units=units)
        out = save_result(args, "compare-definitions", result, loaded, units=units)
    print(result.table())
    print("\nwrote " + ", ".join(str(out / f) for f in RESULT_FILES["compare-definitions"]))
    print(f"next: open {out / 'definitions.png'}   (the sets' Jaccard overlap)")
    return 0


def add_parser(sub: Any, add_output: Callable[..., None], add_resume: Callable[..., None],
               add_placement: Callable[..., None]) -> None:  # fmt: skip
    """The ``compare-definitions`` subcommand and its arguments (the shared ``--out``,
    ``--resume`` and placement flags through the given adders)."""
    p = sub.add_parser(
        "compare-definitions",
        help="compare published definitions of retrieval heads on one model",
        description="Rank MODEL's heads by each definition of retrieval heads (Wu et al.'s "
        "copy-paste score, QRHead, LOCOS, causal retrieval importance, the KV-cache "
        "importance), keep each top K, and measure how the sets overlap (Jaccard) and what "
        "mean-ablating each costs on multi-document, needle and parametric recall against "
        "control sets of as many heads from the same layers (p, Benjamini-Hochberg q, n); "
        "writes DIR/definitions.json and DIR/definitions.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face decoder")
    p.add_argument(
        "--definitions", default=",".join(DEFINITION_NAMES),
        help=f"comma-separated definitions (default: all: {', '.join(DEFINITION_NAMES)})",
    )  # fmt: skip
    p.add_argument(
        "--tasks", default=",".join(DEFAULT_TASKS),
        help=f"comma-separated recall tasks each set is ablated on, of {', '.join(TASK_NAMES)} "
        f"('' for none; default: {', '.join(DEFAULT_TASKS)})",
    )  # fmt: skip
    p.add_argument("--k", type=int, default=16, help="heads in each set (default 16, QRHead's)")
    p.add_argument(
        "--n-questions", type=int, default=40,
        help="questions (and facts, needle sequences) scored and ablated on (default 40)",
    )  # fmt: skip
    p.add_argument(
        "--cri-questions", type=int, default=10,
        help="questions CRI patches every head on (default 10: a pass per head each)",
    )  # fmt: skip
    p.add_argument(
        "--locos-probe", default="documents", choices=("documents", "nonliteral", "literal"),
        help="what LOCOS scores heads on (default documents; nonliteral: LOCOS's own needles, "
        "where the model answers some)",
    )  # fmt: skip
    p.add_argument("--context", default="300", help="needle haystack lengths (default 300)")
    p.add_argument(
        "--n-random", type=int, default=99,
        help="control sets per set and task at most (default 99: p can reach 0.01)",
    )  # fmt: skip
    p.add_argument(
        "--control-tokens", type=int, default=0,
        help="measure each test on every k-th piece of the task that still holds this many "
        "tokens (default 0: every batch)",
    )  # fmt: skip
    p.add_argument("--mode", default="mean", choices=("mean", "zero"), help="the ablation")
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    add_output(p)
    add_resume(p)
    add_placement(p)
    p.set_defaults(func=cmd_compare_definitions)
