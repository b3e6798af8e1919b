"""The ``headmech`` command.

Every command prints a one-line reason and exits with status 2 on bad input (unknown
model, head type, method or task, empty, missing or too-long corpus text, a model without
attention hooks); long work shows a progress bar on stderr. Method, task and
pruning-method names and their help come from the registries
(:mod:`headmech.registry`), so a plug-in's additions appear here too. Each command's
files are written by the result object's own ``save`` (the same files a notebook gets).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from headmech import commands
from headmech.errors import HeadmechError

EXIT_BAD_INPUT = 2


def _add_run_options(p: argparse.ArgumentParser, half_len: bool = True) -> None:
    """Model, output folder, seed, device and probe sizes (classify, importance, prune)."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="minilm-l6, smollm2-135m, toy-induction, or a local Hugging Face model directory",
    )
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.add_argument("--n-sentences", type=int, default=None, help="prose sentences (default 256)")
    p.add_argument(
        "--n-sequences", type=int, default=None, help="repeated random sequences (default 32)"
    )
    if half_len:
        p.add_argument(
            "--half-len", type=int, default=None, help="tokens per repeated half (default 32)"
        )
    p.add_argument(
        "--batch-size", type=int, default=16, help="sequences per forward pass (default 16)"
    )


def _add_method(p: argparse.ArgumentParser, registry: Any, what: str) -> None:
    """``--method`` (required), ``--task`` and ``--option``, their help from the registries."""
    from headmech.registry import TASKS

    p.add_argument("--method", required=True, metavar="M", help=f"{what}: {registry.help()}")
    p.add_argument("--task", default="lm", metavar="T", help=f"task (default lm): {TASKS.help()}")
    p.add_argument(
        "--option", "-o", action="append", metavar="KEY=VALUE",
        help="a typed option of the method (repeatable), e.g. -o chunk=16",
    )  # fmt: skip


def _add_classify(sub: Any) -> None:
    p = sub.add_parser(
        "classify",
        help="score and label every head of a model",
        description="Score and label every head of MODEL for catalog head types; writes DIR/catalog.json and DIR/heatmap.png.",
    )
    _add_run_options(p, half_len=False)
    p.add_argument("--types", help="comma-separated head types (default: all that fit the model)")
    p.add_argument(
        "--corpus",
        help="a UTF-8 text file of prose to probe with (default: the CPython docs' prose)",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="ablate each type's labelled heads and as many random heads; record the effects",
    )
    p.add_argument(
        "--n-random", type=int, default=5, help="random head sets for --validate (default 5)"
    )
    p.set_defaults(func=commands.cmd_classify)


def _add_importance(sub: Any) -> None:
    from headmech.registry import METHODS

    p = sub.add_parser(
        "importance",
        help="score every head's importance for a task",
        description="Score every head of MODEL for a task by an attribution method; writes DIR/importance.json and DIR/importance.png.",
    )
    _add_run_options(p)
    _add_method(p, METHODS, "attribution method")
    p.set_defaults(func=commands.cmd_importance)


def _add_circuit(sub: Any) -> None:
    p = sub.add_parser(
        "circuit",
        help="graph how catalogued heads compose",
        description="Classify MODEL's heads, then graph which earlier heads feed the labelled heads' "
        "queries, keys and values (weight-based composition, Elhage et al. 2021); writes "
        "DIR/circuit.graphml, DIR/circuit.json and DIR/circuit.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument(
        "--types", help="comma-separated head types whose heads are receivers (default: all)"
    )
    p.add_argument("--kinds", default="q,k,v", help="composition kinds (default q,k,v)")
    p.add_argument(
        "--top-k", type=int, default=3, help="strongest senders kept per receiver and kind"
    )
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.set_defaults(func=commands.cmd_circuit)


def _add_prune(sub: Any) -> None:
    from headmech.registry import PRUNING_METHODS

    p = sub.add_parser(
        "prune",
        help="prune heads and record the task metric",
        description="Prune MODEL's heads for a task; writes DIR/pruning.json and DIR/pruning.png.",
    )
    _add_run_options(p)
    _add_method(p, PRUNING_METHODS, "pruning method")
    p.add_argument(
        "--fraction",
        type=float,
        default=0.1,
        help="michel: share of remaining heads per step (0.1)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="michel: stop after N steps (default: all)"
    )
    p.add_argument(
        "--catalog", help="a catalog.json from `headmech classify`: report which types survive"
    )
    p.add_argument(
        "--lams",
        default="0.01,0.1,1,3,10",
        help="l0: λ values of the sweep (default 0.01,0.1,1,3,10)",
    )
    p.add_argument(
        "--l0-steps", type=int, default=100, help="l0: gate training steps per λ (default 100)"
    )
    p.set_defaults(func=commands.cmd_prune)


def build_parser() -> argparse.ArgumentParser:
    """The ``headmech`` argument parser (subcommands, their help from the registries)."""
    parser = argparse.ArgumentParser(
        prog="headmech",
        description="Mechanistic analysis of attention heads: classify heads into a cited catalog of types.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser(
        "models", help="list bundled and toy models", description="List bundled and toy models."
    )
    p.set_defaults(func=commands.cmd_models)
    p = sub.add_parser(
        "types",
        help="list catalog head types with citations",
        description="List catalog head types with citations.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also print full citations")
    p.set_defaults(func=commands.cmd_types)
    _add_classify(sub)
    _add_importance(sub)
    _add_circuit(sub)
    _add_prune(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad input, 130: interrupted)."""
    import matplotlib

    matplotlib.use("Agg")  # the command writes figures to files; no window
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except HeadmechError as e:
        print(f"headmech: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("headmech: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
