"""The committed index of the registries' built-in entries
(:mod:`headmech.core.registry_index`), written again by :func:`build_index` (``make
index``); tests/test_registry_index.py checks it is current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["build_index"]


def build_index(write: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """The index of the built-in entries of the registries in :data:`INDEXED` (loads
    them: seconds); with ``write``, written to ``headmech/core/registry_index.py``."""
    from headmech.core.registry import (
        HEAD_TYPES,
        INDEXED,
        METHODS,
        MODELS,
        PRUNING_METHODS,
        TASKS,
    )  # fmt: skip

    registries = {r.kind: r for r in (HEAD_TYPES, METHODS, MODELS, PRUNING_METHODS, TASKS)}
    out = {}
    for kind in INDEXED:
        r = registries[kind]
        r.load()
        out[kind] = {e.name: {"summary": e.summary, **r._fields(e.obj)} for e in r.entries()}
    if write:
        body = json.dumps(out, indent=1, sort_keys=True, ensure_ascii=False)
        body = (
            body.replace(": true", ": True")
            .replace(": false", ": False")
            .replace(": null", ": None")
        )
        Path(__file__).with_name("registry_index.py").write_text(
            '"""The built-in entries of the registries the command line lists, written by\n'
            "``headmech.core.index.build_index(write=True)``; do not edit (tests check it\n"
            'is current)."""\n\n'
            "from typing import Any\n\n"
            f"INDEX: dict[str, dict[str, dict[str, Any]]] = {body}\n",
            encoding="utf-8",
        )
    return out
