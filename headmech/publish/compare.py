"""Head types across models: the cross-model table of the published catalogs.

For every head type, and every published model, :func:`cross_model_rows` reads from the
``catalog.json`` files alone (no model is loaded) how many heads carry the type, their
share of all the model's heads, where they sit (relative depth: layer / (n_layers - 1),
0 the first layer, 1 the last) and the validation effect against the controls; and
:func:`cross_model_table` writes them as the Markdown table of ``catalog/README.md`` and
the README, with what the literature reports beside it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headmech.classification.records import TypeValidation, validation_of

__all__ = [
    "BEGIN",
    "END",
    "LITERATURE",
    "Cell",
    "DECODERS",
    "ProbeSize",
    "cross_model_rows",
    "cross_model_table",
    "probe_size",
    "probe_sizes",
    "readme_block",
    "replace_block",
    "shared_findings",
    "shared_types",
]

BEGIN = (
    "<!-- cross-model table: written by `make catalog` (headmech.publish.compare); do not edit -->"
)
END = "<!-- end of the cross-model table -->"
DECODERS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
"""The published real decoders, compared type by type."""
PUBLISHED = [*DECODERS, "minilm-l6"]

# what a reader asks of the decoders together, type by type (the questions)
_FINDINGS: dict[str, str] = {
    "induction": "induction heads",
    "retrieval": "retrieval heads (Wu et al.: 3-6% of heads)",
    "attention_sink": "attention sinks",
    "copy_suppression": "copy suppression",
    "name_mover": "IOI name movers",
    "negative_name_mover": "IOI negative name movers",
    "s_inhibition": "IOI S-inhibition",
}

LITERATURE: dict[str, str] = {
    "attention_sink": "sinks in all 30 open LMs tested (Gu et al. 2025)",
    "copy_suppression": "GPT-2 small L10H7 (McDougall et al. 2023)",
    "duplicate_token": "GPT-2 small L0H1, L0H10, L3H0 (Wang et al. 2022)",
    "function_vector": "a few mid-layer heads carry the task (Todd et al. 2023)",
    "induction": "in every model with 2+ layers that Olsson et al. 2022 looked at",
    "name_mover": "GPT-2 small L9H6, L9H9, L10H0 (Wang et al. 2022)",
    "negative_name_mover": "GPT-2 small L10H7, L11H10 (Wang et al. 2022)",
    "positional": "NMT encoder, 1-2 heads per layer (Voita et al. 2019)",
    "previous_token": "feeds induction heads in every model studied (Olsson et al. 2022)",
    "rare_word": "first layer of an NMT encoder (Voita et al. 2019)",
    "retrieval": "3-6% of heads in every family tested (Wu et al. 2024)",
    "s_inhibition": "GPT-2 small L7H3, L7H9, L8H6, L8H10 (Wang et al. 2022)",
    "successor": "GPT-2 small L9H1, in Pythia and Llama too (Gould et al. 2023)",
    "syntactic": "dependency relations in NMT encoder heads (Voita et al. 2019)",
}
"""What the paper of each type reports, one line (see ../shared/REFERENCES.md)."""


@dataclass(frozen=True)
class Cell:
    """One type on one model."""

    n_heads: int  # labelled heads
    share: float  # of all heads
    depth: float | None  # median relative depth of the labelled heads
    effect: float | None  # validation: ablated minus clean
    control: float | None  # the controls' median effect
    note: str  # "n/a: <reason>" when the type does not apply
    verdict: str = ""  # the primary claim's verdict (headmech.classification.montecarlo)
    rejected: int = 0  # heads at or above the threshold not labelled
    test: str = ""  # the primary claim's test: p, q, n
    others: str = ""  # the other claims' verdicts: "ablation validated"
    backups: int = 0  # heads above the threshold found to be backups

    def said(self, where: str) -> str:
        """``3 (4.2%) at <where>, validated``, ``none``, or why the type does not apply."""
        if self.note:
            return self.note
        if not self.n_heads:
            return "none"
        verdict = f", {self.verdict}" if self.verdict else ""
        return f"{self.n_heads} ({100 * self.share:.1f}%) at {where}{verdict}"

    def text(self) -> str:
        """``3 (4.2%), depth 0.71; +6.95 vs +0.20 (p 0.01, q 0.012, n 99): validated`` or
        the reason it does not apply (a type without heads shows no effect)."""
        if self.note:
            return self.note
        more = f"; {self.rejected} above the threshold not labelled" if self.rejected else ""
        more += f"; {self.backups} backup{'s' if self.backups != 1 else ''}" if self.backups else ""
        if not self.n_heads:
            return "none" + more
        out = f"{self.n_heads} ({100 * self.share:.1f}%), depth {self.depth:.2f}"
        if self.effect is not None:
            vs = f"{self.control:+.3g}" if self.control is not None else "no control"
            out += f"; {self.effect:+.3g} vs {vs}"
            out += f" ({self.test})" if self.test else ""
        if self.verdict:
            out += f": **{self.verdict}**"
        if self.others:
            out += f" (also {self.others})"
        return out + more


def type_cell(data: dict[str, Any], run: dict[str, Any], name: str) -> Cell:
    """One model's published record of one type, as the cross-model tables show it."""
    m = data["model"]
    if name not in data["types"]:
        reason = run.get("skipped", {}).get(name, "not published")
        short = "encoder" if "decoder" in reason or "causal" in reason else reason.split(":")[0]
        return Cell(0, 0.0, None, None, None, f"n/a ({short})")
    from headmech.classification.montecarlo import describe_test

    t = data["types"][name]
    heads = t["heads"]
    depths = [la / max(m["n_layers"] - 1, 1) for la, _ in heads]
    v = validation_of(t)
    c = v.primary if v is not None and heads else None
    others = ", ".join(f"{k}: {o.verdict}" for k, o in v.secondary.items()) if v else ""
    return Cell(
        len(heads),
        len(heads) / (m["n_layers"] * m["n_heads"]),
        statistics.median(depths) if depths else None,
        c.effect if c else None,
        c.random_median if c else None,
        "",
        c.verdict if c else "",
        len(t.get("not_labelled") or []),
        describe_test(c.test) if c else "",
        others if heads else "",
        len(t.get("backups") or []),
    )


