"""A head type class's registry key and what ``headmech types`` shows of it, for the
head-type registry (:data:`headmech.core.registry.HEAD_TYPES`)."""

from __future__ import annotations

from typing import Any

from headmech.core.errors import PluginError

__all__ = ["head_type_fields", "head_type_name"]


def head_type_name(cls: Any, own: bool = False) -> str:
    """The ``name`` a head type class (or an instance's class) registers under (``own``:
    defined by the class itself, not inherited).

    Raises:
        PluginError: no ``name`` (a contributed type that forgot it), in one line naming
            the class and the file to add it in, with a name made from the class's.
    """
    cls = cls if isinstance(cls, type) else type(cls)
    name = cls.__dict__.get("name") if own else getattr(cls, "name", None)
    if isinstance(name, str) and name:
        return name
    import inspect
    import re

    try:
        where = inspect.getfile(cls)
    except (TypeError, OSError):
        where = f"module {cls.__module__}"
    stem = re.sub(r"Head$", "", cls.__name__) or cls.__name__
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()
    inherited = getattr(cls, "name", None)
    why = (
        f"defines no `name` of its own (it would inherit '{inherited}')"
        if isinstance(inherited, str) and inherited
        else "has no `name`"
    )
    raise PluginError(
        f"head type class {cls.__qualname__} {why}: add the class attribute "
        f'name = "{snake}" (snake_case, the registry key) to {cls.__qualname__} in {where}'
    )


def head_type_fields(cls: Any) -> dict[str, Any]:
    """What ``headmech types`` shows of a head type besides its description."""
    return {
        "reference": cls.reference,
        "citation": cls.citation,
        "causal_only": bool(cls.causal_only),
        "threshold": float(cls.default_threshold),
        "probe": cls.probe,
        "task": cls.task,
    }
