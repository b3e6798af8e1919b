"""Ordinary text of several domains, for a head's behaviour beyond its probe.

A probe is built to make one behaviour visible; Anthropic's HeadVis (Transformer
Circuits Thread, 2026) reports that a head's behaviour on the full distribution rarely
matches what a narrow task suggests. :mod:`headmech.classification.broad` asks, for each labelled head,
how much of its attention on ordinary text its type's pattern explains; this module gives
it the text, cut into windows of a fixed number of tokens:

* ``fiction``, ``news``, ``conversation`` — prose written for headmech
  (``headmech/probes/broad_text/``: a short story, a local news report, a dialogue);
* ``documentation`` — the default prose corpus (the CPython documentation's prose);
* ``legal`` — the licence and history of Python (``LICENSE.txt`` of the running
  interpreter's standard library; skipped, and said, where an install lacks it).

Every domain's text is tokenised once, without special tokens; each window gets the
special tokens the model's tokenizer adds to a sentence, as every probe gets them (a BOS
where the model has one, ``[CLS] ... [SEP]`` for BERT, nothing for a model without:
:func:`special_tokens`). The patterns the
head types read on this text are defined in each type's file (``broad_targets``); the
two that need the tokens' content are here.
"""

from __future__ import annotations

import sysconfig
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool
from torch import Tensor

from headmech.probes import batch_sequences, special_tokens
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "DOMAINS",
    "after_earlier_copy",
    "broad_batches",
    "copy_of_next",
    "domain_texts",
    "special_tokens",
]

DOMAINS: tuple[str, ...] = ("fiction", "news", "conversation", "documentation", "legal")
DOC_SENTENCES = 400  # of the documentation prose, in corpus order


def domain_texts() -> dict[str, str]:
    """Each domain's text (a domain whose source is missing is left out)."""
    from headmech.probes.text import default_corpus

    here = resources.files("headmech.probes") / "broad_text"
    out = {d: (here / f"{d}.txt").read_text(encoding="utf-8") for d in DOMAINS[:3]}
    out["documentation"] = " ".join(default_corpus()[:DOC_SENTENCES])
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if licence.is_file():
        out["legal"] = " ".join(licence.read_text(encoding="utf-8", errors="replace").split())
    return out


def broad_batches(
    model: TransformerBridge, length: int, per_domain: int, batch_size: int = 8
) -> tuple[list[ProbeBatch], dict[str, int]]:
    """Windows of ``length`` tokens (special tokens included), up to ``per_domain``
    consecutive ones from each domain's text; ``extras["domain"]`` names it. Returns the
    batches and the windows per domain (a text too short for one window gives none)."""
    tok = model.tokenizer
    before, after = special_tokens(tok)
    width = min(length, int(model.cfg.n_ctx)) - len(before) - len(after)
    sequences, extras, counts = [], [], {}
    for domain, text in domain_texts().items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        windows = [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]
        windows = windows[:per_domain]
        counts[domain] = len(windows)
        for w in windows:
            sequences.append([*before, *w, *after])
            extras.append({"domain": domain})
    return batch_sequences(sequences, tok, batch_size, extras), counts


def after_earlier_copy(batch: ProbeBatch) -> Bool[Tensor, "batch query_pos key_pos"]:
    """Induction on ordinary text: for each query, the keys right after an earlier copy of
    the query's token (Olsson et al.'s prefix matching), specials never counted."""
    ids, real = batch.input_ids, ~batch.special
    n = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & real[:, :, None] & real[:, None, :]
    before = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-2)  # j < q - 1
    copies = same & before  # [batch, query, j]: j an earlier copy of the query's token
    after = torch.zeros_like(copies)
    after[:, :, 1:] = copies[:, :, :-1]  # key j + 1
    return after & real[:, None, :]


def copy_of_next(batch: ProbeBatch) -> Bool[Tensor, "batch query_pos key_pos"]:
    """Retrieval on ordinary text: for each query, the earlier keys holding the token that
    comes next (a copy-paste head attends there to write it; Wu et al.)."""
    ids, real = batch.input_ids, ~batch.special
    n = ids.shape[1]
    nxt = torch.full_like(ids, -1)
    nxt[:, :-1] = ids[:, 1:].masked_fill(~real[:, 1:], -1)
    same = (nxt[:, :, None] == ids[:, None, :]) & real[:, None, :] & (nxt >= 0)[:, :, None]
    visible = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)  # k < q
    return same & visible & real[:, :, None]
