"""The agreement matrices of retrieval-head definitions, as published beside the catalogs.

``headmech compare-definitions MODEL --out catalog/MODEL`` writes
``catalog/MODEL/definitions.json`` (:class:`headmech.compare.AgreementMatrix`);
:func:`published_matrices` reads every one there, :func:`findings_block` writes them as
Markdown for docs/findings.md (between :data:`DEFS_BEGIN` and :data:`DEFS_END`: the suite
checks the block against the files), and the atlas's compare view renders the same rows
(:func:`matrix_rows`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "DEFS_BEGIN",
    "DEFS_END",
    "findings_block",
    "matrix_rows",
    "published_matrices",
    "replace_defs_block",
]

DEFS_BEGIN = (
    "<!-- agreement matrices: written by headmech.publish.agreement.findings_block; do not edit -->"
)
DEFS_END = "<!-- end of the agreement matrices -->"


def published_matrices(root: Path) -> dict[str, Any]:
    """model -> its :class:`~headmech.compare.AgreementMatrix`, for every
    ``root/<model>/definitions.json`` (in name order)."""
    from headmech.compare import AgreementMatrix

    return {p.parent.name: AgreementMatrix.load(p) for p in sorted(root.glob("*/definitions.json"))}


def _effect(c: dict[str, Any]) -> str:
    """``+1.21 (controls +0.01), p 0.010, q 0.020, n 99: validated``."""
    test = c.get("test") or {}
    if c.get("effect") is None or not test:
        return c.get("verdict", "not run")
    return (
        f"{c['effect']:+.2f} (controls {c['random_median']:+.2f}), p {test['p']:.3f}, "
        f"q {test['q']:.3f}, n {test['n']}: {c['verdict']}"
    )


def _kv(c: dict[str, Any] | None) -> str:
    """``1.33x (budget 75%, 2048 tokens)``: the KV compression a definition's ranking buys."""
    if not c:
        return "not measured"
    if c.get("compression") is None:
        return f"none (no budget up to {max(c['budgets']):.0%}, {c['context']} tokens)"
    return f"{c['compression']:.2f}x (budget {c['budget']:.0%}, {c['context']} tokens)"


def matrix_rows(matrix: Any) -> list[dict[str, Any]]:
    """One row per definition: its set (best first), mean relative depth, Jaccard with each
    definition, its effect per task (text) and the KV compression its ranking buys."""
    jac = matrix.jaccard()
    return [
        {
            "name": d,
            "top": [str(h) for h in matrix.top(d)],
            "depth": matrix.depth(d),
            "jaccard": jac[d],
            "effects": {t: _effect(c) for t, c in matrix.effects.get(d, {}).items()},
            "note": matrix.notes.get(d, ""),
            "kv": _kv(matrix.kv.get(d)),
        }
        for d in matrix.scores
    ]


def _table(model: str, matrix: Any) -> str:
    rows = matrix_rows(matrix)
    names = [r["name"] for r in rows]
    tasks = list(matrix.options.tasks)
    o = matrix.options
    head = [
        f"**{model}**: top {o.k} heads of each definition; {o.n_questions} questions, "
        f"CRI on {o.cri_questions}, needles of {', '.join(map(str, o.context))} tokens, "
        f"{o.mode} ablation, at most {o.n_random} control sets per claim"
        + (
            f" (each test on pieces of at least {o.control_tokens} tokens)"
            if o.control_tokens
            else ""
        )
        + f", Benjamini-Hochberg over the {len(names) * len(tasks)} claims; LOCOS on the "
        f"{o.locos_probe} probe. KV: the largest compression of the definition's ranking as "
        "a full-cache plan with " + _criteria(matrix) + ".",
        "",
        "| definition | set (best first) | depth | "
        + " | ".join(f"J {n}" for n in names)
        + "".join(f" | {t}" for t in tasks)
        + " | KV |",
        "|---|---|---|" + "---|" * (len(names) + len(tasks) + 1),
    ]
    for r in rows:
        top = " ".join(r["top"][:8]) + (" ..." if len(r["top"]) > 8 else "")
        cells = " | ".join(f"{r['jaccard'][n]:.2f}" for n in names)
        effects = "".join(f" | {r['effects'].get(t, '–')}" for t in tasks)
        head.append(f"| {r['name']} | {top} | {r['depth']:.2f} | {cells}{effects} | {r['kv']} |")
    return "\n".join(head)


def _criteria(matrix: Any) -> str:
    """The KV benchmark's criteria the matrix's KV column was measured under."""
    got = {c.get("criteria") for c in matrix.kv.values()} - {None}
    return " / ".join(sorted(got)) or "the KV benchmark's criteria (not measured)"


def findings_block(root: Path) -> str | None:
    """docs/findings.md's block of every published agreement matrix (None: none is)."""
    matrices = published_matrices(root)
    if not matrices:
        return None
    body = "\n\n".join(_table(m, x) for m, x in matrices.items())
    return "\n".join([DEFS_BEGIN, body, DEFS_END])


def replace_defs_block(text: str, block: str) -> str:
    """``text`` with the part from :data:`DEFS_BEGIN` to :data:`DEFS_END` replaced."""
    start, end = text.index(DEFS_BEGIN), text.index(DEFS_END) + len(DEFS_END)
    return text[:start] + block + text[end:]
