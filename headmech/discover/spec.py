"""What one discovery run is asked to do, checked once, before a model loads.

:class:`DiscoverSpec` holds the classification whose scores are the features (a
:class:`~headmech.classification.spec.ClassifySpec`: the types and probe options), the
number of clusters (or the range the silhouette chooses from), when a cluster counts as
explained and the probe of the attention statistics, checked against one table
(:data:`PARAMETERS`) from Python's keywords or the command line's flags alike.
:func:`headmech.discover.discover` is ``DiscoverSpec.create(...)`` then the clustering.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from headmech.core.constraints import Custom, Integer, Origin, Param, check
from headmech.core.errors import InputError

__all__ = ["K_RANGE", "PARAMETERS", "DiscoverSpec"]

K_RANGE = (2, 12)  # cluster counts the silhouette chooses from


def _k_range(value: Any, name: str) -> tuple[int, int]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    ok = ok and all(isinstance(k, int) and not isinstance(k, bool) for k in value)
    if not ok or not 2 <= value[0] <= value[1]:
        raise InputError(f"{name} must be (low, high) with 2 <= low <= high, got {value!r}")
    return int(value[0]), int(value[1])


def _share(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InputError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def _probe_name(value: Any, name: str) -> str:
    from headmech.core import checks as V
    from headmech.core.registry import PROBES

    V.lookup(PROBES, str(value))  # unknown: one line, a close name suggested
    return str(value)


#: discovery's own parameters (the types and probe options are the ClassifySpec's)
PARAMETERS: dict[str, Param] = {
    "n_clusters": Param(Integer(2), "--clusters"),
    "k_range": Param(Custom(_k_range), None, default=K_RANGE),
    "min_share": Param(Custom(_share), None, default=0.5),
    "broad_share": Param(Custom(_share), None, default=0.5),
    "n_examples": Param(Integer(0), None, default=3),
    "attention_probe": Param(Custom(_probe_name), None, default="prose"),
}


@dataclasses.dataclass(frozen=True)
class DiscoverSpec:
    """A discovery run's settings, checked (:meth:`create`), model-free.

    Attributes:
        classify: the types whose scores are features, and the probe options.
        n_clusters: the number of clusters (None: chosen by silhouette over ``k_range``).
        k_range: the cluster counts (inclusive) the silhouette chooses from.
        min_share: a cluster is explained when this share of its heads carry a specific
            type's label.
        broad_share: a type labelling more than this share of all heads is not specific.
        n_examples: example prompts per unexplained cluster.
        attention_probe: the probe of the attention statistics.
    """

    classify: Any
    n_clusters: int | None = None
    k_range: tuple[int, int] = K_RANGE
    min_share: float = 0.5
    broad_share: float = 0.5
    n_examples: int = 3
    attention_probe: str = "prose"

    @classmethod
    def create(cls, *, origin: Origin = "python", **given: Any) -> DiscoverSpec:
        """The spec of ``given``: discovery's own keywords (:data:`PARAMETERS`) and the
        classification's (``types``, ``seed``, the probe options), each checked once."""
        from headmech.classification.spec import ClassifySpec

        own = {k: given.pop(k) for k in list(given) if k in PARAMETERS}
        v = check(PARAMETERS, own, origin, "discover()")
        classify = ClassifySpec.create(origin=origin, what="discover()", n_boot=0, **given)
        return cls(classify, **v)

    @classmethod
    def from_args(cls, args: Any) -> DiscoverSpec:
        """The spec of ``headmech discover``'s arguments."""
        from headmech.classification.spec import PARAMETERS as CLASSIFY
        from headmech.core.options import PROBE_FLAG_NAMES

        names = {**PROBE_FLAG_NAMES, "thresholds": "threshold"}
        given = {k: getattr(args, names.get(k, k), None) for k in CLASSIFY if k != "n_boot"}
        given = {k: v for k, v in given.items() if v is not None}
        return cls.create(origin="cli", n_clusters=args.clusters, **given)

    def to_json(self) -> dict[str, Any]:
        """The settings the discovery's provenance records (with the types run and
        skipped, added by the run)."""
        return {
            "n_clusters": self.n_clusters,
            "k_range": list(self.k_range),
            "linkage": "ward",
            "scaling": "standard",
            "min_share": self.min_share,
            "broad_share": self.broad_share,
            "n_examples": self.n_examples,
            "attention_probe": self.attention_probe,
        }