@dataclass(frozen=True)
class ProbeSize:
    """The probe sizes a catalog was published at, as its provenance records them."""

    sentences: int
    sequences: int
    contexts: tuple[int, ...]  # needle haystack lengths (tokens)
    controls: int | None  # the most control sets any claim could draw (None: not validated)

    def text(self) -> str:
        """``48 sentences, 12 sequences, haystacks 300-1100, <= 99 control sets``."""
        ctx = (
            f"{self.contexts[0]}-{self.contexts[-1]}"
            if len(self.contexts) > 1
            else str(self.contexts[0])
        )
        controls = f"<= {self.controls} control sets" if self.controls else "not validated"
        return (
            f"{self.sentences} sentences, {self.sequences} sequences, haystacks {ctx}, {controls}"
        )


def _n_max(v: TypeValidation | None) -> int:
    """The largest ``n_max`` of any Monte Carlo test (control sets, not the permutations of
    a dose-response) of a type's claims."""
    tests = [c.test for c in v.tested()] if v is not None else []
    return max(
        [0, *(t.n_max for t in tests if t is not None and t.method.startswith("Monte Carlo"))]
    )


def probe_size(data: dict[str, Any]) -> ProbeSize | None:
    """A catalog's probe sizes (``provenance.probe_options``) and the most control sets any
    of its claims could draw; None where it does not record them (written by hand, or old)."""
    o = (data.get("provenance") or {}).get("probe_options")
    if not o:
        return None
    n = max([0, *(_n_max(validation_of(t)) for t in data["types"].values())])
    return ProbeSize(o["n_sentences"], o["n_sequences"], tuple(o["needle_lengths"]), n or None)


def probe_sizes(root: Path, models: list[str]) -> dict[str, ProbeSize]:
    """Each published model's :func:`probe_size`; a catalog that does not record them is
    left out."""
    out = {}
    for m in models:
        path = root / m / "catalog.json"
        if path.is_file() and (size := probe_size(json.loads(path.read_text()))) is not None:
            out[m] = size
    return out


