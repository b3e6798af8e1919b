"""Probe data: the token batches head types are measured on.

A probe is built once per :func:`headmech.classify` call and shared by every head type
that names it, so classifying N types costs about one pass over the union of their
probes. Every builder is deterministic under ``seed``.

Built-in probes:

* ``prose`` — real English sentences (the CPython documentation's prose by default, or
  the user's ``corpus`` file), tokenised with the model's special tokens, with spaCy
  parses aligned to the tokens and corpus token counts (:mod:`headmech.probes.prose`);
* ``repeated_random`` — BOS + random tokens + the same tokens again (Olsson et al. 2022);
* ``needle`` — a fact hidden in a prose haystack, then asked for (:mod:`headmech.probes.needle`).

Probes are registered in :data:`headmech.core.registry.PROBES` (a builder ``(model, options)
-> Probe``); a plug-in package adds one through the entry-point group ``headmech.probes``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import InputError
from headmech.core.options import ProbeOptions
from headmech.core.registry import PROBES
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "PROBES",
    "Probe",
    "ProbeOptions",
    "batch_sequences",
    "build_probe",
    "repeated_random_probe",
    "register_probe",
    "start_ids",
]


@dataclass
class Probe:
    """Batches of one probe plus what produced them."""

    name: str
    batches: list[ProbeBatch]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)

    @property
    def n_sequences(self) -> int:
        return sum(int(b.input_ids.shape[0]) for b in self.batches)


ProbeBuilder = Callable[["TransformerBridge", ProbeOptions], Probe]


def register_probe(name: str, summary: str = "") -> Callable[[ProbeBuilder], ProbeBuilder]:
    """Decorator: make a probe builder available to head types and tasks by name."""
    return PROBES.register(name, summary=summary)  # type: ignore[no-any-return]


def build_probe(name: str, model: TransformerBridge, options: ProbeOptions) -> Probe:
    """Build the probe registered as ``name`` (a one-line error for an unknown name)."""
    return PROBES.get(name)(model, options)


def _special_ids(tokenizer: Any) -> torch.Tensor:
    return torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)


def batch_sequences(
    sequences: Sequence[Sequence[int]],
    tokenizer: Any,
    batch_size: int,
    extras: Sequence[dict[str, Any]] | None = None,
) -> list[ProbeBatch]:
    """Right-pad token sequences into batches of similar length (deterministic order).

    Args:
        sequences: token ids per sequence.
        tokenizer: gives the pad id and the special-token ids; the batches keep it, to
            spell their tokens (``ProbeBatch.token_strings``).
        batch_size: sequences per batch.
        extras: optional per-sequence dicts; list-valued entries are padded with -1 and
            stacked into ``LongTensor[batch, pos]``, other values are collected in lists.
    """
    if batch_size < 1:
        raise InputError(f"batch size must be at least 1, got {batch_size}")
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    special_ids = _special_ids(tokenizer)
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : len(sequences[i])] = torch.tensor(list(sequences[i]), dtype=torch.long)
            mask[row, : len(sequences[i])] = 1
        special = torch.isin(ids, special_ids) | (mask == 0)
        batch_extras: dict[str, Any] = {"index": torch.tensor(idx)}
        if extras is not None:
            for key in extras[idx[0]]:
                vals = [extras[i][key] for i in idx]
                if isinstance(vals[0], (list, tuple)):
                    t = torch.full((len(idx), width), -1, dtype=torch.long)
                    for row, v in enumerate(vals):
                        t[row, : len(v)] = torch.tensor(list(v), dtype=torch.long)
                    batch_extras[key] = t
                else:
                    batch_extras[key] = vals
        batches.append(ProbeBatch(ids, mask, special, batch_extras, tokenizer))
    return batches


def encode_sentences(model: TransformerBridge, sentences: Sequence[str]) -> list[list[int]]:
    """Tokenise sentences with the model's special tokens; refuse empty or too-long text."""
    tokenizer = model.tokenizer
    n_ctx = int(model.cfg.n_ctx)
    encoded = []
    for i, s in enumerate(sentences):
        if not s.strip():
            raise InputError(f"sentence {i} of the corpus is empty")
        ids = tokenizer(s, add_special_tokens=True)["input_ids"]
        if len(ids) > n_ctx:
            raise InputError(
                f"sentence {i} of the corpus has {len(ids)} tokens, more than the model's context of {n_ctx}"
            )
        encoded.append(ids)
    return encoded


