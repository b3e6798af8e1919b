"""Attention examples: what each head attends to on short real probe texts.

A published catalog says *which* heads are of a type; a reader also wants to see one at
work, on the text its type is measured on. :func:`record_examples` runs the model once per
text and keeps each head's attention pattern (hook ``blocks.{l}.attn.hook_pattern``),
rounded to 3 decimals. The texts (:func:`example_texts`): a few sentences of the prose
corpus (where the tokenizer reads English) and a ``repeated_random`` sequence, on which
every head is recorded, then one short sequence of each other probe the catalog's types
are measured on (``ioi``, ``needle``, ``ordinal``, ``icl``, ...), on which a head is
recorded when it is one of its :func:`own_types`' probe: the types that label it, else
those it reaches the threshold of, else the one it comes closest to. So every head's page
shows it on ordinary prose and on its own type's probe (an IOI prompt for a name mover,
the needle for a retrieval head).

``catalog/<model>/examples.json`` holds them for every head (:func:`update_examples`, run
by ``make catalog`` and ``make site``), and the site's head and layer pages draw them with
:mod:`headmech.publish.attention_view`. :func:`headmech.publish.show.show` draws the same view in a notebook, on
any text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.core.head_index import HeadIndex

__all__ = [
    "MAX_TOKENS",
    "example_texts",
    "labelled_heads",
    "own_types",
    "record_examples",
    "update_examples",
]

MAX_TOKENS = 32
"""Tokens of the prose and repeated-random texts (at most): a pattern of 32 rows stays
small on disk, and every head is recorded on them."""

MAX_PROBE_TOKENS = 112
"""Tokens of another probe's example (at most): the needle's shortest haystack fits."""

ORDINARY = ("prose", "repeated_random")
"""The texts every head is recorded on."""

SCHEMA = 4  # 3: what each head writes (``writes``); 4: and at the last token (``end``)


def _token(tokenizer: Any, i: int) -> str:
    return str(tokenizer.decode([i])).replace("\n", "\\n")


def _prose_ids(model: TransformerBridge) -> list[int]:
    """The first run of consecutive corpus sentences that fits in :data:`MAX_TOKENS`
    tokens with the model's special tokens (at least 16 tokens where one exists)."""
    from headmech.probes import load_sentences

    sentences = load_sentences(None)
    best: list[int] = []
    for i in range(len(sentences)):
        text = sentences[i]
        for j in range(i + 1, min(i + 4, len(sentences)) + 1):
            ids = model.tokenizer(text, add_special_tokens=True)["input_ids"]
            if len(ids) > MAX_TOKENS:
                break
            if len(ids) > len(best):
                best = list(ids)
            if len(best) >= 24:
                return best
            text = " ".join(sentences[i : j + 1])
    return best


def _repeated_ids(model: TransformerBridge) -> list[int]:
    from headmech.probes import ProbeOptions, repeated_random_probe

    half = (MAX_TOKENS - 2) // 2
    probe = repeated_random_probe(model, ProbeOptions(n_sequences=1, half_len=half))
    batch = probe.batches[0]
    return batch.input_ids[0, : int(batch.attention_mask[0].sum())].tolist()


def _probe_ids(model: TransformerBridge, probe: str) -> list[int] | None:
    """The first sequence of ``probe`` (built at its smallest sizes) of at most
    :data:`MAX_PROBE_TOKENS` tokens, or None where the probe cannot be built for the model
    (e.g. IOI prompts on a toy vocabulary)."""
    from headmech.core.errors import HeadmechError
    from headmech.probes import ProbeOptions, build_probe

    try:
        # the smallest sizes that still hold one whole example of each probe
        small = ProbeOptions(
            n_sentences=8,
            n_sequences=1,
            half_len=15,
            batch_size=4,
            needle_lengths=(40,),
            needle_depths=(0.5,),
        )
        built = build_probe(probe, model, small)
    except HeadmechError:
        return None
    for batch in built.batches:
        for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True):
            ids = row[: int(mask.sum())].tolist()
            if 0 < len(ids) <= MAX_PROBE_TOKENS:
                return ids
    return None


def _type_probe(name: str) -> str | None:
    from headmech.core.errors import HeadmechError
    from headmech.headtypes import get_head_type

    try:
        return str(get_head_type(name).probe)
    except HeadmechError:  # a plug-in type not installed here
        return None


