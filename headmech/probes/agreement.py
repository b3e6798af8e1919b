"""Subject-verb agreement across an attractor (Linzen et al. 2016), written offline.

"The keys to the cabinet" → " are": the subject ("keys") and the noun just before the verb
(the *attractor*, "cabinet") differ in number, so a model that predicts the verb's number
from the nearest noun gets it wrong; the verb agrees with the subject. Each prompt is
``The <subject><preposition> the <attractor>``, then a verb: the subject and the attractor are nouns of
opposite number (one token each, with a leading space, for the model's tokenizer), the
prepositional phrases are one to four words long, and every subject and attractor is
asked with each of them, so the subject's distance from the prompt's end varies within the
same nouns and a head that attends a fixed number of tokens back finds it only as often as
that distance recurs (the positional baseline of :func:`positional_baseline`, about 0.29).
Half the subjects are singular.

The ``agreement`` probe: ``options.n_sequences`` pairs of nouns, each with every preposition
of :data:`PREPOSITIONS` and each of those followed by either verb: the start tokens +
one prompt per sequence, ``The <subject><preposition> the <attractor><verb>``. ``extras``
(``LongTensor[batch]`` each): ``subj_pos`` and ``attr_pos`` (where the two nouns stand),
``end_pos`` (the attractor, which predicts the verb: the ``agreement`` task reads it there,
where the verb after it cannot be seen), ``verb_pos`` (the verb, the last token), ``good``
and ``bad`` (the verb of the subject's number and of the other: " is"/" are", " was"/
" were", " has"/" have"), ``plural`` (1 where the subject is plural) and ``agrees`` (1
where the verb that follows is ``good``; 0 where it agrees with the attractor: an
ungrammatical prompt, where a head that matches on number, not on syntax, attends to the
attractor).
:func:`corrupt_agreement` swaps each subject for its other number (the answer extras
kept: a head that carries the subject's number now carries the wrong one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.stats import ProbeBatch
from headmech.probes import Probe, ProbeOptions, batch_sequences, register_probe, start_ids

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "NOUNS",
    "PREPOSITIONS",
    "VERBS",
    "agreement_accuracy",
    "agreement_probe",
    "corrupt_agreement",
    "noun_pairs",
    "positional_baseline",
]

# (singular, plural): common nouns that can be a subject and an attractor
NOUNS = [
    ("key", "keys"), ("dog", "dogs"), ("book", "books"), ("car", "cars"), ("house", "houses"),
    ("boy", "boys"), ("girl", "girls"), ("table", "tables"), ("door", "doors"),
    ("friend", "friends"), ("teacher", "teachers"), ("student", "students"),
    ("window", "windows"), ("tree", "trees"), ("bird", "birds"), ("cat", "cats"),
    ("road", "roads"), ("song", "songs"), ("letter", "letters"), ("picture", "pictures"),
    ("chair", "chairs"), ("box", "boxes"), ("child", "children"), ("man", "men"),
    ("woman", "women"), ("river", "rivers"), ("player", "players"), ("doctor", "doctors"),
    ("farmer", "farmers"), ("king", "kings"), ("road", "roads"), ("bottle", "bottles"),
    ("wall", "walls"), ("flower", "flowers"), ("city", "cities"), ("boat", "boats"),
    ("painting", "paintings"), ("officer", "officers"), ("writer", "writers"),
    ("machine", "machines"), ("garden", "gardens"), ("building", "buildings"),
]  # fmt: skip
# one to four words before the attractor's "the": each pair of nouns is asked with all of
# them, so the subject's distance from the prompt's end varies within the same nouns
PREPOSITIONS = [
    " near", " behind", " beside", " under",
    " next to", " close to", " far from", " across from",
    " in front of", " on top of",
    " to the left of", " to the right of", " at the back of", " on the side of",
]  # fmt: skip
VERBS = [(" is", " are"), (" was", " were"), (" has", " have")]


def _one_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    unknown = getattr(tokenizer, "unk_token_id", None)
    return int(ids[0]) if len(ids) == 1 and ids[0] != unknown else None


def noun_pairs(tokenizer: Any) -> list[tuple[int, int]]:
    """Token ids of the (singular, plural) pairs whose two forms are one token each with a
    leading space (in :data:`NOUNS`' order, without repeats)."""
    out: list[tuple[int, int]] = []
    for s, p in dict.fromkeys(NOUNS):
        a, b = _one_token(tokenizer, " " + s), _one_token(tokenizer, " " + p)
        if a is not None and b is not None and a != b:
            out.append((a, b))
    return out


def _verbs(tokenizer: Any) -> list[tuple[int, int]]:
    out = []
    for s, p in VERBS:
        a, b = _one_token(tokenizer, s), _one_token(tokenizer, p)
        if a is not None and b is not None:
            out.append((a, b))
    return out


@register_probe("agreement", "subject-verb agreement across an attractor (Linzen et al. 2016)")
def agreement_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``2 * len(PREPOSITIONS) * options.n_sequences`` prompts (28 a pair):
    ``options.n_sequences`` (subject, attractor) pairs drawn from ``options.seed``, each
    with every preposition and each of those followed by either verb, the subject singular
    in every other pair, verbs in turn by pair (module docstring)."""
    tok = model.tokenizer
    nouns, verbs = noun_pairs(tok), _verbs(tok)
    if len(nouns) < 4 or not verbs:
        raise InputError(
            f"the tokenizer has {len(nouns)} single-token noun pairs and {len(verbs)} verb "
            "pairs; agreement prompts need at least 4 and 1"
        )
    the = tok.encode(" the", add_special_tokens=False)
    start, head = start_ids(model), tok.encode("The", add_special_tokens=False)
    g = torch.Generator().manual_seed(options.seed)
    seqs, extras = [], []
    for i in range(options.n_sequences):
        a, b = (nouns[int(j)] for j in torch.randperm(len(nouns), generator=g)[:2])
        plural = i % 2 == 1
        subj, attr = (a[1], b[0]) if plural else (a[0], b[1])
        sing, plur = verbs[(i // 2) % len(verbs)]
        for preposition in PREPOSITIONS:
            prep = tok.encode(preposition, add_special_tokens=False)
            ids = [*start, *head, subj, *prep, *the, attr]
            good, bad = (plur, sing) if plural else (sing, plur)
            for verb in (good, bad):  # the verb of the subject's number, then the other's
                seqs.append([*ids, verb])
                extras.append(
                    {
                        "subj_pos": len(start) + len(head),
                        "attr_pos": len(ids) - 1,
                        "end_pos": len(ids) - 1,
                        "verb_pos": len(ids),
                        "good": good,
                        "bad": bad,
                        "plural": int(plural),
                        "agrees": int(verb == good),
                    }
                )
    batches = batch_sequences(seqs, tok, options.batch_size, extras)
    for batch in batches:
        for key in (
            "subj_pos",
            "attr_pos",
            "end_pos",
            "verb_pos",
            "good",
            "bad",
            "plural",
            "agrees",
        ):
            batch.extras[key] = torch.tensor(batch.extras[key], dtype=torch.long)
    info = {"noun_pairs": len(nouns), "verb_pairs": len(verbs), "prepositions": len(PREPOSITIONS)}
    return Probe("agreement", batches, info)


def positional_baseline(batches: list[ProbeBatch]) -> float:
    """The share of prompts whose subject stands at the most common distance from the
    prompt's end: how often a head attending a fixed number of tokens back finds it."""
    offsets = torch.cat([b.extras["end_pos"] - b.extras["subj_pos"] for b in batches])
    return float(torch.bincount(offsets).max()) / max(len(offsets), 1)


def corrupt_agreement(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Each subject swapped for its other number (the answer extras kept)."""
    other = {}
    for s, p in noun_pairs(model.tokenizer):
        other[s], other[p] = p, s
    ids = batch.input_ids.clone()
    rows = torch.arange(ids.shape[0])
    pos = batch.extras["subj_pos"]
    ids[rows, pos] = torch.tensor([other[int(t)] for t in ids[rows, pos]], dtype=ids.dtype)
    return replace(batch, input_ids=ids)


def agreement_accuracy(model: Any, batches: list[ProbeBatch]) -> tuple[float, Tensor]:
    """The share of prompts whose verb of the subject's number has the higher logit, and
    each prompt's logit difference (good - bad), read at the attractor; each prompt once
    (its twin with the other verb reads the same position)."""
    diffs = []
    with torch.no_grad():
        for b in batches:
            logits = model(b.input_ids)  # right-padded: the prompts' own positions are exact
            rows = torch.arange(b.input_ids.shape[0])
            last = logits[rows, b.extras["end_pos"]].float()
            once = b.extras["agrees"].bool()
            diffs.append((last[rows, b.extras["good"]] - last[rows, b.extras["bad"]])[once])
    d = torch.cat(diffs)
    return float((d > 0).float().mean()), d
