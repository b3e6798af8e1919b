"""A validation's test drawn as a strip: every control set's value, and the labelled set's.

The atlas's type and model pages show how a verdict was reached: each control set of the
Monte Carlo test (:mod:`headmech.classification.montecarlo`) as a tick on one axis, the
labelled set's value as a bar across it, so a reader sees at once whether the labelled
heads stand apart. An inline SVG (no script, offline, printable).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

__all__ = ["strip_svg"]

WIDTH, HEIGHT, PAD = 260, 34, 8


def strip_svg(controls: Sequence[float], labelled: float | None, what: str = "control sets") -> str:
    """The SVG: ``controls`` as grey ticks, ``labelled`` as a dark bar, on a shared axis
    from the least to the greatest value (the axis ends labelled); "" without controls."""
    values = [float(c) for c in controls if c == c]
    if not values or labelled is None:
        return ""
    lo, hi = min([*values, labelled]), max([*values, labelled])
    span = (hi - lo) or 1.0

    def x(v: float) -> float:
        return round(PAD + (WIDTH - 2 * PAD) * (v - lo) / span, 1)

    ticks = "".join(
        f'<line x1="{x(v)}" x2="{x(v)}" y1="6" y2="20" stroke="#8a8a8a" stroke-opacity="0.6"/>'
        for v in values
    )
    title = escape(
        f"{len(values)} {what} (grey) from {min(values):+.3g} to {max(values):+.3g}; "
        f"the labelled heads (black) {labelled:+.3g}"
    )
    return (
        f'<svg class="strip" role="img" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}"><title>{title}</title>'
        f'<line x1="{PAD}" x2="{WIDTH - PAD}" y1="20" y2="20" stroke="#555"/>{ticks}'
        f'<rect x="{x(labelled) - 1.5}" y="2" width="3" height="22" fill="#111"/>'
        f'<text x="{PAD}" y="32" font-size="9">{lo:+.3g}</text>'
        f'<text x="{WIDTH - PAD}" y="32" font-size="9" text-anchor="end">{hi:+.3g}</text></svg>'
    )
