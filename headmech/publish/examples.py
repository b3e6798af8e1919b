"""Attention examples: what a labelled head attends to on short real probe texts.

A published catalog says *which* heads are of a type; a reader also wants to see one at
work. :func:`record_examples` runs the model once on one or two short texts of its probes
(a few sentences of the prose corpus, where the tokenizer reads English, and a sequence of
the ``repeated_random`` probe, where induction and duplicate-token heads show their
stripes) and keeps each given head's attention pattern (hook
``blocks.{l}.attn.hook_pattern``), rounded to 3 decimals. ``catalog/<model>/examples.json``
holds them for every labelled head (:func:`update_examples`, run by ``make catalog`` and
``make site``), and the site's head pages draw them with :mod:`headmech.publish.attention_view`.
:func:`show` draws the same view in a notebook, on any text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import InputError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.core.head_index import HeadIndex

__all__ = [
    "MAX_TOKENS",
    "HeadView",
    "example_texts",
    "labelled_heads",
    "record_examples",
    "show",
    "update_examples",
]

MAX_TOKENS = 32
"""Tokens of each example text (at most): a pattern of 32 rows stays small on disk."""

SCHEMA = 1


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


def example_texts(model: TransformerBridge) -> list[tuple[str, list[int]]]:
    """The example texts for ``model``: ``(probe name, token ids)``; the prose only when
    the model's tokenizer reads English."""
    from headmech.core.checks import prose_problem

    texts = [("repeated_random", _repeated_ids(model))]
    if prose_problem(model.tokenizer) is None:
        texts.insert(0, ("prose", _prose_ids(model)))
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
) -> dict[str, Any]:
    """Each head's attention on each text (one forward pass per text).

    Returns:
        ``{"texts": [{"probe", "tokens", "ids"}], "causal", "heads": {"L1H0": [rows per
        text]}}`` (``ids``: the token ids, which the views show on hover; files recorded
        before them lack them, and are not stale for that).
    """
    from headmech.interventions import capture
    from headmech.models import model_info
    from headmech.stream.engine import ProbeBatch

    heads = sorted(set(heads))
    texts = list(example_texts(model) if texts is None else texts)
    causal = model_info(model).causal
    names = sorted({f"blocks.{h.layer}.attn.hook_pattern" for h in heads})
    out: dict[str, Any] = {"texts": [], "causal": causal, "heads": {str(h): [] for h in heads}}
    for probe, ids in texts:
        t = torch.tensor([list(ids)], dtype=torch.long)
        ones = torch.ones_like(t)
        special = torch.isin(t, torch.tensor(sorted(set(model.tokenizer.all_special_ids))))
        store = capture(model, ProbeBatch(t, ones, special), names) if names else {}
        tokens = [_token(model.tokenizer, i) for i in t[0].tolist()]
        out["texts"].append({"probe": probe, "tokens": tokens, "ids": t[0].tolist()})
        for h in heads:
            pattern = store[f"blocks.{h.layer}.attn.hook_pattern"][0, h.head]
            out["heads"][str(h)].append(_rows(pattern, causal))
    return out


def labelled_heads(catalog: dict[str, Any]) -> list[HeadIndex]:
    """Every head a catalog.json labels with at least one type."""
    from headmech.core.head_index import HeadIndex

    found = {HeadIndex(*h) for t in catalog["types"].values() for h in t["heads"]}
    return sorted(found)


def update_examples(model_dir: str | Path, model: TransformerBridge | None = None) -> bool:
    """Write ``model_dir/examples.json`` for the labelled heads of ``model_dir/catalog.json``
    where it is missing or stale (other weights, other heads); loads the model when needed.

    Returns:
        Whether the file was (re)written.
    """
    from headmech.runs.provenance import check_weights

    folder = Path(model_dir)
    catalog = json.loads((folder / "catalog.json").read_text())
    weights = catalog["provenance"]["model"]["weights_sha256"]
    heads = labelled_heads(catalog)
    path = folder / "examples.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("weights_sha256") == weights and set(old["heads"]) == {str(h) for h in heads}:
            return False
    if model is None:
        from headmech.models import load_model

        model = load_model(catalog["model"]["name"])
    check_weights(catalog["provenance"], model, f"the catalog in {folder}")
    data = {"schema": SCHEMA, "model": catalog["model"]["name"], "weights_sha256": weights}
    data |= record_examples(model, heads)
    path.write_text(dumps_examples(data))
    return True


def show(model: TransformerBridge, head: Any, text: str | None = None) -> Any:
    """One head's attention on ``text`` (default: the model's example texts) as an
    interactive token view in a notebook (rendered as ``IPython.display.HTML`` is): hover or click a token to see its weights.

    Args:
        model: a model from :func:`headmech.load_model`.
        head: ``(layer, head)``, a :class:`~headmech.HeadIndex` or ``"L1H0"``.
        text: the text to run (with the model's special tokens).

    Returns:
        A :class:`HeadView`: a notebook displays it (its ``_repr_html_``), ``.data`` is the HTML.
    """
    from headmech.core.head_index import check_heads
    from headmech.publish.attention_view import view_html

    (h,) = check_heads([head], int(model.cfg.n_layers), int(model.cfg.n_heads), "show")
    if text is not None and not text.strip():
        raise InputError("show() needs a non-empty text")
    texts = None
    if text is not None:
        texts = [("text", model.tokenizer(text, add_special_tokens=True)["input_ids"])]
    data = record_examples(model, [h], texts)
    parts = [
        view_html(
            t["tokens"], rows, title=f"{h} on {t['probe']}", view_id=f"hm-{h}-{i}", inline=True
        )
        for i, (t, rows) in enumerate(zip(data["texts"], data["heads"][str(h)], strict=True))
    ]
    return HeadView("".join(parts))


class HeadView:
    """HTML that a notebook displays as it is (as ``IPython.display.HTML`` does, without
    needing IPython)."""

    def __init__(self, data: str) -> None:
        self.data = data

    def _repr_html_(self) -> str:
        return self.data

    def __repr__(self) -> str:
        return f"<HeadView: {len(self.data)} characters of HTML>"
