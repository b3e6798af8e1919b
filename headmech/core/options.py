"""The probes' sizes and sources (:class:`ProbeOptions`), without torch: the command line
checks them before anything heavy is imported; :mod:`headmech.probes` re-exports it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ProbeOptions"]


@dataclass
class ProbeOptions:
    """Sizes and sources of probe data; ``classify(**probe_options)`` fills these.

    Attributes:
        corpus: a text file, a list of sentences, or None for the default prose corpus.
        n_sentences: prose sentences sampled from the corpus.
        n_sequences: repeated-random-token sequences.
        half_len: tokens in each half of a repeated sequence.
        batch_size: sequences per forward pass.
        seed: seeds every sampler.
        needle_lengths: haystack sizes in tokens of the ``needle`` probe (scaled down to
            fit the model's context).
        needle_depths: where the needle sits in each haystack (0 = start, 1 = end).
    """

    corpus: str | os.PathLike | Sequence[str] | None = None
    n_sentences: int = 256
    n_sequences: int = 32
    half_len: int = 32
    batch_size: int = 16
    seed: int = 0
    needle_lengths: tuple[int, ...] = (300, 700, 1100, 1500)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def __post_init__(self) -> None:
        from headmech.core.checks import probe_options

        probe_options(self)  # one-line InputError on a count < 1, a bad seed, ...
