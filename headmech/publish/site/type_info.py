"""What a type's page says of the type itself, read from its registered class: the
docstring's definition as HTML (RST inline markup converted), its citation, threshold and
why that threshold (:func:`type_info`)."""

from __future__ import annotations

import html
import inspect
import re
from typing import Any

__all__ = ["rst_html", "type_info"]


_RST = [
    (re.compile(r"``(.+?)``"), r"<code>\1</code>"),
    (re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`<]+?)(?:\s*<[^`]*>)?`"), r"<code>\1</code>"),
    (re.compile(r"`([^`]+?)`_?"), r"<em>\1</em>"),
    (re.compile(r"(?<![\w*])\*\*(\S(?:.*?\S)?)\*\*(?![\w*])"), r"<b>\1</b>"),
    (re.compile(r"(?<![\w*])\*(\S(?:.*?\S)?)\*(?![\w*])"), r"<em>\1</em>"),
]


def rst_html(text: str) -> str:
    """A docstring paragraph as HTML: the text escaped, then RST's inline markup converted
    (double backticks and roles such as :func: as code, single and double stars as
    emphasis and bold)."""
    out = html.escape(text, quote=False)
    for pattern, repl in _RST:
        out = pattern.sub(repl, out)
    return out


def _is_args(paragraph: str) -> bool:
    """A docstring's ``Args:``/``Attributes:`` section (the class's parameters), not prose."""
    return bool(re.match(r"(Args|Arguments|Attributes|Parameters|Returns|Raises)\s*:", paragraph))


def _threshold_why(cls: type) -> list[str]:
    """The docstring paragraphs about the threshold, and the comment on the line that sets
    ``default_threshold`` in the class's source."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    why = [p.replace("\n", " ") for p in doc.split("\n\n") if "threshold" in p.lower()]
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    comment = re.search(r"default_threshold\s*=\s*[^#\n]*#\s*(.+)", source)
    lines = ([comment[1].strip()] if comment else []) + why
    # "see the docstring" and "Args: threshold ..." say nothing on a page that shows it
    return [rst_html(w) for w in lines if "docstring" not in w.lower() and not _is_args(w)]


def type_info(name: str) -> dict[str, Any]:
    """A registered type's definition, citation and default threshold (empty fields when
    the type is no longer registered)."""
    from headmech.headtypes.registry import head_types

    cls = head_types().get(name)
    if cls is None:
        return {"name": name, "description": "", "definition": [], "citation": "", "why": []}
    doc = inspect.cleandoc(cls.__doc__ or "").split("References:")[0]
    return {
        "name": name,
        "description": cls.description,
        "definition": [
            rst_html(p.replace("\n", " "))
            for p in doc.split("\n\n")
            if p.strip() and not _is_args(p)
        ],
        "citation": cls.citation or cls.reference,
        "reference": cls.reference,
        "default_threshold": cls.default_threshold,
        "threshold_note": rst_html(getattr(cls, "threshold_note", "") or ""),
        "probe": cls.probe,
        "task": cls.task,
        "claims": ", ".join(cls().claim_kinds()),
        "why": _threshold_why(cls),
    }
