"""One registry for every extension point: head types, probes, tasks, methods, models, pruning.

A :class:`Registry` maps names to objects (a head-type class, a task factory, a method
function, a model loader, ...) with a one-line summary and, where the object takes
options, a dataclass of typed options. Registration is explicit: a module calls
``REGISTRY.register(name, obj)`` (or uses it as a decorator), and a registry imports its
built-in modules itself, once, before the first lookup, so what is registered never
depends on what the caller happened to import first. Third-party packages add entries
through the Python entry-point group ``headmech.<kind>`` (for example
``headmech.tasks``), loaded after the built-ins; an entry point names the object to
register (a head-type class, a task factory, ...).

Importing the built-ins imports torch and transformers (seconds). What the command line
shows before any work (names, summaries, a mistyped name's "did you mean") is read from
:mod:`headmech.core.registry_index`, a committed index of the built-ins (written by
:func:`headmech.core.index.build_index`), while nothing else can have been added (no entry
point, no ``$HEADMECH_CATALOG_PATH``); the first lookup of an object loads the registry.

Examples:
    >>> from headmech.core.registry import Registry
    >>> colours = Registry("colours")
    >>> _ = colours.register("red", "#f00", summary="the colour of blood")
    >>> colours.get("red"), colours.names()
    ('#f00', ['red'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from headmech.core.errors import (
    HeadmechError,
    InputError,
    PluginError,
    UnknownHeadTypeError,
    UnknownMethodError,
    UnknownModelError,
    UnknownTaskError,
    suggestion,
)
from headmech.core.head_type_names import head_type_fields, head_type_name

__all__ = [
    "CLAIMS",
    "HEAD_TYPES",
    "METHODS",
    "MODELS",
    "PROBES",
    "PRUNING_METHODS",
    "TASKS",
    "Entry",
    "Registry",
    "head_type_name",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered object with its name, one-line summary and options dataclass."""

    name: str
    obj: T
    summary: str = ""
    options: type | None = None


@functools.lru_cache(maxsize=32)
def _has_plugins(group: str, finder: Any) -> bool:
    """Whether an entry point is installed in ``group``: scanned once a process (8 ms a
    scan; a command's checks ask several times), a swapped finder gets a scan of its own."""
    return any(True for _ in finder(group=group))


