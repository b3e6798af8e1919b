"""What one pruning run is asked to do, checked once, before a model loads.

:class:`PruneSpec` is a :class:`~headmech.attribution.spec.MethodSpec` of the pruning
methods (:data:`headmech.core.registry.PRUNING_METHODS`): ``michel``, ``l0``, ``mae`` or a
plug-in's, with their typed options. On the command line, ``--fraction`` and ``--steps``
(michel) and ``--lams`` and ``--l0-steps`` (l0) are options too (``--option`` pairs win).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from headmech.attribution.spec import MethodSpec
from headmech.core import checks as V

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.results import HeadCatalog
    from headmech.core.registry import Registry
    from headmech.pruning.result import PruningResult
    from headmech.runs.resume import Units

__all__ = ["PruneSpec"]

# the flags of one method each: (flag's argument name, option, its check, default)
_FLAGS: dict[str, tuple[tuple[str, str, Any, Any], ...]] = {
    "michel": (
        ("fraction", "fraction", V.fraction, 0.1),
        ("steps", "steps", V.count, None),
    ),
    "l0": (
        ("lams", "lams", lambda text, flag: V.lams(text), "0.01,0.1,1,3,10"),
        ("l0_steps", "steps", V.count, 100),
    ),
}


@dataclasses.dataclass(frozen=True)
class PruneSpec(MethodSpec):
    """A pruning run (:func:`headmech.pruning.prune`)."""

    what: ClassVar[str] = "prune()"

    @classmethod
    def registry(cls) -> Registry[Any]:
        from headmech.core.registry import PRUNING_METHODS

        return PRUNING_METHODS

    @classmethod
    def flag_options(cls, args: Any, options: dict[str, Any]) -> dict[str, Any]:
        """``--fraction``/``--steps`` (michel) and ``--lams``/``--l0-steps`` (l0), checked;
        a flag of another method warns that it is ignored."""
        out: dict[str, Any] = {}
        for method, flags in _FLAGS.items():
            given = [f for f, *_ in flags if getattr(args, f, None) is not None]
            if given and args.method != method:
                names = ", ".join("--" + f.replace("_", "-") for f in given)
                V.warn(f"{names}: only for --method {method}, ignored by --method {args.method}")
        for name, option, checked, default in _FLAGS.get(args.method, ()):
            value = getattr(args, name, None)
            value = default if value is None else value
            if option not in options:
                out[option] = checked(value, "--" + name.replace("_", "-"))
        return out

    def run(
        self,
        model: TransformerBridge,
        *,
        catalog: HeadCatalog | None = None,
        progress: bool = True,
        units: Units | None = None,
    ) -> PruningResult:
        """Prune ``model``'s heads (``catalog``: fills ``survival`` per head type)."""
        from headmech.pruning.survival import check_catalog
        from headmech.runs.resume import recording

        entry = self.registry().entry(self.method)
        check_catalog(catalog, model)  # before any work: its heads must be the model's
        with recording(units):
            return entry.obj(  # type: ignore[no-any-return]
                model, self.task, probe_options=self.probe, catalog=catalog, progress=progress,
                **self.option_values(),
            )  # fmt: skip