def example_texts(
    model: TransformerBridge, types: Iterable[str] = ()
) -> list[tuple[str, list[int]]]:
    """The example texts for ``model``: ``(probe name, token ids)``: the prose (only when
    the model's tokenizer reads English) and the repeated random tokens, then one sequence
    of each other probe that ``types`` are measured on and the model can be given."""
    from headmech.core.checks import prose_problem

    texts = [("repeated_random", _repeated_ids(model))]
    if prose_problem(model.tokenizer) is None:
        texts.insert(0, ("prose", _prose_ids(model)))
    probes = {_type_probe(t) for t in types} - {None, *ORDINARY}
    for probe in sorted(p for p in probes if p is not None):
        ids = _probe_ids(model, probe)
        if ids is not None:
            texts.append((probe, ids))
    return texts


def _rows(pattern: torch.Tensor, causal: bool) -> list[list[float]]:
    """A ``[query_pos, key_pos]`` pattern as rows rounded to 3 decimals (causal: row q
    stops at key q)."""
    n = pattern.shape[0]
    rows = []
    for q in range(n):
        row = [round(float(w), 3) for w in pattern[q, : (q + 1 if causal else n)].tolist()]
        rows.append([int(w) if w in (0.0, 1.0) else w for w in row])  # "0", not "0.0"
    return rows


def dumps_examples(data: dict[str, Any]) -> str:
    """JSON with one line per pattern row (a diff shows which rows changed)."""
    text = json.dumps(data, indent=1, sort_keys=True)
    return (
        re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", "", m[1]) + "]", text)
        + "\n"
    )


def record_examples(
    model: TransformerBridge,
    heads: Iterable[HeadIndex],
    texts: Sequence[tuple[str, Sequence[int]]] | None = None,
    on: Mapping[HeadIndex, Iterable[int]] | None = None,
) -> dict[str, Any]:
    """Each head's attention on each text (one forward pass per text).

    Args:
        model: the model.
        heads: the heads to record.
        texts: ``(probe, token ids)`` pairs (default: :func:`example_texts`).
        on: per head, the indices of the texts to record it on (default: every text).

    Returns:
        ``{"texts": [{"probe", "tokens", "ids"}], "causal", "heads": {"L1H0": [rows per
        text, or None where not recorded]}, "writes": {"L1H0": [per text, what the head
        writes there, or None]}}`` (``ids``: the token ids, which the views show on hover;
        ``writes``: :func:`writes_record`, or ``writes_note`` saying why there are none).
    """
    import torch

    from headmech.interventions import capture
    from headmech.models import model_info
    from headmech.stream.engine import ProbeBatch

    heads = sorted(set(heads))
    texts = list(example_texts(model) if texts is None else texts)
    causal = model_info(model).causal
    names = sorted({f"blocks.{h.layer}.attn.hook_pattern" for h in heads})
    out: dict[str, Any] = {"texts": [], "causal": causal, "heads": {str(h): [] for h in heads}}
    for i, (probe, ids) in enumerate(texts):
        t = torch.tensor([list(ids)], dtype=torch.long)
        ones = torch.ones_like(t)
        special = torch.isin(t, torch.tensor(sorted(set(model.tokenizer.all_special_ids))))
        store = capture(model, ProbeBatch(t, ones, special), names) if names else {}
        tokens = [_token(model.tokenizer, i) for i in t[0].tolist()]
        out["texts"].append({"probe": probe, "tokens": tokens, "ids": t[0].tolist()})
        here = [h for h in heads if on is None or i in set(on.get(h, ()))]
        for h in heads:
            if h not in here:
                out["heads"][str(h)].append(None)
                continue
            pattern = store[f"blocks.{h.layer}.attn.hook_pattern"][0, h.head]
            out["heads"][str(h)].append(_rows(pattern, causal))
        _record_writes(model, out, t[0].tolist(), heads, here)
    return out


def _record_writes(
    model: TransformerBridge, out: dict[str, Any], ids: list[int], heads: list[HeadIndex],
    here: list[HeadIndex],
) -> None:  # fmt: skip
    """Each head's writes on one text into ``out["writes"]`` (None where not recorded);
    where the model allows none, ``out["writes_note"]`` says why, once."""
    from headmech.attribution.writes import head_writes
    from headmech.core.errors import HeadmechError

    if "writes_note" not in out:
        try:
            found = head_writes(model, ids, here) if here else {}
        except HeadmechError as e:
            out["writes_note"] = str(e)
            out.pop("writes", None)
            return
        writes = out.setdefault("writes", {str(h): [] for h in heads})
        for h in heads:
            w = found.get(h)
            writes[str(h)].append(None if w is None else writes_record(model.tokenizer, w))