class Registry(Generic[T]):
    """Names → objects of one kind, loaded from built-in modules and entry points.

    Args:
        kind: what the entries are (``"head_types"``, ``"tasks"``, ...); the entry-point
            group is ``headmech.<kind>``.
        builtins: modules that register the built-in entries, imported on first lookup.
        loader: called with the registry on first lookup, after ``builtins``, for entries
            found at run time (head-type files in folders; a built-in module may set it
            when imported: :meth:`set_loader`).
        error: the :class:`~headmech.core.errors.HeadmechError` raised for an unknown name.
        on_load: called with each object an entry point loads, returning ``(name, obj,
            summary)`` to register (default: the entry point's own name and object).
        describe: an entry's fields beyond its summary (:meth:`metadata`, the index).
        extra_env: a variable naming more places entries come from (no index while set).
    """

    def __init__(
        self,
        kind: str,
        *,
        builtins: Sequence[str] = (),
        loader: Callable[[Registry[Any]], None] | None = None,
        error: type[HeadmechError] = HeadmechError,
        on_load: Callable[[str, Any], tuple[str, Any, str]] | None = None,
        describe: Callable[[Any], dict[str, Any]] | None = None,
        extra_env: str | None = None,
    ) -> None:
        self.kind = kind
        self._describe = describe
        self._extra_env = extra_env
        self.group = f"headmech.{kind}"
        self._builtins = tuple(builtins)
        self._loader = loader
        self._error = error
        self._on_load = on_load
        self._entries: dict[str, Entry[T]] = {}
        self._loaded = False

    # --- registration -----------------------------------------------------------
    def register(
        self,
        name: str,
        obj: Any = None,
        *,
        summary: str = "",
        options: type | None = None,
        replace: bool = False,
    ) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, a decorator that does.

        Registering a second, different object under a taken name is refused
        (:class:`~headmech.core.errors.PluginError`, a ``ValueError``, naming both) unless
        ``replace``; registering the same definition again (a
        re-imported module, a reloaded notebook cell) is allowed.
        """
        if obj is None:
            return lambda o: self.register(
                name, o, summary=summary, options=options, replace=replace
            )
        if options is not None and not dataclasses.is_dataclass(options):
            raise TypeError(f"options of {self.kind} '{name}' must be a dataclass")
        old = self._entries.get(name)
        if old is not None and not replace and not _same_definition(old.obj, obj):
            what = self.kind.rstrip("s").replace("_", " ")
            raise PluginError(
                f"{what} '{name}' is already registered by {_where(old.obj)}; "
                f"refusing {_where(obj)} under the same name"
            )
        summary = summary or _first_line(obj)
        self._entries[name] = Entry(name, obj, summary, options)
        return obj

    def set_loader(self, loader: Callable[[Registry[Any]], None]) -> None:
        """Set the function called with the registry on each load, after the built-in
        modules: a built-in module that finds entries at run time (the head-type catalog,
        which also reads folders) sets it when imported, so the registry needs no import
        of the layer above it."""
        self._loader = loader

    def unregister(self, name: str) -> None:
        """Remove an entry (tests and notebooks)."""
        self._entries.pop(name, None)

    # --- lookup -------------------------------------------------------------------
    def load(self) -> None:
        """Import the built-in modules and entry points once (every lookup calls this)."""
        if self._loaded:
            return
        self._loaded = True
        try:
            for mod in self._builtins:
                importlib.import_module(mod)
            if self._loader is not None:
                self._loader(self)
            for ep in entry_points(group=self.group):
                self._load_entry_point(ep)
        except BaseException:
            self._loaded = False  # a broken plug-in: fail again next time, not silently
            raise

    def _load_entry_point(self, ep: Any) -> None:
        try:
            obj = ep.load()
        except Exception as e:
            raise HeadmechError(
                f"entry point '{ep.name}' of {self.group} ({ep.value}) fails to load: "
                f"{type(e).__name__}: {e}"
            ) from None
        name, obj, summary = self._on_load(ep.name, obj) if self._on_load else (ep.name, obj, "")
        self.register(name, obj, summary=summary, options=getattr(obj, "options", None))

    def reload(self) -> None:
        """Load built-in modules, folders and entry points again on the next lookup."""
        self._loaded = False

    @contextlib.contextmanager
    def isolated(self) -> Iterator[Registry[T]]:
        """Within the block, changes to the registry (a reload that finds a plug-in, an
        explicit registration) are undone on exit (tests, notebooks)."""
        self.load()  # the built-ins belong to the state that is restored
        entries, loaded = dict(self._entries), self._loaded
        try:
            yield self
        finally:
            self._entries, self._loaded = entries, loaded

    def _indexed(self) -> dict[str, dict[str, Any]] | None:
        """The committed index's entries (with any registered explicitly), while the
        registry is not loaded and nothing but the built-ins can be in it; else None."""
        if self._loaded:
            return None
        from headmech.core.registry_index import INDEX

        if self.kind not in INDEX or (self._extra_env and os.environ.get(self._extra_env)):
            return None
        if _has_plugins(self.group, entry_points):
            return None
        out = dict(INDEX[self.kind])
        for name, e in self._entries.items():
            out[name] = {"summary": e.summary, **self._fields(e.obj)}
        return out

    def _fields(self, obj: Any) -> dict[str, Any]:
        return self._describe(obj) if self._describe is not None else {}

    def metadata(self) -> dict[str, dict[str, Any]]:
        """Name → ``{"summary": ..., **fields}`` of every entry, sorted by name: from the
        committed index where it holds (no import of the built-ins), else loaded."""
        got = self._indexed()
        if got is None:
            got = {e.name: {"summary": e.summary, **self._fields(e.obj)} for e in self.entries()}
        return {n: got[n] for n in sorted(got)}

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name``; a one-line error listing the known names otherwise, with
        a close name suggested (``(did you mean 'induction'?)``) where there is one (an
        unknown name is told from the index, without loading)."""
        index = self._indexed()
        if index is None or name in index:
            self.load()
        if name not in self._entries:
            known = ", ".join(self.names()) or "(none)"
            what = self.kind.rstrip("s").replace("_", " ")
            hint = suggestion(str(name), self.names())
            raise self._error(f"unknown {what} '{name}' (have: {known}){hint}")
        return self._entries[name]

    def get(self, name: str) -> T:
        """The object registered as ``name``."""
        return self.entry(name).obj

    def names(self) -> list[str]:
        """Registered names, sorted."""
        index = self._indexed()
        if index is not None:
            return sorted(index)
        self.load()
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        """Registered entries, sorted by name (their objects: the registry is loaded)."""
        self.load()
        return [self._entries[n] for n in sorted(self._entries)]

    def help(self) -> str:
        """``name: summary`` for each entry, comma-separated (CLI help text)."""
        rows = self.metadata().items()
        return "; ".join(f"{n}: {m['summary']}" if m["summary"] else n for n, m in rows)

    def __contains__(self, name: object) -> bool:
        index = self._indexed()
        if index is not None:
            return name in index
        self.load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


