"""Factual recall prompts (Chughtai et al. 2024's subject and relation split), written offline.

"The Eiffel Tower is located in the city of" → " Paris": a *subject* ("The Eiffel
Tower") and a *relation* ("is located in the city of") whose answer the model knows
without any context (parametric recall). Chughtai et al. split each head's direct logit
attribution to the answer at the last position by the source tokens it attends to, the
subject's or the relation's: *subject heads* read the subject, *relation heads* the
relation. The facts here are ones a small model may know: capitals, landmarks, languages,
currencies, inventors, authors; a model is measured only on the facts it completes
(:func:`known_facts`), since a head cannot be shown to recall what the model does not.

The ``facts`` probe: the start tokens + one prompt per sequence (all :data:`FACTS`, in
turn, up to ``n_sequences``); ``extras``: ``subject`` and ``relation`` (``Bool[batch,
pos]``: the two token groups), ``end_pos`` (the last token, which predicts the answer)
and ``answer`` (the answer's first token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.stats import ProbeBatch
from headmech.probes import Probe, ProbeOptions, batch_sequences, register_probe, start_ids

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["FACTS", "answer_is_top", "facts_probe", "known_facts"]

# (subject, relation, answer): the prompt is subject + relation, the answer follows it
FACTS = [
    ("The Eiffel Tower", " is located in the city of", " Paris"),
    ("The Colosseum", " is located in the city of", " Rome"),
    ("The Statue of Liberty", " is located in the city of", " New"),
    ("Big Ben", " is located in the city of", " London"),
    ("The Brandenburg Gate", " is located in the city of", " Berlin"),
    ("The Kremlin", " is located in the city of", " Moscow"),
    ("The Golden Gate Bridge", " is located in the city of", " San"),
    ("The Sydney Opera House", " is located in the country of", " Australia"),
    ("The Taj Mahal", " is located in the country of", " India"),
    ("The Great Wall", " is located in the country of", " China"),
    ("Mount Fuji", " is located in the country of", " Japan"),
    ("The Acropolis", " is located in the country of", " Greece"),
    ("The pyramids of Giza", " are located in the country of", " Egypt"),
    ("Machu Picchu", " is located in the country of", " Peru"),
    ("The capital of France", " is the city of", " Paris"),
    ("The capital of Japan", " is the city of", " Tokyo"),
    ("The capital of Italy", " is the city of", " Rome"),
    ("The capital of Germany", " is the city of", " Berlin"),
    ("The capital of Spain", " is the city of", " Madrid"),
    ("The capital of Russia", " is the city of", " Moscow"),
    ("The capital of England", " is the city of", " London"),
    ("The capital of Egypt", " is the city of", " Cairo"),
    ("The capital of Canada", " is the city of", " Ottawa"),
    ("The capital of Greece", " is the city of", " Athens"),
    ("People in France", " speak the language of", " French"),
    ("People in Germany", " speak the language of", " German"),
    ("People in Spain", " speak the language of", " Spanish"),
    ("People in Italy", " speak the language of", " Italian"),
    ("People in Japan", " speak the language of", " Japanese"),
    ("People in Russia", " speak the language of", " Russian"),
    ("People in Brazil", " speak the language of", " Portuguese"),
    ("People in China", " speak the language of", " Chinese"),
    ("The currency of Japan", " is called the", " yen"),
    ("The currency of the United Kingdom", " is called the", " pound"),
    ("The currency of the United States", " is called the", " dollar"),
    ("The currency of India", " is called the", " rupee"),
    ("The telephone", " was invented by Alexander Graham", " Bell"),
    ("The theory of relativity", " was developed by Albert", " Einstein"),
    ("The play Romeo and Juliet", " was written by William", " Shakespeare"),
    ("The law of gravity", " was described by Isaac", " Newton"),
    ("The light bulb", " was invented by Thomas", " Edison"),
    ("The Mona Lisa", " was painted by Leonardo da", " Vinci"),
    ("Microsoft", " was founded by Bill", " Gates"),
    ("Apple", " was founded by Steve", " Jobs"),
    ("Facebook", " was founded by Mark", " Zuckerberg"),
    ("The iPhone", " is made by the company", " Apple"),
    ("Windows", " is an operating system made by", " Microsoft"),
    ("The Amazon River", " flows through the continent of", " South"),
    ("The Nile", " flows through the continent of", " Africa"),
    ("Water", " is made of hydrogen and", " oxygen"),
    ("The largest planet in the solar system", " is", " Jupiter"),
    ("The closest star to the Earth", " is the", " Sun"),
    ("The Earth", " orbits around the", " Sun"),
    ("A week", " has seven", " days"),
    ("The opposite of hot", " is", " cold"),
    ("The color of the sky on a clear day", " is", " blue"),
    ("Barack Obama", " was the president of the United", " States"),
    ("Lionel Messi", " is a famous player of the sport", " football"),
    ("Paris", " is the capital city of", " France"),
    ("Tokyo", " is the capital city of", " Japan"),
    ("Berlin", " is the capital city of", " Germany"),
    ("Madrid", " is the capital city of", " Spain"),
    ("Rome", " is the capital city of", " Italy"),
    ("London", " is the capital city of the United", " Kingdom"),
]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@register_probe("facts", "factual recall prompts, subject and relation (Chughtai et al. 2024)")
def facts_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """The first ``options.n_sequences`` of :data:`FACTS` (all of them at most), as the
    module docstring says."""
    tok = model.tokenizer
    start = start_ids(model)
    seqs, extras = [], []
    unknown = {getattr(tok, "unk_token_id", None), getattr(tok, "pad_token_id", None)} - {None}
    for subject, relation, answer in FACTS[: options.n_sequences]:
        s, r, a = _encode(tok, subject), _encode(tok, relation), _encode(tok, answer)
        if not (s and r and a) or unknown & {*s, *r, *a}:
            continue  # a word the tokenizer cannot spell (a toy's word-level vocabulary)
        ids = [*start, *s, *r]
        extras.append(
            {"subj": (len(start), len(start) + len(s)), "rel": (len(start) + len(s), len(ids)),
             "end_pos": len(ids) - 1, "answer": a[0]}
        )  # fmt: skip
        seqs.append(ids)
    if len(seqs) < min(8, options.n_sequences):
        raise InputError(f"the tokenizer spells {len(seqs)} of the facts; the probe needs 8")
    batches = batch_sequences(seqs, tok, options.batch_size, extras)
    for b in batches:
        n, width = b.input_ids.shape
        positions = torch.arange(width)
        for key, name in (("subj", "subject"), ("rel", "relation")):
            lo, hi = (torch.tensor([span[i] for span in b.extras[key]]) for i in (0, 1))
            b.extras[name] = (positions >= lo[:, None]) & (positions < hi[:, None])
            del b.extras[key]
        for key in ("end_pos", "answer"):
            b.extras[key] = torch.tensor(b.extras[key], dtype=torch.long)
    return Probe("facts", batches, {"facts": len(seqs), "of": len(FACTS)})


def known_facts(model: Any, batches: list[ProbeBatch]) -> Tensor:
    """Per prompt (in batch order), whether the model completes the fact: its top next
    token at the end is the answer's first token (``Bool[n_prompts]``)."""
    return answer_is_top(model, batches)


def answer_is_top(model: Any, batches: list[ProbeBatch]) -> Tensor:
    """Per sequence (in batch order), whether the model's top next token at ``end_pos``
    is ``answer`` (``Bool[n]``; the batches right-padded, as the probes build them)."""
    out = []
    with torch.no_grad():
        for b in batches:
            logits = model(b.input_ids)  # right-padded: the prompts' own positions are exact
            rows = torch.arange(b.input_ids.shape[0])
            out.append(logits[rows, b.extras["end_pos"]].argmax(-1) == b.extras["answer"])
    return torch.cat(out)
