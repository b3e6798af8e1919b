"""What one importance (or pruning) run is asked to do, checked once, before a model loads.

:class:`MethodSpec` is such a run's settings as one frozen, model-free object: the method
(a name in its registry), the method's typed options (its dataclass, checked), the task
and the probe options. :meth:`MethodSpec.create` is the only checker, in Python and on the
command line alike (:meth:`MethodSpec.from_args` turns ``--option KEY=VALUE``, ``--task``
and the probe sizes' flags into its keywords, naming the flag in an error).
:class:`ImportanceSpec` runs :func:`headmech.attribution.importance`'s methods;
:class:`headmech.pruning.spec.PruneSpec` the pruning methods.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from headmech.core import checks as V
from headmech.core.constraints import check
from headmech.core.errors import ArgumentError
from headmech.core.options import (
    PROBE_FLAG_NAMES,
    PROBE_PARAMETERS,
    ProbeOptions,
    build_options,
    parse_options,
)

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.attribution.result import ImportanceResult
    from headmech.core.registry import Registry
    from headmech.runs.resume import Units
    from headmech.stream.engine import ProbeBatch

__all__ = ["ImportanceSpec", "MethodSpec"]

N_BOOT = 200


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method's run, checked (:meth:`create`), model-free.

    Attributes:
        method: the method's name in :attr:`registry`.
        options: its options dataclass, checked (None: the method takes none).
        task: a task name (checked against the task registry) or a
            :class:`headmech.tasks.Task` given in Python.
        probe: the probe options (None: the defaults).
        given: the options as given (the result's ``details`` record these).
    """

    method: str
    options: Any
    task: Any
    probe: ProbeOptions | None = None
    given: dict[str, Any] = dataclasses.field(default_factory=dict)
    what: ClassVar[str] = "method"

    @classmethod
    def registry(cls) -> Registry[Any]:
        """The registry of the methods this spec runs."""
        raise NotImplementedError

    @classmethod
    def create(
        cls,
        method: str,
        task: Any = "lm",
        *,
        probe_options: ProbeOptions | None = None,
        **options: Any,
    ) -> Any:
        """The spec of ``method`` on ``task`` with its ``options`` (each checked once: the
        method's name, its options' names, types and values, the task's name).

        Raises:
            HeadmechError: one line (an unknown name with a close one suggested).
        """
        from headmech.core.registry import TASKS

        base = {f.name for f in dataclasses.fields(MethodSpec)}
        own = {f.name for f in dataclasses.fields(cls)} - base
        extra = cls.checked_own({k: options.pop(k) for k in own if k in options})
        entry = V.lookup(cls.registry(), method)
        given = V.method_options(dict(options))
        opts = build_options(entry, given)
        if isinstance(task, str):
            V.lookup(TASKS, task)
        if probe_options is not None and not isinstance(probe_options, ProbeOptions):
            raise ArgumentError(
                f"probe_options must be a ProbeOptions, got {type(probe_options).__name__}"
            )
        return cls(method, opts, task, probe_options, given, **extra)

    @classmethod
    def checked_own(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A subclass's own fields (``ImportanceSpec.n_boot``), checked (default: none)."""
        return values

    @classmethod
    def from_args(cls, args: Any) -> Any:
        """The spec of a command's parsed arguments: ``--method``, ``--option KEY=VALUE``
        (typed by the method's dataclass; ``--seed`` where it has a ``seed``), ``--task``
        (else the model's default task) and the probe sizes' flags."""
        from headmech.core.registry import MODELS

        entry = V.lookup(cls.registry(), args.method)
        options = parse_options(entry, getattr(args, "option", None) or [])
        if entry.options is not None and "seed" in {
            f.name for f in dataclasses.fields(entry.options)
        }:
            options.setdefault("seed", args.seed)
        options.update(cls.flag_options(args, options))
        task = args.task
        if task is None:
            task = MODELS.get(args.model).default_task if args.model in MODELS else "lm"
        flags = {k: getattr(args, PROBE_FLAG_NAMES.get(k, k), None) for k in PROBE_PARAMETERS}
        sizes = check(PROBE_PARAMETERS, flags, "cli", cls.what)
        probe = ProbeOptions(**{k: v for k, v in sizes.items() if v is not None})
        return cls.create(args.method, task, probe_options=probe, **options)

    @classmethod
    def flag_options(cls, args: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Options a command gives as flags of their own (pruning's ``--fraction``, ...)."""
        return {}

    def option_values(self) -> dict[str, Any]:
        """The method's options as keywords."""
        return dict(vars(self.options)) if self.options is not None else {}

    def task_name(self) -> str:
        """The task's name."""
        return (
            self.task if isinstance(self.task, str) else str(getattr(self.task, "name", self.task))
        )

    def to_json(self) -> dict[str, Any]:
        """The settings as the result's provenance and a resumable run's manifest record
        them."""
        from headmech.runs.provenance import options_json

        probe = None if self.probe is None else options_json(self.probe)
        return {
            "method": self.method,
            "options": {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.option_values().items()
            },
            "task": self.task_name(),
            "probe_options": probe,
        }


@dataclasses.dataclass(frozen=True)
class ImportanceSpec(MethodSpec):
    """An importance run (:data:`headmech.core.registry.METHODS`)."""

    n_boot: int = N_BOOT
    what: ClassVar[str] = "importance()"

    @classmethod
    def registry(cls) -> Registry[Any]:
        from headmech.core.registry import METHODS

        return METHODS

    @classmethod
    def checked_own(cls, values: dict[str, Any]) -> dict[str, Any]:
        n_boot = values.get("n_boot", N_BOOT)
        if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 0:
            raise ArgumentError(
                f"n_boot must be an integer of at least 0 (0: no interval), got {n_boot!r}"
            )
        return {"n_boot": n_boot}

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "n_boot": self.n_boot}

    def run(
        self,
        model: TransformerBridge,
        *,
        batches: list[ProbeBatch] | None = None,
        progress: bool = True,
        units: Units | None = None,
    ) -> ImportanceResult:
        """Score every head (:func:`headmech.attribution.runner.run_spec`)."""
        from headmech.attribution.runner import run_spec

        return run_spec(self, model, batches=batches, progress=progress, units=units)
