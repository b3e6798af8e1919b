"""``headmech discover``: cluster heads by behaviour, report what the catalog misses.

The command follows :mod:`headmech.cli.commands`: every argument is checked before the model
loads, and the files are written through :meth:`headmech.discover.clusters.DiscoveryResult.save`
into a temporary folder moved into ``--out`` on success. The number of cluster figures
varies from run to run, so ``--force`` also removes an earlier run's ``cluster_*.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from headmech.cli.base import RESULT_FILES, config_shape, load_model_of, probe_options, save_result
from headmech.cli.checks import check_classify, fit_types
from headmech.core import checks as V
from headmech.core.errors import InputError

__all__ = ["cmd_discover"]


def _cluster_files(out: str) -> tuple[str, ...]:
    """The cluster figures of an earlier ``discover`` result in ``out``."""
    return tuple(sorted(p.name for p in Path(out).glob("cluster_*.png")))


def _check_clusters(k: int | None, shape: tuple[int, int] | None) -> None:
    if k is not None and shape is not None and k > shape[0] * shape[1]:
        raise InputError(f"--clusters {k}: the model has only {shape[0] * shape[1]} heads")


def cmd_discover(args: argparse.Namespace) -> int:
    """``headmech discover``."""
    V.count(args.clusters, "--clusters", minimum=2)
    given = check_classify(args, "discover")  # fail fast, before loading
    from headmech.discover import discover
    from headmech.models import model_info

    names, sentences = given.names, given.sentences
    V.out_dir(args.out, _cluster_files(args.out), args.force)
    _check_clusters(args.clusters, config_shape(args.model))
    loaded = load_model_of(args)
    model = loaded.model
    info = model_info(model)
    _check_clusters(args.clusters, (info.n_layers, info.n_heads))
    types, _ = fit_types(model.tokenizer, names, sentences, info.causal)
    prose = V.prose_problem(model.tokenizer, sentences) is None
    options = dict(vars(probe_options(args)), corpus=args.corpus)
    result = discover(
        model, types, n_clusters=args.clusters, attention_probe="prose" if prose else "repeated_random",
        progress=True, **options,
    )  # fmt: skip
    out = save_result(args, "discover", result, loaded, _cluster_files(args.out))
    print(result.table())
    print(result.examples_text())
    figures = [f"cluster_{c.id}.png" for c in result.unexplained if c.examples]
    files = ", ".join(str(out / f) for f in [*RESULT_FILES["discover"], *figures])
    print(
        f"\n{len(result.clusters)} clusters, {len(result.unexplained)} unexplained; wrote {files}"
    )
    print(f"next: open {out / 'discovery.png'}   (the heads' clusters and the types they match)")
    return 0