def cross_model_rows(root: Path, models: list[str]) -> dict[str, dict[str, Cell]]:
    """type -> model -> :class:`Cell`, for the models published under ``root``."""
    found = [m for m in models if (root / m / "catalog.json").is_file()]
    data = {m: json.loads((root / m / "catalog.json").read_text()) for m in found}
    runs = {m: json.loads((root / m / "run.json").read_text()) for m in found}
    names = sorted({n for d in data.values() for n in d["types"]} | set(LITERATURE))
    return {n: {m: type_cell(data[m], runs[m], n) for m in found} for n in names}


def shared_types(rows: dict[str, dict[str, Cell]], models: list[str]) -> list[str]:
    """The types that label at least one head on every one of ``models``."""
    return [n for n, cells in rows.items() if all(m in cells and cells[m].n_heads for m in models)]


def cross_model_table(root: Path, models: list[str]) -> str:
    """The Markdown table: one row per type, one column per published model (labelled
    heads, share, median relative depth; validation effect vs the controls' median), and
    what the literature reports."""
    rows = cross_model_rows(root, models)
    found = [m for m in models if (root / m / "catalog.json").is_file()]
    sizes = probe_sizes(root, found)
    head = "| type | " + " | ".join(f"`{m}`" for m in found) + " | literature |"
    lines = [head, "|---|" + "---|" * (len(found) + 1)]
    flag = "⚠ " if len(set(sizes.values())) > 1 else ""
    cells = " | ".join(f"{flag}{sizes[m].text()}" if m in sizes else "not recorded" for m in found)
    lines.append(f"| *probe sizes* | {cells} | |")
    for name, cells_ in rows.items():
        texts = " | ".join(cells_[m].text() for m in found)
        lines.append(f"| `{name}` | {texts} | {LITERATURE.get(name, '')} |")
    out = "\n".join(lines) + "\n"
    if flag:
        out += (
            "\n⚠ The models were published at different probe sizes (the first row): a head "
            "count or a verdict compares across them only with that in mind. Smaller probes "
            "give wider intervals, and fewer control sets a larger smallest p.\n"
        )
    return out


def shared_findings(rows: dict[str, dict[str, Cell]], models: list[str]) -> list[str]:
    """One line per finding the decoders are compared on (:data:`_FINDINGS`): on each
    model, how many heads (share), where (median relative depth) and the verdict."""

    def said(c: Cell) -> str:
        return c.said(f"depth {c.depth:.2f}" if c.depth is not None else "")

    lines = []
    for name, what in _FINDINGS.items():
        cells = rows.get(name, {})
        if all(m in cells for m in models):
            each = "; ".join(f"{m} {said(cells[m])}" for m in models)
            lines.append(f"- {what}: {each}.")
    return lines


def readme_block(root: Path, models: list[str] = PUBLISHED) -> str:
    """The README's cross-model section body between :data:`BEGIN` and :data:`END`: the
    table, which types every published decoder labels and which only some do, and the
    findings compared (:func:`shared_findings`)."""
    rows = cross_model_rows(root, models)
    decoders = [m for m in models if m != "minilm-l6" and (root / m / "catalog.json").is_file()]
    every = shared_types(rows, decoders)
    some = {
        n: [m for m in decoders if cells[m].n_heads]
        for n, cells in rows.items()
        if n not in every and any(m in cells and cells[m].n_heads for m in decoders)
    }
    lines = [BEGIN, cross_model_table(root, models)]
    lines.append(
        f"Labelled in every decoder ({', '.join(decoders)}): "
        f"{', '.join(f'`{n}`' for n in every) or 'none'}."
    )
    only = [f"`{n}` ({', '.join(ms)})" for n, ms in some.items()]
    lines.append(f"Labelled in some decoders only: {', '.join(only) or 'none'}.")
    findings = shared_findings(rows, decoders)
    if findings:
        lines.append("The decoders compared:\n\n" + "\n".join(findings))
    return "\n".join([*lines[:2], *(line + "\n" for line in lines[2:]), END])


def replace_block(text: str, block: str) -> str:
    """``text`` with the part from :data:`BEGIN` to :data:`END` replaced by ``block``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]
