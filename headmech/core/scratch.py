"""Temporary folders that do not outlive their use.

A tiny model built for a test, a planted control model and a disk-offloaded model's
weights are written to a temporary folder. :func:`scratch_folder` makes one and removes
it with everything in it when its owner is garbage-collected, or when the Python process
exits: a test session that builds hundreds of tiny models, or a notebook that offloads an
8B model to disk, leaves nothing behind in the system's temporary directory.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

__all__ = ["scratch_folder"]


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def scratch_folder(prefix: str, owner: Any = None) -> Path:
    """A new empty folder ``<prefix>*`` in the system's temporary directory.

    Args:
        prefix: the start of the folder's name (e.g. ``"headmech-tiny-causal-"``).
        owner: an object whose garbage collection removes the folder (a model whose
            weights it holds); None: the folder lives until the process exits.

    Returns:
        The folder; it and its contents are removed when ``owner`` is collected or at
        the latest when the interpreter exits normally.
    """
    path = tempfile.mkdtemp(prefix=prefix)
    # a finalizer on a module-level sentinel runs at exit, like atexit, and can be
    # called early; one on the owner also runs when the owner goes
    weakref.finalize(_SENTINEL if owner is None else owner, _remove, path)
    return Path(path)


class _Sentinel:
    """Lives as long as the module: the owner of folders that live until exit."""


_SENTINEL = _Sentinel()
