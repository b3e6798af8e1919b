"""Non-literal needles (NoLiMa's design, Modarressi et al. 2025), written offline.

A character's name is hidden in prose by a sentence about a landmark ("Actually, Mary
lives next to the Eiffel Tower."), and the question asks for the city or country the
landmark is in ("Which character has been to Paris?"): the needle and the question share
no content word, so a head that finds the needle by matching the question's words finds
nothing; the model has to connect them through what it knows (the landmark's city), then
copy the name. The *literal* control asks with the needle's own words ("Which character
lives next to the Eiffel Tower?"), as Kamradt's and Wu et al.'s needles do.

Each sequence: the start tokens, a short haystack of whole prose sentences (shuffled per
trial, about ``NONLITERAL_LENGTH`` tokens; the needle at depths in turn), then
``\\nQuestion: <question>\\nAnswer:``, whose next token is the name. ``extras``:
``needle_start`` / ``needle_end`` (the needle's half-open span), ``name_pos`` (the name
inside the needle), ``end_pos`` (the last token, which predicts the name) and ``answer``
(the name's token). Probes ``nonliteral`` and ``literal``: the same trials (the same
haystacks, names and landmarks, from the same seed), asked the two ways.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.stats import ProbeBatch
from headmech.probes import (
    Probe,
    ProbeOptions,
    batch_sequences,
    load_sentences,
    register_probe,
    start_ids,
)
from headmech.probes.facts import answer_is_top
from headmech.probes.ioi import ioi_names

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["LANDMARKS", "NONLITERAL_LENGTH", "literal_probe", "name_recall", "nonliteral_probe"]

NONLITERAL_LENGTH = 256  # haystack tokens: a short context a small model can answer in
DEPTHS = (0.1, 0.5, 0.9)
# (landmark, where it is): the question names the place, never a word of the landmark
LANDMARKS = [
    ("the Eiffel Tower", "Paris"), ("the Colosseum", "Rome"), ("Big Ben", "London"),
    ("the Brandenburg Gate", "Berlin"), ("the Kremlin", "Moscow"),
    ("the Golden Gate Bridge", "San Francisco"), ("the Taj Mahal", "India"),
    ("the Statue of Liberty", "New York"), ("the Sagrada Familia", "Barcelona"),
    ("the Acropolis", "Athens"), ("the Forbidden City", "Beijing"),
    ("the Leaning Tower of Pisa", "Italy"), ("the Hollywood sign", "Los Angeles"),
    ("the Space Needle", "Seattle"), ("the Burj Khalifa", "Dubai"),
    ("the Louvre", "France"), ("the Tower Bridge", "England"), ("Red Square", "Russia"),
    ("the Sydney Opera House", "Australia"), ("the CN Tower", "Toronto"),
    ("the Great Pyramid of Giza", "Egypt"), ("Mount Fuji", "Japan"),
    ("the Parthenon", "Greece"), ("the Alhambra", "Spain"),
]  # fmt: skip


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _build(model: TransformerBridge, options: ProbeOptions, literal: bool) -> Probe:
    tok = model.tokenizer
    names = ioi_names(tok)
    if len(names) < 5:
        raise InputError(f"the tokenizer has {len(names)} single-token names; needles need 5")
    start = start_ids(model)
    context = int(getattr(model.cfg, "n_ctx", 2048) or 2048)
    length = min(NONLITERAL_LENGTH, context - 48)  # room for the needle and the question
    if length < 8:
        raise InputError(f"the model's context of {context} tokens holds no haystack")
    sentences = [_encode(tok, " " + s) for s in load_sentences(options.corpus)]
    rng = random.Random(options.seed)
    seqs, extras = [], []
    for i in range(options.n_sequences):
        landmark, place = LANDMARKS[i % len(LANDMARKS)]
        name = names[rng.randrange(len(names))]
        order = list(range(len(sentences)))
        rng.shuffle(order)
        hay: list[list[int]] = []
        for j in order:
            if sum(map(len, hay)) + len(sentences[j]) > length:
                break
            hay.append(sentences[j])
        cut = round(DEPTHS[i % len(DEPTHS)] * len(hay))
        before = [t for s in hay[:cut] for t in s]
        after = [t for s in hay[cut:] for t in s]
        lead, tail = _encode(tok, " Actually,"), _encode(tok, f" lives next to {landmark}.")
        needle = [*lead, name, *tail]
        question = (
            f"Which character lives next to {landmark}?"
            if literal
            else f"Which character has been to {place}?"
        )
        ask = _encode(tok, f"\nQuestion: {question}\nAnswer:")
        ids = [*start, *before, *needle, *after, *ask]
        at = len(start) + len(before)
        extras.append(
            {"needle_start": at, "needle_end": at + len(needle), "name_pos": at + len(lead),
             "end_pos": len(ids) - 1, "answer": name}
        )  # fmt: skip
        seqs.append(ids)
    batches = batch_sequences(seqs, tok, options.batch_size, extras)
    for b in batches:
        for key in ("needle_start", "needle_end", "name_pos", "end_pos", "answer"):
            b.extras[key] = torch.tensor(b.extras[key], dtype=torch.long)
    kind = "literal" if literal else "nonliteral"
    return Probe(kind, batches, {"haystack_tokens": length, "landmarks": len(LANDMARKS)})


@register_probe("nonliteral", "needles the question shares no word with (NoLiMa, 2025)")
def nonliteral_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``options.n_sequences`` trials asked by the landmark's place (module docstring)."""
    return _build(model, options, literal=False)


@register_probe("literal", "the nonliteral probe's needles asked with their own words")
def literal_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """The same trials as :func:`nonliteral_probe`, asked with the needle's words."""
    return _build(model, options, literal=True)


def name_recall(model: Any, batches: list[ProbeBatch]) -> Tensor:
    """Per trial (in batch order), whether the model's top next token at the end is the
    hidden name (``Bool[n_trials]``; :func:`headmech.probes.facts.answer_is_top`)."""
    return answer_is_top(model, batches)
