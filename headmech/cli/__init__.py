"""The ``headmech`` command.

Every command prints a one-line reason (``headmech: error: ...``) and exits with status 2
on bad input, argument syntax errors included; every value is checked before the model
loads (:mod:`headmech.core.checks`, :mod:`headmech.cli.base`). Legal but meaningless input
prints one line ``headmech: warning: ...``; Ctrl-C prints ``headmech: interrupted`` and
exits 130. Long work shows a progress bar on stderr. Method, task and pruning-method names
and their help come from the registries (:mod:`headmech.core.registry`), so a plug-in's
additions appear here too. Each command's files are written by the result object's own
``save`` into a temporary folder next to ``--out`` and moved into ``--out`` only on
success; an existing result there is overwritten only with ``--force``. ``classify``,
``importance`` and ``prune`` keep their finished units in ``--out/.headmech-partial/`` as
they go; a stopped run (Ctrl-C prints the command that continues it) continues with
``--resume`` (:mod:`headmech.runs.resume`).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from headmech.cli import commands, compare, kv
from headmech.core.checks import HeadmechWarning
from headmech.core.errors import HeadmechError, IncompleteRunError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An argument parser whose syntax errors are one-line :class:`HeadmechError`s."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage and exiting."""
        raise HeadmechError(f"{message} (see `{self.prog} --help`)")


def _add_output(p: argparse.ArgumentParser) -> None:
    """``--out`` and ``--force``."""
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite an earlier result of this command in DIR"
    )


def _add_resume(p: argparse.ArgumentParser) -> None:
    """``--resume`` (classify, importance, prune)."""
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run in DIR from its finished units (kept in "
        "DIR/.headmech-partial/); it must have the same arguments and weights, and the "
        "result is byte-identical to an uninterrupted run's. With --force: also overwrite an "
        "earlier result; --force alone starts over",
    )


def _add_placement(p: argparse.ArgumentParser) -> None:
    """Where the model runs and in which dtype."""
    from headmech.core.checks import DTYPES

    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weight dtype (default: as stored, fp32 for the bundled models); "
        "statistics and metrics accumulate in fp32",
    )
    p.add_argument(
        "--device-map",
        choices=["auto"],
        default=None,
        help="spread the model over GPUs, CPU and disk with accelerate",
    )
    p.add_argument(
        "--max-memory",
        metavar="DEV=SIZE,...",
        default=None,
        help="memory per device for --device-map, e.g. cpu=2GiB or 0=70GiB,1=70GiB,cpu=100GiB",
    )
    p.add_argument(
        "--offload-folder", metavar="DIR", default=None, help="where disk-offloaded weights go"
    )