def _first_line(obj: Any) -> str:
    doc = getattr(obj, "summary", None) or getattr(obj, "description", None)
    if not doc and callable(obj):
        doc = obj.__doc__
    doc = doc or ""
    return str(doc).strip().splitlines()[0].rstrip(".") if str(doc).strip() else ""


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _same_definition(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    ) and getattr(a, "__qualname__", None) is not None


# --- the extension points ----------------------------------------------------------------


HEAD_TYPES: Registry[Any] = Registry(
    "head_types",
    builtins=("headmech.headtypes",),
    error=UnknownHeadTypeError,
    on_load=lambda ep_name, cls: (head_type_name(cls), cls, getattr(cls, "description", "")),
    describe=head_type_fields,
    extra_env="HEADMECH_CATALOG_PATH",
)
PROBES: Registry[Any] = Registry(
    "probes",
    builtins=(
        "headmech.probes",
        "headmech.probes.prose",
        "headmech.probes.needle",
        "headmech.probes.ordinal",
        "headmech.probes.ioi",
        "headmech.probes.icl",
        "headmech.probes.domains",
        "headmech.probes.words",
        "headmech.probes.agreement",
        "headmech.probes.facts",
        "headmech.probes.nonliteral",
        "headmech.probes.documents",
        "headmech.probes.refusal",
    ),
    error=InputError,
)
TASKS: Registry[Any] = Registry(
    "tasks",
    builtins=(
        "headmech.tasks",
        "headmech.tasks.data",
        "headmech.tasks.copying",
        "headmech.tasks.refusal",
        "headmech.tasks.words",
    ),
    error=UnknownTaskError,
)
METHODS: Registry[Any] = Registry(
    "methods", builtins=("headmech.attribution",), error=UnknownMethodError
)
MODELS: Registry[Any] = Registry("models", builtins=("headmech.models",), error=UnknownModelError)
# the registries the command line lists before any work (the committed index holds them)
INDEXED = ("head_types", "methods", "models", "pruning_methods", "tasks")
CLAIMS: Registry[Any] = Registry(
    "claims",
    builtins=("headmech.classification.claim_types", "headmech.classification.sinks"),
    error=InputError,
)
PRUNING_METHODS: Registry[Any] = Registry(
    "pruning_methods", builtins=("headmech.pruning",), error=UnknownMethodError
)
