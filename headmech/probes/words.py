"""The ``repeated_words`` probe: a list of words, then the same list again (Feucht et al. 2025).

Each sequence is BOS + ``half_len`` words drawn from the prose corpus' vocabulary (about
half of them split into several tokens by the model's tokenizer, the rest single tokens)
+ the same words again. Every word is tokenised on its own, with its leading space, so
both copies have the same tokens. Per token, ``extras``:

* ``word_pos``: the word's index in its copy (0 .. half_len - 1; -1 for BOS and padding);
* ``copy``: 0 in the first copy, 1 in the second (-1 for BOS and padding);
* ``word_len``: how many tokens the word has;
* ``concept_target``: at the token just before a multi-token word of the second copy,
  the position of the *last* token of that word's first occurrence (Feucht et al.'s
  concept induction target); -1 elsewhere;
* ``token_target``: at the same queries, the position of the *first* token of the word's
  first occurrence (the token-level induction target: the token after the earlier
  occurrence of the current token); -1 elsewhere;
* ``copy_query``: 1 at every position whose next token belongs to a multi-token word of
  the second copy (the queries of the ``word_copying`` task), else 0.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from headmech.core.errors import InputError
from headmech.probes import (
    Probe,
    ProbeOptions,
    batch_sequences,
    load_sentences,
    register_probe,
    start_ids,
)

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["repeated_words_probe", "word_pieces"]

MIN_WORDS = 8  # of each kind (single- and multi-token) the vocabulary must offer


@lru_cache(maxsize=8)
def _vocabulary(corpus_key: Any) -> tuple[str, ...]:
    sentences = load_sentences(None if corpus_key is None else list(corpus_key))
    return tuple(sorted({w.lower() for s in sentences for w in re.findall(r"[A-Za-z]{4,}", s)}))


def word_pieces(tokenizer: Any, words: tuple[str, ...]) -> tuple[list[list[int]], list[list[int]]]:
    """The words' token ids (each with its leading space, no special tokens), split into
    single-token and multi-token words."""
    single: list[list[int]] = []
    multi: list[list[int]] = []
    for w in words:
        ids = tokenizer(" " + w, add_special_tokens=False)["input_ids"]
        (single if len(ids) == 1 else multi).append(list(ids))
    return single, multi


def _sequence(words: list[list[int]], bos: list[int]) -> tuple[list[int], dict[str, list[int]]]:
    ids = list(bos)
    extra: dict[str, list[int]] = {k: [-1] * len(bos) for k in ("word_pos", "copy", "word_len")}
    starts: list[list[int]] = [[], []]  # per copy, each word's first position
    for copy in (0, 1):
        for i, w in enumerate(words):
            starts[copy].append(len(ids))
            ids += w
            extra["word_pos"] += [i] * len(w)
            extra["copy"] += [copy] * len(w)
            extra["word_len"] += [len(w)] * len(w)
    concept, token, query = [-1] * len(ids), [-1] * len(ids), [0] * len(ids)
    for i, w in enumerate(words):
        if len(w) < 2:
            continue
        first, second = starts[0][i], starts[1][i]
        concept[second - 1] = first + len(w) - 1
        token[second - 1] = first
        for p in range(second - 1, second + len(w) - 1):
            query[p] = 1
    extra.update(concept_target=concept, token_target=token, copy_query=query)
    return ids, extra


@register_probe("repeated_words", "BOS + words (many of several tokens) + the same words again")
def repeated_words_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``n_sequences`` sequences of ``half_len`` corpus words, repeated (module docstring)."""
    tokenizer = model.tokenizer
    corpus = options.corpus
    key = None if corpus is None else tuple(load_sentences(corpus))
    single, multi = word_pieces(tokenizer, _vocabulary(key))
    need = max(MIN_WORDS, options.half_len)
    if len(single) < need or len(multi) < need:
        raise InputError(
            f"the corpus has {len(single)} single-token and {len(multi)} multi-token words "
            f"for this tokenizer; the repeated_words probe needs {need} of each"
        )
    rng = random.Random(options.seed)
    bos = start_ids(model)
    seqs, extras = [], []
    for _ in range(options.n_sequences):
        n_multi = options.half_len // 2
        words = rng.sample(multi, n_multi) + rng.sample(single, options.half_len - n_multi)
        rng.shuffle(words)
        ids, extra = _sequence(words, bos)
        seqs.append(ids)
        extras.append(extra)
    longest = max(len(s) for s in seqs)
    if longest > int(model.cfg.n_ctx):
        raise InputError(
            f"repeated word lists of {longest} tokens exceed the model's context of {model.cfg.n_ctx}"
        )
    batches = batch_sequences(seqs, tokenizer, options.batch_size, extras)
    info = {"half_len": options.half_len, "n_multi_token_words": len(multi)}
    return Probe("repeated_words", batches, info)
