"""What a head writes, drawn on its head page under each attention view.

From ``examples.json``'s ``writes`` (:func:`headmech.publish.examples.writes_record`, measured
by :func:`headmech.attribution.writes.head_writes`): the text's tokens shaded by the head's
direct effect on each one's next token (red raises it, blue lowers it; the exact value on
hover), then, at the position where that effect is largest, the tokens the head's write
raises and lowers most over the whole vocabulary. Plain HTML, no script.
"""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["WRITES_CSS", "writes_html"]

WRITES_CSS = "".join(
    [".writes-strip{line-height:1.9}.writes-strip i{font-style:normal;white-space:pre;"
     "padding:0 1px;border-radius:2px}"]
    + [f".wp{k}{{background:rgba(214,39,40,{0.12 * k:.2f})}}"
       f".wn{k}{{background:rgba(31,119,180,{0.12 * k:.2f})}}" for k in range(1, 6)]
)  # fmt: skip
"""The shades as a style sheet, for a notebook (:func:`headmech.publish.show.show`);
the atlas has them in site.css."""


def _level(value: float | None, top: float) -> str:
    """A CSS class of five shades each way (``wp1``..``wp5`` raise, ``wn1``..``wn5`` lower:
    site.css); ``""`` for none."""
    if value is None or top <= 0 or value == 0:
        return ""
    level = max(1, min(5, round(5 * abs(value) / top)))
    return f' class="w{"p" if value > 0 else "n"}{level}"'


def _tokens(pairs: list[list[Any]]) -> str:
    return ", ".join(f'<code class="tok">{escape(str(t))}</code> {v:+.3g}' for t, v in pairs)


def writes_html(tokens: list[str], w: dict[str, Any] | None) -> str:
    """The block for one text (``""`` where the head's writes were not recorded on it)."""
    if not w:
        return ""
    effects = w["effects"]
    top = max((abs(e) for e in effects if e is not None), default=0.0)
    strip = "".join(
        f"<i{_level(e, top)}" + ("" if e is None else f' title="{e:+.3g}"') + f">{escape(tok)}</i>"
        for tok, e in zip(tokens, effects, strict=False)
    )
    at = int(w["at"])
    here, nxt = tokens[at], tokens[at + 1] if at + 1 < len(tokens) else ""
    return (
        '<div class="writes"><p><b>What it writes</b> (direct effect on each next token\'s '
        "logit, the mean token's subtracted; red raises it, blue lowers it; hover for the "
        f'value):</p><p class="writes-strip">{strip}</p><p>Largest at '
        f'<code class="tok">{escape(here)}</code> (position {at}; next token '
        f'<code class="tok">{escape(nxt)}</code> {effects[at]:+.3g}): its write raises '
        f"{_tokens(w['promoted'])}; lowers {_tokens(w['suppressed'])}.</p>{_end(tokens, w)}</div>"
    )


def _end(tokens: list[str], w: dict[str, Any]) -> str:
    """The last token's write (where a prompt's answer is read; no next token to score)."""
    up, down = w.get("end") or ([], [])
    if not up or int(w["at"]) == len(tokens) - 1:
        return ""
    return (
        f'<p>At the last token, <code class="tok">{escape(tokens[-1])}</code> (where a '
        f"prompt's answer is read), its write raises {_tokens(up)}; lowers {_tokens(down)}.</p>"
    )
