"""Declarative checks of a command's settings: one table per command, one checker.

A command's parameters are listed once, as :class:`Param` entries in a table (the way
scikit-learn's estimators declare ``_parameter_constraints``): the keyword, the command
line's flag, the rule a value must meet and, for the command line, how the flag's text
becomes the keyword's value. :func:`check` reads a whole set of values against the
table; an error is one line naming the flag when the values came from the command line
and the keyword when they came from Python, with a close name suggested for an unknown
keyword. :mod:`headmech.classification.spec` holds the table of ``classify``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from headmech.core.errors import ArgumentError, InputError, suggestion

__all__ = ["Boolean", "Integer", "Param", "Rule", "check", "label"]

Origin = Literal["python", "cli"]


class Rule:
    """What a value must be; :meth:`check` returns it (normalised) or raises."""

    def check(self, value: Any, name: str) -> Any:
        """``value`` if it meets the rule; a one-line error naming ``name`` otherwise."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Integer(Rule):
    """An ``int`` (not a bool) in ``[low, high]``; ``why`` explains the upper bound."""

    low: int = 1
    high: int | None = None
    why: str = ""

    def describe(self) -> str:
        """The rule in words, as an error message states it."""
        return "a positive integer" if self.low == 1 else f"an integer of at least {self.low}"

    def check(self, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.low:
            raise InputError(f"{name} must be {self.describe()}, got {value!r}")
        if self.high is not None and value > self.high:
            why = f" ({self.why})" if self.why else ""
            raise InputError(f"{name} must be at most {self.high}{why}, got {value}")
        return value


@dataclasses.dataclass(frozen=True)
class Boolean(Rule):
    """``True`` or ``False``."""

    def check(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise InputError(f"{name} must be True or False, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class Custom(Rule):
    """A rule written as a function of (value, name)."""

    fn: Callable[[Any, str], Any]

    def check(self, value: Any, name: str) -> Any:
        return self.fn(value, name)


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a command.

    Attributes:
        rule: what its value must be (None: anything; the consumer checks it).
        flag: its command line flag (``"--n-random"``); None: a keyword of Python alone.
        parse: how the flag's text becomes the keyword's value (called with the text and
            the flag; None: argparse's value as it is).
        default: its value when not given (None is never checked).
    """

    rule: Rule | None = None
    flag: str | None = None
    parse: Callable[[Any, str], Any] | None = None
    default: Any = None


def label(table: Mapping[str, Param], key: str, origin: Origin) -> str:
    """How an error names the parameter ``key``: its flag from the command line, the
    keyword from Python."""
    param = table.get(key)
    if origin == "cli" and param is not None and param.flag is not None:
        return param.flag
    return key


def check(
    table: Mapping[str, Param], values: Mapping[str, Any], origin: Origin, what: str
) -> dict[str, Any]:
    """Every parameter of ``table``: the value given (parsed from its flag's text when
    ``origin`` is ``"cli"``), checked against its rule, or its default.

    Args:
        table: the command's parameters.
        values: the keywords given (from the command line: the parsed arguments; names
            the table does not know are left to the caller there).
        origin: ``"python"`` (an unknown keyword is an error) or ``"cli"``.
        what: the command, as an unknown keyword's error names it (``"classify()"``).

    Raises:
        ArgumentError: an unknown keyword from Python (a close name suggested).
        InputError: a value that breaks its rule (one line naming the flag or keyword).
    """
    if origin == "python":
        unknown = [k for k in values if k not in table]
        if unknown:
            hint = suggestion(unknown[0], list(table))
            raise ArgumentError(
                f"{what} got an unknown keyword {unknown[0]!r}{hint} "
                f"(it takes {', '.join(sorted(table))})"
            )
    out: dict[str, Any] = {}
    for key, param in table.items():
        value = values.get(key)
        name = label(table, key, origin)
        if value is None:
            out[key] = param.default
            continue
        if origin == "cli" and param.parse is not None:
            value = param.parse(value, name)
        out[key] = param.rule.check(value, name) if param.rule is not None else value
    return out
