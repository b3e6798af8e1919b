"""``headmech discover``: cluster heads by behaviour, report what the catalog misses.

The command follows :mod:`headmech.cli.commands`: every argument is checked before the model
loads, and the files are written through :meth:`headmech.discover.clusters.DiscoveryResult.save`
into a temporary folder moved into ``--out`` on success. The number of cluster figures
varies from run to run, so ``--force`` also removes an earlier run's ``cluster_*.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from headmech.cli.base import (
    RESULT_FILES,
    check_run,
    config_shape,
    fit_before_load,
    load_model_of,
    save_result,
)
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
    check_run(args, "discover", sizes=False)  # fail fast, before loading
    from headmech.discover.spec import DiscoverSpec

    spec = DiscoverSpec.from_args(args)
    fit_before_load(spec.classify, args.model)
    from headmech.discover import discover_spec
    from headmech.models import model_info

    V.out_dir(args.out, _cluster_files(args.out), args.force)
    _check_clusters(args.clusters, config_shape(args.model))
    loaded = load_model_of(args)
    model = loaded.model
    info = model_info(model)
    fitted, _ = spec.classify.fit(model.tokenizer, info.causal)
    prose = fitted.prose_problem(model.tokenizer) is None
    spec = dataclasses.replace(
        spec, classify=fitted, attention_probe="prose" if prose else "repeated_random"
    )
    result = discover_spec(model, spec, progress=True)
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
