"""What the command line prints beside the files it writes: each head type's evidence and
validation, and a pruning run's survival table."""

from __future__ import annotations

from typing import Any

__all__ = ["evidence", "pruning"]


def evidence(catalog: Any) -> None:
    """Each type's own evidence (e.g. syntactic: per relation, best head vs baseline) and
    validation effects."""
    from headmech.heads import head_types

    registry = head_types()
    for name, r in catalog.types.items():
        lines = registry[name]().report(r.details) if name in registry else []
        v = r.details.get("validation")
        if v and v.get("n_heads") and v.get("effect") is None:
            lines.append(f"validation: {v['control_note']}")
        elif v and v.get("n_heads"):
            lines.append(
                f"validation ({v['mode']} ablation, {v['metric']}): labelled heads {v['effect']:+.4f}, "
                f"{len(v['random_effects'])} random sets of {v['n_heads']} ({v['control']}) {v['random_mean']:+.4f} on average"
            )
        if lines:
            print(f"\n{name}:")
            for line in lines:
                print(f"  {line}")


def pruning(result: Any, catalog: Any) -> None:
    """Survival by type (with a catalog), the metric per step, and the headline."""
    if catalog is not None and result.steps:
        from headmech.pruning.survival import enrichment, removal_order

        n_kept = [st["n_kept"] for st in result.steps]
        print("types by when pruning removed half their heads (heads kept then):")
        for row in removal_order(result.survival, n_kept):
            print(f"  {row['type']}: {row['half_removed_at_n_kept']}")
        half = min(result.steps, key=lambda st: abs(st["n_kept"] - n_kept[0] / 2))
        e = enrichment(half["heads_kept"], catalog)
        print(f"enrichment of catalogued heads among the {half['n_kept']} kept: {e}")
    for st in result.steps:
        lam = f"  (lambda {st['lambda']:g})" if "lambda" in st else ""
        print(f"  {st['n_kept']:4d} heads kept: {st['metric']:.4f}{lam}")
    if "comparison" in result.extra:
        c = result.extra["comparison"]
        print(
            f"mae / {result.task} (held out, lower is better): base {c['base']:.4f}, "
            f"MAE gates + {c['model_steps']} model steps {c['mae']:.4f}, fine-tuned alone {c['finetuned']:.4f}"
        )
    else:
        print(
            f"{result.method} / {result.task}: {result.removable_fraction(0.05):.0%} of heads "
            "removable at <= 5% metric loss"
        )
