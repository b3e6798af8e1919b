"""``headmech kv-plan``: a compressed KV cache's plan from a catalog or named heads.

The command follows :mod:`headmech.cli.commands`: every argument is checked before the model
loads; the plan (:class:`headmech.kv.KVPlan`) is written to a temporary file moved onto
``--out`` (a ``.json`` file, or a folder that gets ``plan.json``) on success.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headmech.cli.base import catalog_file, load_model_of, model_name
from headmech.core import checks as V
from headmech.core.errors import InputError

__all__ = ["add_parser", "cmd_kv_plan"]


def _kv_plan_target(path: str, force: bool) -> Path:
    """``kv-plan --out``: a ``.json`` file, or a folder that gets ``plan.json``."""
    if not path.strip():
        raise InputError("--out is empty")
    p = Path(path)
    target = p if p.suffix == ".json" else p / "plan.json"
    if target.is_dir():
        raise InputError(f"--out {target} is a folder, not a file")
    if target.exists() and not force:
        raise InputError(f"--out {target} already exists; use --force to overwrite")
    V.out_dir(str(target.parent), (), True)  # creatable and writable
    return target


def _check_kv_plan(args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """``kv-plan`` checks before loading: the plan's spec, ``--out``, the model, the
    catalog's file."""
    from headmech.kv.spec import KVPlanSpec

    spec = KVPlanSpec.from_args(args)
    catalog = catalog_file(args.catalog, args.model) if args.catalog is not None else None
    target = _kv_plan_target(args.out, args.force)
    V.device(args.device)
    model_name(args.model)
    from headmech.kv.budget import NOT_A_DECODER
    from headmech.models.bundled import BUNDLED_MODELS

    if args.model in BUNDLED_MODELS and not BUNDLED_MODELS[args.model].causal:
        raise InputError(NOT_A_DECODER.format(args.model))  # a bundled encoder: before loading
    return target, spec, catalog


def cmd_kv_plan(args: argparse.Namespace) -> int:
    """``headmech kv-plan``."""
    import uuid

    target, spec, catalog = _check_kv_plan(args)  # fail fast, before loading
    model = load_model_of(args).model
    plan = spec.run(model, catalog, force=args.force)
    tmp = target.with_name(f"{V.TMP_PREFIX}{uuid.uuid4().hex[:8]}-{target.name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        plan.save(tmp)
        os.replace(tmp, target)
    except OSError as e:
        raise InputError(f"cannot write {target}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    layers = sorted({la for la, _ in plan.full_heads()})
    print(f"{plan}; full KV heads in layers {', '.join(map(str, layers)) or 'none'}")
    fractions = ", ".join(f"{c:,}: {plan.kv_fraction(c):.1%}" for c in (2048, 4096, 8192))
    print(f"KV cache kept at {fractions} tokens\nwrote {target}")
    print(f"next: headmech.kv.KVPlan.load({str(target)!r}) in Python (docs/kv-compression.md)")
    return 0


def add_parser(sub: Any, add_placement: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``kv-plan`` subcommand's parser (``add_placement``: the shared placement options)."""
    p = sub.add_parser(
        "kv-plan",
        help="plan a compressed KV cache: full for catalogued heads, sinks + window elsewhere",
        description="Write a KV plan for MODEL: per layer and KV head, the whole cache (the heads "
        "of --types in --catalog, or --heads) or --sinks first tokens + a --window of recent "
        "ones (DuoAttention / RazorAttention). Under grouped-query attention a KV head is full "
        "if any of its query heads is. Writes plan.json (--out FILE.json or a folder).",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face decoder")
    p.add_argument("--catalog", help="a catalog.json (or its folder) from `headmech classify`")
    p.add_argument("--types", default="retrieval", help="types kept full (default retrieval)")
    p.add_argument("--heads", help="instead of a catalog: query heads kept full, e.g. L18H6,L20H6")
    p.add_argument("--sinks", type=int, default=4, help="first tokens every head keeps (default 4)")
    p.add_argument("--window", type=int, default=256, help="recent tokens kept (default 256)")
    p.add_argument(
        "--budget", type=float, default=None,
        help="instead of the labels: the best-scoring KV heads that fit this fraction of the "
        "whole cache at --context tokens, the window widened to spend the rest",
    )  # fmt: skip
    p.add_argument("--context", type=int, default=None, help="tokens the budget is measured at")
    p.add_argument(
        "--fill", choices=("heads", "window"), default="heads",
        help="how --budget is spent: the most full KV heads (by score) that leave others "
        "--window (heads), or the labelled heads full and the widest windows (window)",
    )  # fmt: skip
    p.add_argument(
        "--random", action="store_true",
        help="the control: as many full KV heads per layer, drawn at random (--seed)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    p.add_argument("--out", default="plan.json", help="a .json file or a folder (plan.json)")
    p.add_argument("--force", action="store_true", help="overwrite --out; any catalog weights")
    add_placement(p)
    p.set_defaults(func=cmd_kv_plan)
