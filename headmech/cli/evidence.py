"""Each head type's own evidence lines for the command line: what
:func:`headmech.cli.report.evidence` prints from the type's ``details`` (as
``catalog.json`` holds them) before its validation.

A type with lines to print registers a function ``details -> list[str]`` in
:data:`EVIDENCE_LINES` under the type's ``name`` (docs/contributing-head-types.md): a
built-in type (``headmech/headtypes/``, which may not import the command line) here, a
type kept in a folder or package of its own from its file. A type without one prints none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EVIDENCE_LINES", "evidence_lines"]


def concept_induction_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its mass on the word's last and first token; the token induction heads."""
    token = details.get("token_mass", {})
    lines = [
        f"{h}: mass on the word's last token {m:.2f}, on its first token {token.get(h, 0):.2f}"
        for h, m in details.get("concept_mass", {}).items()
    ]
    if details.get("token_induction"):
        lines.append(f"token-level induction heads here: {', '.join(details['token_induction'])}")
    return lines


def concordance_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its accuracy on the grammatical and the ungrammatical half against the
    positional baseline, and how often it picks the subject whatever the verb."""
    gram, ungram = details.get("grammatical", {}), details.get("ungrammatical", {})
    subject, q = details.get("picks_subject", {}), details.get("q", {})
    base = details.get("baseline", 0.0)
    return [
        f"{h}: follows the verb's number {a:.2f} (grammatical {gram.get(h, 0):.2f}, "
        f"ungrammatical {ungram.get(h, 0):.2f}; baseline {base:.2f}), picks the subject "
        f"{subject.get(h, 0):.2f}, q {q.get(h, 1):.3g}"
        for h, a in details.get("accuracy", {}).items()
    ]


def qrhead_lines(details: dict[str, Any]) -> list[str]:
    """Per head of the top 16, the calibrated score, the question's and the null query's
    attention mass on the gold document, and the share of questions above 0."""
    mass, null = details.get("mass", {}), details.get("null_mass", {})
    positive, q = details.get("positive", {}), details.get("q", {})
    return [
        f"{h}: calibrated {s:+.3f} (question {mass.get(h, 0):.3f}, null query "
        f"{null.get(h, 0):.3f} on the gold document), above 0 in {positive.get(h, 0):.0%} "
        f"of {details.get('questions', 0)} questions, q {q.get(h, 1):.3g}"
        for h, s in details.get("score", {}).items()
    ]


def fact_source_lines(details: dict[str, Any]) -> list[str]:
    """Per head of the top 8, its direct effect on the answer from its group (subject or
    relation), the share of facts where it is above 0, and the last token's attention to
    the group."""
    group = details.get("group", "subject")
    positive, attention = details.get("positive", {}), details.get("attention", {})
    q = details.get("q", {})
    known = f"{details.get('known', 0)} of {details.get('asked', 0)} facts completed"
    return [known] + [
        f"{h}: {d:+.3f} nats from the {group} (above 0 in {positive.get(h, 0):.0%} of "
        f"facts), attention to it {attention.get(h, 0):.2f}, q {q.get(h, 1):.3g}"
        for h, d in details.get("dla", {}).items()
    ]


def locos_lines(details: dict[str, Any]) -> list[str]:
    """Per head of the top 16, its logit contribution from the needle (``L+``) against the
    rest (``L-``), the share of answered questions where it is above 0, and its attention to
    the needle."""
    plus, minus = details.get("L_plus", {}), details.get("L_minus", {})
    positive, attention, q = (details.get(k, {}) for k in ("positive", "attention", "q"))
    answered = f"{details.get('answered', 0)} of {details.get('asked', 0)} questions answered"
    return [answered] + [
        f"{h}: {c:+.3f} (needle {plus.get(h, 0):+.3f}, rest {minus.get(h, 0):+.3f}), above 0 "
        f"in {positive.get(h, 0):.0%}, attention to the needle {attention.get(h, 0):.2f}, "
        f"q {q.get(h, 1):.3g}"
        for h, c in details.get("contribution", {}).items()
    ]


def copy_suppression_lines(details: dict[str, Any]) -> list[str]:
    """Per head, the share of tokens whose own logit it suppresses."""
    share = details.get("suppressed_share", {})
    return [f"{h}: suppresses its own token for {s:.0%} of tokens" for h, s in share.items()]


def function_vector_lines(details: dict[str, Any]) -> list[str]:
    """The five largest average indirect effects, largest first, with the heads' attention."""
    mass = details.get("label_mass", {})
    # the five largest AIEs: a catalog read back from JSON (sorted keys) lists them by name
    best = sorted(details.get("aie", {}).items(), key=lambda item: -item[1])[:5]
    return [
        f"{h}: AIE {a:+.3f}, attention on the examples' answers {mass.get(h, 0):.2f}"
        for h, a in best
    ]


