"""One family at two sizes: the cross-scale table of two published catalogs.

For the family published at two sizes (:data:`SCALE_FAMILY`: Qwen2.5-Coder 0.5B and 1.5B,
one tokenizer and training recipe), :func:`cross_scale_rows` reads each type's cell at
both sizes (:class:`headmech.publish.compare.Cell`: count, share, relative depth, verdict)
and how many of the larger model's labelled heads sit within one layer of the smaller
model (in relative depth) of one of its labelled heads, against the share of layers where a
head at random would; :func:`cross_scale_table` writes it as Markdown (docs/findings.md),
:func:`scale_findings` finding by finding, and the atlas's compare view renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headmech.publish.compare import Cell, probe_sizes, type_cell

__all__ = [
    "SCALE_BEGIN",
    "SCALE_END",
    "SCALE_FAMILY",
    "ScaleRow",
    "cross_scale_rows",
    "cross_scale_table",
    "findings_block",
    "replace_scale_block",
    "scale_findings",
]

SCALE_BEGIN = (
    "<!-- cross-scale table: written by headmech.publish.scale.cross_scale_table; do not edit -->"
)
SCALE_END = "<!-- end of the cross-scale table -->"
SCALE_FAMILY = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
"""The one family published at two sizes (the same tokenizer and training recipe)."""

# the findings a reader asks of two sizes of one family: type -> what it is
_SCALE_FINDINGS = {
    "induction": "induction heads",
    "retrieval": "retrieval heads",
    "name_mover": "IOI name movers",
    "s_inhibition": "IOI S-inhibition heads",
    "negative_name_mover": "IOI negative name movers",
    "successor": "successor heads",
    "attention_sink": "attention sinks",
}


@dataclass(frozen=True)
class ScaleRow:
    """One type at two sizes of a family."""

    small: Cell
    large: Cell
    small_depths: tuple[float, ...]  # the labelled heads' relative depths
    large_depths: tuple[float, ...]
    matched: int  # the larger model's labelled heads at a depth where the smaller has one
    tolerance: float  # one layer of the smaller model, in relative depth
    chance: float  # the share of the larger model's layers at such a depth (heads at random)

    def same_depth(self) -> str:
        """``5 of 8 (chance 0.45)``: the larger model's labelled heads within one layer of
        the smaller model of one of its labelled heads, and the share a head at a random
        layer would reach; ``–`` where either size labels none."""
        if not self.large_depths or not self.small_depths:
            return "–"
        return f"{self.matched} of {len(self.large_depths)} (chance {self.chance:.2f})"

    def band(self, large: bool) -> str:
        """The labelled heads' relative depths, ``0.39-0.70`` (or ``–``)."""
        d = self.large_depths if large else self.small_depths
        return f"{min(d):.2f}-{max(d):.2f}" if d else "–"


def _depths(data: dict[str, Any], name: str) -> tuple[float, ...]:
    m = data["model"]
    heads = data["types"].get(name, {}).get("heads", [])
    return tuple(sorted(la / max(m["n_layers"] - 1, 1) for la, _ in heads))


def cross_scale_rows(root: Path, small: str, large: str) -> dict[str, ScaleRow]:
    """type -> :class:`ScaleRow` for two published sizes of one family: each size's cell
    (count, share, median relative depth, verdict) and how many of the larger model's
    labelled heads sit within one layer of the smaller model (in relative depth) of one
    of its labelled heads of the type."""
    data = {m: json.loads((root / m / "catalog.json").read_text()) for m in (small, large)}
    runs = {m: json.loads((root / m / "run.json").read_text()) for m in (small, large)}
    tol = 1 / max(data[small]["model"]["n_layers"] - 1, 1)
    n_large = data[large]["model"]["n_layers"]
    layers = [la / max(n_large - 1, 1) for la in range(n_large)]

    def near(d: float, depths: tuple[float, ...]) -> bool:
        return any(abs(d - e) <= tol + 1e-9 for e in depths)

    out = {}
    for name in sorted(set(data[small]["types"]) | set(data[large]["types"])):
        a, b = _depths(data[small], name), _depths(data[large], name)
        out[name] = ScaleRow(
            type_cell(data[small], runs[small], name), type_cell(data[large], runs[large], name),
            a, b, sum(near(d, a) for d in b), tol, sum(near(d, a) for d in layers) / n_large,
        )  # fmt: skip
    return out


def cross_scale_table(root: Path, small: str, large: str) -> str:
    """The Markdown table of two sizes of one family, a row per type: each size's
    labelled heads (share), the band of their relative depths and the primary verdict,
    and how many of the larger model's heads sit at a depth where the smaller has one."""
    rows = cross_scale_rows(root, small, large)
    sizes = probe_sizes(root, [small, large])
    lines = [
        f"| type | `{small}` | depths | `{large}` | depths | {large} heads at a {small} head's depth (±1 of its layers) |",
        "|---|---|---|---|---|---|",
    ]
    flag = "⚠ " if sizes[small] != sizes[large] else ""
    lines.append(
        f"| *probe sizes* | {flag}{sizes[small].text()} | | {flag}{sizes[large].text()} | | |"
    )
    for name, r in rows.items():
        lines.append(
            f"| `{name}` | {r.small.text()} | {r.band(False)} | {r.large.text()} | "
            f"{r.band(True)} | {r.same_depth()} |"
        )
    return "\n".join(lines) + "\n"


def scale_findings(root: Path, small: str, large: str) -> list[str]:
    """One line per finding of :data:`_SCALE_FINDINGS`: count, share, depth band and
    verdict at each size, and whether the larger model's heads sit where the smaller's do."""

    def said(c: Cell, band: str) -> str:
        return c.said(f"depths {band}")

    rows = cross_scale_rows(root, small, large)
    lines = []
    for name, what in _SCALE_FINDINGS.items():
        if name not in rows:
            continue
        r = rows[name]
        where = (
            f"; {r.matched} of {len(r.large_depths)} of the {large} heads within one {small} "
            f"layer of one of its heads (at random layers: {r.chance:.0%})"
            if r.large_depths and r.small_depths
            else ""
        )
        lines.append(
            f"- {what}: {small} {said(r.small, r.band(False))}; "
            f"{large} {said(r.large, r.band(True))}{where}."
        )
    return lines


def findings_block(root: Path) -> str | None:
    """docs/findings.md's cross-scale section body between :data:`SCALE_BEGIN` and
    :data:`SCALE_END`: the table of :data:`SCALE_FAMILY` and its findings, finding by
    finding; None until both sizes are published under ``root``."""
    small, large = SCALE_FAMILY
    if not all((root / m / "catalog.json").is_file() for m in SCALE_FAMILY):
        return None
    findings = "\n".join(scale_findings(root, small, large))
    return "\n".join([SCALE_BEGIN, cross_scale_table(root, small, large), findings, SCALE_END])


def replace_scale_block(text: str, block: str) -> str:
    """``text`` with the part from :data:`SCALE_BEGIN` to :data:`SCALE_END` replaced."""
    start, end = text.index(SCALE_BEGIN), text.index(SCALE_END) + len(SCALE_END)
    return text[:start] + block + text[end:]
