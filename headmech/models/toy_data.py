"""The toy induction model's data: its word-level tokenizer, built in code, and the
repeated random sequences it trains and is evaluated on (:mod:`headmech.models.toys`)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

__all__ = ["BOS_TOKEN", "PAD_TOKEN", "make_toy_tokenizer", "repeated_random_tokens"]

BOS_TOKEN = "<bos>"
PAD_TOKEN = "<pad>"


def make_toy_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The toy word-level tokenizer, built in code.

    Token ids ``0..vocab_size-1`` are the words ``"t0".."t{vocab_size-1}"``; ``<bos>`` is
    ``vocab_size`` and ``<pad>`` is ``vocab_size + 1``. Words are split on whitespace and
    ``<bos>`` is not added automatically.

    Args:
        vocab_size: number of ordinary tokens.

    Returns:
        A fast tokenizer with ``bos_token`` and ``pad_token`` set that round-trips through
        ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab[BOS_TOKEN] = vocab_size
    vocab[PAD_TOKEN] = vocab_size + 1
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        model_max_length=1_000_000,
    )


def repeated_random_tokens(
    n_sequences: int,
    half_len: int,
    vocab_size: int,
    *,
    generator: torch.Generator,
    bos_id: int | None,
) -> torch.Tensor:
    """BOS + ``half_len`` random tokens + the same tokens again: ``[n_sequences, 1 + 2 * half_len]``
    (``2 * half_len`` without BOS)."""
    block = torch.randint(0, vocab_size, (n_sequences, half_len), generator=generator)
    parts = [block, block]
    if bos_id is not None:
        parts.insert(0, torch.full((n_sequences, 1), bos_id, dtype=torch.long))
    return torch.cat(parts, dim=1)