def inactive_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its output norm by domain and first-token attention; how many the
    first-token criterion alone would miss."""
    mass = details.get("first_token_mass", {})
    lines = [
        f"{h}: output norm / layer mean {', '.join(f'{d} {r:.2f}' for d, r in by.items())}; "
        f"first-token attention {mass.get(h, float('nan')):.2f}"
        for h, by in details.get("ratio_by_domain", {}).items()
    ]
    missed = details.get("missed_by_first_token", [])
    if missed:
        lines.append(
            f"{len(missed)} of them below first-token attention {details['first_token_threshold']}"
        )
    return lines


def name_mover_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its IO mass and copy scores (name movers and negative name movers)."""
    io, copy = details.get("io_mass", {}), details.get("copy_score", {})
    neg = details.get("negative_copy_score", {})
    return [
        f"{h}: IO mass {m:.2f}, copy {copy.get(h, 0):.2f}, negative copy {neg.get(h, 0):.2f}"
        for h, m in io.items()
    ]


def positional_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its offset and the share of queries whose argmax it takes."""
    return [
        f"{h}: offset {off:+d}, {details['fraction'][h]:.2f} of queries"
        for h, off in details.get("offset", {}).items()
    ]


def s_inhibition_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its S2 and IO mass, marked where it is not below the name movers."""
    io = details.get("io_mass", {})
    late = {f"L{a}H{b}" for a, b in details.get("above_name_movers", [])}
    return [
        f"{h}: S2 mass {m:.2f}, IO mass {io.get(h, 0):.2f}"
        + (" (not below the name movers)" if h in late else "")
        for h, m in details.get("s2_mass", {}).items()
    ]


def semantic_induction_lines(details: dict[str, Any]) -> list[str]:
    """The five largest relation indices, largest first, as attention times tail gain."""
    mass, gain = details.get("head_word_mass", {}), details.get("tail_gain", {})
    best = sorted(details.get("relation_index", {}).items(), key=lambda kv: -kv[1])[:5]
    return [
        f"{h}: index {v:.2f} = attention {mass.get(h, 0):.2f} x tail gain {gain.get(h, 0):.2f}"
        for h, v in best
    ]


def successor_lines(details: dict[str, Any]) -> list[str]:
    """Per head, its succession score."""
    return [f"{h}: succession {s:.2f}" for h, s in details.get("succession_score", {}).items()]


def syntactic_lines(details: dict[str, Any]) -> list[str]:
    """A table: per relation and direction, the best head against the positional baseline."""
    lines = ["relation  direction     best head  accuracy  baseline (offset)  cases"]
    for rel, dirs in details.get("relations", {}).items():
        for direction, r in dirs.items():
            head = f"L{r['head'][0]}H{r['head'][1]}" if r.get("head") else "-"
            mark = " *" if r.get("syntactic") else ""
            lines.append(
                f"{rel:<9} {direction:<13} {head:<10} {r['accuracy']:>8.2f}  "
                f"{r['baseline']:>8.2f} ({r['baseline_offset']:+d})    {r['count']:>5}{mark}"
            )
    return lines


EVIDENCE_LINES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "concept_induction": concept_induction_lines,
    "concordance": concordance_lines,
    "copy_suppression": copy_suppression_lines,
    "function_vector": function_vector_lines,
    "inactive": inactive_lines,
    "locos": locos_lines,
    "name_mover": name_mover_lines,
    "negative_name_mover": name_mover_lines,
    "positional": positional_lines,
    "qrhead": qrhead_lines,
    "relation": fact_source_lines,
    "s_inhibition": s_inhibition_lines,
    "semantic_induction": semantic_induction_lines,
    "subject": fact_source_lines,
    "successor": successor_lines,
    "syntactic": syntactic_lines,
}
"""Each type's evidence lines, by the type's name: a function of its ``details``."""


def evidence_lines(name: str, details: dict[str, Any]) -> list[str]:
    """The lines of type-specific evidence of type ``name`` for the command line, from its
    ``details`` (:data:`EVIDENCE_LINES`; default: none)."""
    lines = EVIDENCE_LINES.get(name)
    return [] if lines is None else lines(details)
