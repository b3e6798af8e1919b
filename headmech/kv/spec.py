"""What one KV plan is asked for, checked once, before a model loads.

:class:`KVPlanSpec` holds where the plan's full heads come from (a catalog's types, or
heads named), what every other head keeps (sinks and a window), an optional budget (a
fraction of the whole cache at a context length), and whether the plan is the random
control; checked against one table (:data:`PARAMETERS`) from Python's keywords or the
command line's flags alike. :meth:`KVPlanSpec.run` builds the
:class:`~headmech.kv.plan.KVPlan` for a loaded model.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from headmech.core import checks as V
from headmech.core.constraints import Boolean, Custom, Integer, Origin, Param, check, label
from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex

__all__ = ["PARAMETERS", "KVPlanSpec"]

FILLS = ("heads", "window")


def _heads_text(text: str, flag: str) -> tuple[HeadIndex, ...]:
    """``L18H6,L20H6`` (or ``18:6,20:6``) as head indices."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"L(\d+)H(\d+)|(\d+):(\d+)", item, re.I)
        if m is None:
            raise InputError(f"{flag} {text!r}: expected heads like L18H6 or 18:6, got {item!r}")
        a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        out.append(HeadIndex(int(a), int(b)))
    return tuple(out)


def _type_names(text: str, flag: str) -> tuple[str, ...]:
    from headmech.core.registry import HEAD_TYPES

    names = tuple(t.strip() for t in text.split(","))
    if not all(names):
        raise InputError(f"{flag} has an empty entry: {text!r}")
    for name in names:
        V.lookup(HEAD_TYPES, name)
    return names


def _fill(value: Any, name: str) -> str:
    if value not in FILLS:
        raise InputError(f"{name} is 'heads' or 'window', got {value!r}")
    return str(value)


#: the plan's parameters: keyword -> rule, flag and the flag's parser
PARAMETERS: dict[str, Param] = {
    "catalog": Param(None, "--catalog"),
    "heads": Param(None, "--heads", _heads_text),
    "types": Param(None, "--types", _type_names, default=("retrieval",)),
    "sinks": Param(Integer(0), "--sinks", default=4),
    "window": Param(Integer(1), "--window", default=256),
    "budget": Param(Custom(V.fraction), "--budget"),
    "context": Param(Integer(1), "--context"),
    "fill": Param(Custom(_fill), "--fill", default="heads"),
    "random": Param(Boolean(), "--random", default=False),
    "seed": Param(Custom(V.seed), "--seed", default=0),
}


@dataclasses.dataclass(frozen=True)
class KVPlanSpec:
    """A KV plan's settings, checked (:meth:`create`), model-free (see the module)."""

    catalog: Any = None
    heads: tuple[HeadIndex, ...] | None = None
    types: tuple[str, ...] = ("retrieval",)
    sinks: int = 4
    window: int = 256
    budget: float | None = None
    context: int | None = None
    fill: str = "heads"
    random: bool = False
    seed: int = 0

    @classmethod
    def create(cls, *, origin: Origin = "python", **given: Any) -> KVPlanSpec:
        """The spec of ``given`` (keywords, or parsed flags with ``origin="cli"``), each
        checked once: exactly one source (a catalog or heads); a budget needs a catalog
        and the context it is counted at."""
        v = check(PARAMETERS, given, origin, "KVPlanSpec")
        name = lambda key: label(PARAMETERS, key, origin)  # noqa: E731
        if v["budget"] is not None and (v["context"] is None or v["catalog"] is None):
            raise InputError(
                f"{name('budget')} needs {name('catalog')} and {name('context')} "
                "(the length it counts at)"
            )
        if (v["catalog"] is None) == (v["heads"] is None):
            raise InputError(f"give exactly one of {name('catalog')} and {name('heads')}")
        heads = None if v["heads"] is None else tuple(HeadIndex.parse(str(h)) if isinstance(h, str) else HeadIndex(*h) for h in v["heads"])  # fmt: skip
        return cls(**{**v, "heads": heads, "types": tuple(v["types"])})

    @classmethod
    def from_args(cls, args: Any) -> KVPlanSpec:
        """The spec of ``headmech kv-plan``'s arguments."""
        return cls.create(origin="cli", **{k: getattr(args, k, None) for k in PARAMETERS})

    def run(self, model: Any, catalog: Any = None, *, force: bool = False) -> Any:
        """The :class:`~headmech.kv.plan.KVPlan` for ``model`` (``catalog``: the loaded
        catalog of :attr:`catalog`; its path is recorded)."""
        import torch

        from headmech.kv.plan import KVPlan

        size = {"sinks": self.sinks, "window": self.window}
        if self.heads is not None:
            plan = KVPlan.from_heads(model, list(self.heads), **size, source={"kind": "heads"})
        else:
            plan = KVPlan.from_catalog(
                catalog if catalog is not None else self.catalog, model, self.types, **size,
                budget=self.budget, context=self.context, fill=self.fill, force=force,
            )  # fmt: skip
            plan.source["catalog"] = str(self.catalog)
        if self.random:
            plan = plan.random_matched(torch.Generator().manual_seed(self.seed), draw=self.seed)
        return plan