def writes_record(tokenizer: Any, w: Any) -> dict[str, Any]:
    """A :class:`headmech.attribution.writes.HeadWrite` as examples.json holds it: each
    position's direct effect on its next token (3 decimals), where it is largest, and the
    promoted and suppressed tokens there and at the last position (``end``: as text, with
    their logit change)."""

    def r3(x: float | None) -> float | None:
        return None if x is None else round(float(x), 3)

    return {
        "effects": [r3(e) for e in w.effects],
        "at": w.at,
        "promoted": [[_token(tokenizer, i), r3(v)] for i, v in w.promoted],
        "suppressed": [[_token(tokenizer, i), r3(v)] for i, v in w.suppressed],
        "end": [[[_token(tokenizer, i), r3(v)] for i, v in side] for side in w.end],
    }


def labelled_heads(catalog: dict[str, Any]) -> list[HeadIndex]:
    """Every head a catalog.json labels with at least one type."""
    from headmech.core.head_index import HeadIndex

    found = {HeadIndex(*h) for t in catalog["types"].values() for h in t["heads"]}
    return sorted(found)


def _score(t: dict[str, Any], head: tuple[int, int]) -> float | None:
    grid = t.get("score")
    value = grid[head[0]][head[1]] if grid else None
    return None if value is None else float(value)


def own_types(catalog: dict[str, Any], head: tuple[int, int]) -> list[str]:
    """The types whose probe a head's page shows it on: those of ``catalog`` that label
    it; else those it is at or above the threshold of (not labelled: a further criterion,
    or borderline); else the one whose threshold its score comes closest to (the largest
    score / threshold, positive thresholds only). Sorted; empty where no type scores it."""
    h = (int(head[0]), int(head[1]))
    types = catalog["types"]
    labelled = [n for n, t in types.items() if h in {(a, b) for a, b in t["heads"]}]
    if labelled:
        return sorted(labelled)
    reached = []
    for name, t in types.items():
        score, threshold = _score(t, h), t.get("threshold")
        if score is not None and threshold is not None and score >= threshold:
            reached.append(name)
    if reached:
        return sorted(reached)
    ratios = {
        name: score / float(t["threshold"])
        for name, t in types.items()
        if (score := _score(t, h)) is not None and (t.get("threshold") or 0) > 0
    }
    return [max(sorted(ratios), key=ratios.__getitem__)] if ratios else []


def every_head(catalog: dict[str, Any]) -> list[HeadIndex]:
    """Every head of the catalog's model (with any head its types name)."""
    from headmech.core.head_index import HeadIndex

    model = catalog.get("model") or {}
    found = {
        HeadIndex(la, h)
        for la in range(int(model.get("n_layers", 0)))
        for h in range(int(model.get("n_heads", 0)))
    }
    return sorted(found | set(labelled_heads(catalog)))


def recording_plan(
    catalog: dict[str, Any], texts: Sequence[tuple[str, Sequence[int]]]
) -> dict[HeadIndex, list[int]]:
    """Per head, the texts it is recorded on: the ordinary ones (prose, repeated random)
    and the probe of each of its :func:`own_types`."""
    plan = {}
    for h in every_head(catalog):
        probes = {_type_probe(t) for t in own_types(catalog, h)} | set(ORDINARY)
        plan[h] = [i for i, (probe, _) in enumerate(texts) if probe in probes]
    return plan


def update_examples(model_dir: str | Path, model: TransformerBridge | None = None) -> bool:
    """Write ``model_dir/examples.json`` for every head of ``model_dir/catalog.json``
    (:func:`recording_plan`) where it is missing or stale (an older schema, other weights,
    other heads or texts); loads the model when needed.

    Returns:
        Whether the file was (re)written.
    """
    from headmech.runs.provenance import check_weights

    folder = Path(model_dir)
    catalog = json.loads((folder / "catalog.json").read_text())
    weights = catalog["provenance"]["model"]["weights_sha256"]
    path = folder / "examples.json"
    if path.exists():
        old = json.loads(path.read_text())
        if (
            old.get("schema") == SCHEMA
            and old.get("weights_sha256") == weights
            and old.get("plan") == _plan_key(catalog)
        ):
            return False
    if model is None:
        from headmech.models import load_model

        model = load_model(catalog["model"]["name"])
    check_weights(catalog["provenance"], model, f"the catalog in {folder}")
    texts = example_texts(model, catalog["types"])
    plan = recording_plan(catalog, texts)
    data = {"schema": SCHEMA, "model": catalog["model"]["name"], "weights_sha256": weights}
    data |= {"plan": _plan_key(catalog)} | record_examples(model, plan, texts, plan)
    path.write_text(dumps_examples(data))
    return True


def _plan_key(catalog: dict[str, Any]) -> str:
    """A digest of what decides the recording (every head's own types): a new label or
    threshold makes the file stale."""
    import hashlib

    own = {str(h): own_types(catalog, h) for h in every_head(catalog)}
    return hashlib.sha256(json.dumps(own, sort_keys=True).encode()).hexdigest()[:16]