def load_sentences(corpus: str | os.PathLike | Sequence[str] | None) -> list[str]:
    """The default prose corpus, a text file's sentences, or the given list.

    Raises:
        CorpusError: an unreadable file, an empty corpus, or one of fewer than
            :data:`headmech.core.checks.MIN_SENTENCES` sentences (one line).
    """
    from headmech.core.checks import too_few_sentences
    from headmech.probes import text

    if corpus is None:
        return text.default_corpus()
    if isinstance(corpus, (str, os.PathLike)):
        sentences, where = text.read_corpus(corpus), f"the corpus {os.fspath(corpus)}"
    else:
        given = list(corpus) if not isinstance(corpus, bytes) else [corpus]
        if not all(isinstance(s, str) for s in given):
            kinds = sorted({type(s).__name__ for s in given if not isinstance(s, str)})
            raise text.CorpusError(
                f"the corpus must be a file path or a list of sentences (str); it holds {', '.join(kinds)}"
            )
        sentences, where = [s for s in given if s.strip()], "the corpus"
        if not sentences:
            raise text.CorpusError("the corpus is empty")
    if (problem := too_few_sentences(len(sentences))) is not None:
        raise text.CorpusError(f"{where} {problem}")
    return sentences


def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a sentence's own
    (``add_special_tokens=True`` against ``False``, as :func:`headmech.probes.encode_sentences`
    encodes every probe)."""
    sample = "The river runs past the mill."
    with_ = list(tokenizer(sample, add_special_tokens=True)["input_ids"])
    bare = list(tokenizer(sample, add_special_tokens=False)["input_ids"])
    for i in range(len(with_) - len(bare) + 1):
        if with_[i : i + len(bare)] == bare:
            return with_[:i], with_[i + len(bare) :]
    return [], []


def start_ids(model: TransformerBridge) -> list[int]:
    """The token ids every probe sequence starts with: those the model's tokenizer puts
    before any text (BERT's ``[CLS]``, Gemma's ``<bos>``, SmolLM2's ``<|im_start|>``), as
    :func:`encode_sentences` encodes prose. Where it puts none: a decoder's BOS token if it
    has one (GPT-2's ``<|endoftext|>``, which TransformerLens prepends too), an encoder's
    CLS token; else none (Qwen2.5, whose tokenizer has no BOS: :func:`headmech.load_model`).

    Not ``tokenizer.bos_token_id`` alone: TransformerLens' bridge gives a tokenizer without
    a BOS token one of its own, which :func:`headmech.load_model` takes back from decoders
    only; MiniLM's (``<|endoftext|>``, not in its WordPiece vocabulary) is its ``[UNK]``.
    The unknown token is never a start token unless the tokenizer itself puts it first.
    """
    tokenizer = model.tokenizer
    before, _ = special_tokens(tokenizer)
    if before:
        return [int(i) for i in before]
    encoder = getattr(model.cfg, "attention_dir", "causal") == "bidirectional"
    first = tokenizer.cls_token_id if encoder else tokenizer.bos_token_id
    unknown = getattr(tokenizer, "unk_token_id", None)
    return [int(first)] if first is not None and first != unknown else []


def random_token_ids(
    tokenizer: Any, generator: torch.Generator, shape: tuple[int, ...]
) -> torch.Tensor:
    """Uniformly random ordinary (non-special) token ids."""
    vocab = len(tokenizer)
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[_special_ids(tokenizer)] = False
    pool = allowed.nonzero()[:, 0]
    return pool[torch.randint(len(pool), shape, generator=generator)]


@register_probe("repeated_random", "BOS + random tokens + the same tokens again")
def repeated_random_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """The start token (:func:`start_ids`: BOS, or an encoder's CLS) + ``half_len``
    random tokens + the same tokens again (+ an encoder's SEP).

    ``extras["half_len"]`` and ``extras["offset"]`` (the position of the first random
    token) let types find each token's earlier copy.
    """
    tokenizer = model.tokenizer
    g = torch.Generator().manual_seed(options.seed)
    half = options.half_len
    if half < 2:
        raise InputError(f"half_len must be at least 2, got {half}")
    first = random_token_ids(tokenizer, g, (options.n_sequences, half))
    body = torch.cat([first, first], dim=1)
    prefix = start_ids(model)
    suffix = (
        [tokenizer.sep_token_id]
        if getattr(model.cfg, "attention_dir", "") == "bidirectional"
        and tokenizer.sep_token_id is not None
        else []
    )
    seqs = [prefix + row.tolist() + suffix for row in body]
    if len(seqs[0]) > int(model.cfg.n_ctx):
        raise InputError(
            f"repeated sequences of {len(seqs[0])} tokens exceed the model's context of {model.cfg.n_ctx}"
        )
    batches = batch_sequences(seqs, tokenizer, options.batch_size)
    for b in batches:
        b.extras["half_len"] = half
        b.extras["offset"] = len(prefix)
    return Probe("repeated_random", batches, {"half_len": half, "offset": len(prefix)})