def _add_run_options(p: argparse.ArgumentParser, half_len: bool = True) -> None:
    """Model, output folder, seed, device and probe sizes (classify, importance, prune)."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="minilm-l6, smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
        "toy-induction, a local Hugging Face model directory, or a .gguf file (dequantised once "
        "and cached)",
    )
    _add_output(p)
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    _add_placement(p)
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
    p.add_argument(
        "--context",
        metavar="N,N,...",
        default=None,
        help="needle probe: haystack lengths in tokens, up to the model's context "
        "(default 300,700,1100,1500)",
    )
    p.add_argument(
        "--depths",
        metavar="D,D,...",
        default=None,
        help="needle probe: needle depths in [0, 1] (default 0.1,0.5,0.9)",
    )


def _add_method(p: argparse.ArgumentParser, registry: Any, what: str) -> None:
    """``--method`` (required), ``--task`` and ``--option``, their help from the registries."""
    from headmech.core.registry import TASKS

    p.add_argument("--method", required=True, metavar="M", help=f"{what}: {registry.help()}")
    p.add_argument(
        "--task", default=None, metavar="T",
        help=f"task (default: the model's, lm for most, induction for toy-induction): {TASKS.help()}",
    )  # fmt: skip
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
    corpus = "a UTF-8 text file of prose to probe with (default: the CPython docs' prose)"
    p.add_argument("--corpus", help=corpus)
    validate = "test each type's claims against random control sets (p, q, verdict); record them"
    p.add_argument("--validate", action="store_true", help=validate)
    n_random = "control sets per claim for --validate, at most (default 99: p can reach 0.01; the "
    n_random += "test stops once 5 are at least as extreme; fewer: quick work, p >= 1/(n+1))"
    p.add_argument("--n-random", type=int, default=None, help=n_random)
    tokens = "--validate measures the control sets on every k-th probe batch, k the largest "
    tokens += "whose batches hold N tokens (default 0: every batch)"
    p.add_argument("--control-tokens", type=int, default=None, metavar="N", help=tokens)
    alone = "--validate ablates at most L labelled and R rejected heads alone (default 24,8)"
    p.add_argument("--alone", default=None, metavar="L,R", help=alone)
    broad = "--validate without reading the heads on ordinary text (a forward pass over ~3,800 "
    broad += "tokens; the catalog says it was skipped)"
    p.add_argument("--no-broad", dest="broad", action="store_false", help=broad)
    p.add_argument(
        "--threshold", action="append", default=None, metavar="TYPE=VALUE",
        help="a head type's threshold instead of its default (`headmech types` lists them), "
        "e.g. previous_token=0.3; repeatable, or comma-separated: previous_token=0.3,induction=0.5",
    )  # fmt: skip
    _add_resume(p)
    p.set_defaults(func=commands.cmd_classify)


def _add_importance(sub: Any) -> None:
    from headmech.core.registry import METHODS

    p = sub.add_parser(
        "importance",
        help="score every head's importance for a task",
        description="Score every head of MODEL for a task by an attribution method; writes DIR/importance.json and DIR/importance.png.",
    )
    _add_run_options(p)
    _add_method(p, METHODS, "attribution method")
    _add_resume(p)
    p.set_defaults(func=commands.cmd_importance)


def _add_circuit(sub: Any) -> None:
    p = sub.add_parser(
        "circuit",
        help="graph how catalogued heads compose",
        description="Classify MODEL's heads (or read --catalog), then graph which earlier heads feed the labelled heads' "
        "queries, keys and values (weight-based composition, Elhage et al. 2021); writes "
        "DIR/circuit.graphml, DIR/circuit.json and DIR/circuit.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument(
        "--types", help="comma-separated head types whose heads are receivers (default: all)"
    )
    p.add_argument(
        "--catalog",
        help="a catalog.json (or its folder) from `headmech classify` instead of classifying",
    )
    p.add_argument("--kinds", default="q,k,v", help="composition kinds (default q,k,v)")
    p.add_argument(
        "--top-k", type=int, default=3, help="strongest senders kept per receiver and kind"
    )
    _add_output(p)
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    _add_placement(p)
    p.set_defaults(func=commands.cmd_circuit)


def _add_discover(sub: Any) -> None:
    from headmech.cli.discover import cmd_discover

    p = sub.add_parser(
        "discover",
        help="cluster heads by behaviour and report what no catalog type explains",
        description="Give every head of MODEL a feature vector (its score on every catalog type "
        "and attention statistics), cluster the heads (Ward) and report the clusters no "
        "catalog type explains, with example prompts; writes DIR/discovery.json, "
        "DIR/discovery.png and DIR/cluster_<id>.png per unexplained cluster.",
    )
    _add_run_options(p, half_len=False)
    p.add_argument("--types", help="comma-separated head types (default: all that fit the model)")
    p.add_argument(
        "--corpus",
        help="a UTF-8 text file of prose to probe with (default: the CPython docs' prose)",
    )
    p.add_argument(
        "--clusters",
        type=int,
        default=None,
        metavar="K",
        help="number of clusters, 2 .. number of heads (default: best silhouette in 2..12)",
    )
    p.set_defaults(func=cmd_discover)


def _add_prune(sub: Any) -> None:
    from headmech.core.registry import PRUNING_METHODS

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
        default=None,
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
        default=None,
        help="l0: λ values of the sweep (default 0.01,0.1,1,3,10)",
    )
    p.add_argument(
        "--l0-steps", type=int, default=None, help="l0: gate training steps per λ (default 100)"
    )
    _add_resume(p)
    p.set_defaults(func=commands.cmd_prune)


def build_parser() -> argparse.ArgumentParser:
    """The ``headmech`` argument parser (subcommands, their help from the registries)."""
    parser = _Parser(
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
    _add_discover(sub)
    compare.add_parser(sub, _add_output, _add_resume, _add_placement)
    kv.add_parser(sub, _add_placement)
    _add_serve(sub)
    return parser


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="any text, any head or layer, in the browser (a local server)",
        description="Load MODEL once and serve a page on this machine: type a text, name a head "
        "(L3H1) or a layer (L3), and see its attention, what it writes and its pattern scores.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument(
        "--host", default="127.0.0.1", help="the address to bind (default: this machine only)"
    )
    p.add_argument(
        "--port", type=int, default=8765, help="the port (default 8765; 0: any free one)"
    )
    p.set_defaults(func=commands.cmd_serve)


def _one_line(text: str) -> str:
    """A message as one line: line breaks (say, in a hostile file name) shown as ``\\n``."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _show_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
    """Print a warning as one line ``headmech: warning: ...`` on stderr."""
    kind = "" if issubclass(category, HeadmechWarning) else f"{category.__name__}: "
    print(f"headmech: warning: {kind}{_one_line(str(message))}", file=sys.stderr)


def _out_of_memory(e: BaseException) -> bool:
    """Whether an exception is torch's or Python's out-of-memory error."""
    text = str(e)
    return isinstance(e, MemoryError) or "out of memory" in text or "can't allocate" in text


def _close_bars() -> None:
    """Close live progress bars, so that the one-line error starts a line of its own."""
    from tqdm import tqdm

    for b in list(getattr(tqdm, "_instances", ())):
        b.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad input, 130: interrupted)."""
    # the command writes figures to files, no window; matplotlib is imported where a
    # figure is drawn (not before --help or a mistyped name is answered)
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    else:
        os.environ["MPLBACKEND"] = "Agg"
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        warnings.simplefilter("always", HeadmechWarning)  # every run shows its own
        try:
            given = list(sys.argv[1:] if argv is None else argv)  # for "continue with:"
            args = build_parser().parse_args(argv, namespace=argparse.Namespace(argv=given))
            return int(args.func(args))
        except IncompleteRunError as e:  # the finished part is written; say where, once
            _close_bars()
            print(f"headmech: error: {_one_line(str(e))}", file=sys.stderr)
            return EXIT_INTERRUPTED if isinstance(e.__cause__, KeyboardInterrupt) else 1
        except HeadmechError as e:
            _close_bars()
            print(f"headmech: error: {_one_line(str(e))}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            _close_bars()
            print("headmech: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # `headmech types | head`: the reader stopped, not an error
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit writes nowhere
            return 1
        except (MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            print(
                f"headmech: error: out of memory ({_one_line(str(e))[:200]}); try a smaller "
                "--batch-size or fewer sequences",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
