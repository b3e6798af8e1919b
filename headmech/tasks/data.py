"""The built-in tasks' data: which positions each scores, and how its inputs are corrupted.

* ``lm`` — every next token of the prose probe (decoders), the sentence embedding
  (encoders); corrupted by replacing every ordinary token with a random one;
* ``induction`` — the repeated half of random-token sequences (every repeated token but
  the first); corrupted by fresh random tokens in the first half (no repeat left);
* ``retrieval`` — the teacher-forced needle answer; corrupted by random tokens in place of
  the needle's code (the answer keeps the real one);
* ``succession`` — the next item of ordinal sequences (" Monday, Tuesday, ..."), every
  item but the first (predicted at the comma before it); corrupted by shuffling each
  sequence's items (no order left);
* ``facts`` — the answer's first token after a fact's subject and relation (Chughtai et
  al. 2024's prompts, :mod:`headmech.probes.facts`); corrupted by random tokens in place
  of the subject;
* ``nonliteral`` / ``literal`` — the hidden name after a question that shares no word with
  its needle (NoLiMa's design, :mod:`headmech.probes.nonliteral`) / that asks with the
  needle's own words; corrupted by another name in the needle (the answer keeps the real one);
* ``ioi`` — minus the logit difference IO − S at the end of IOI prompts (Wang et al.
  2022); corrupted into their ABC prompts (three other names, none repeated);
* ``agreement`` — minus the logit difference between the verb of the subject's number and
  the other at the attractor, "The keys to the cabinet" → " are" over " is" (Linzen et al.
  2016's task, :mod:`headmech.probes.agreement`); corrupted by the subject's other number;
* ``icl`` — the answer's loss after 8 in-context examples (antonyms, country capitals,
  capitalisation; Todd et al. 2023); corrupted by shuffling the examples' answers.

``copy_suppression``'s data is :mod:`headmech.tasks.copying`.
Importing this module registers them in :data:`headmech.core.registry.TASKS`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from headmech.core.registry import TASKS
from headmech.probes import random_token_ids
from headmech.probes.needle import needle_spans
from headmech.stream.engine import ProbeBatch
from headmech.tasks import (
    CORRUPT_SEED,
    EmbeddingTask,
    LogitDiffTask,
    Task,
    TokenLossTask,
    corrupt_prose,
    is_causal,
)

__all__ = ["corrupt_prose", "icl_task", "select_lm"]


def select_lm(batch: ProbeBatch) -> tuple[Bool[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """The ``lm`` task's positions: every real token that has a real next token, and that
    next token (the query positions and their targets)."""
    ids, mask = batch.input_ids, batch.attention_mask.bool()
    query = torch.zeros_like(mask)
    query[:, :-1] = mask[:, 1:]  # position i predicts token i + 1 when that token is real
    target = torch.zeros_like(ids)
    target[:, :-1] = ids[:, 1:]
    return query, target


def _select_induction(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    query, target = select_lm(batch)
    half, off = int(batch.extras["half_len"]), int(batch.extras["offset"])
    pos = torch.arange(query.shape[1], device=query.device)
    # the repeated tokens but the first: predicted from positions off+half .. off+2*half-2
    window = (pos >= off + half) & (pos <= off + 2 * half - 2)
    return query & window[None], target


def _corrupt_induction(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Fresh random tokens in the first half: the second half is no longer a repeat."""
    half, off = int(batch.extras["half_len"]), int(batch.extras["offset"])
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    ids[:, off : off + half] = random_token_ids(model.tokenizer, g, (ids.shape[0], half))
    return replace(batch, input_ids=ids)


def _select_retrieval(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    answer_pos, _, valid, _ = needle_spans(batch)
    query = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    qpos = (answer_pos - 1).clamp(min=0)  # the position that predicts each answer token
    query.scatter_(1, qpos, valid)
    target = torch.zeros_like(batch.input_ids)
    target.scatter_(1, qpos, batch.input_ids.gather(1, answer_pos.clamp(min=0)))
    return query, target


def _corrupt_retrieval(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """The needle's code tokens replaced by random tokens; the answer keeps the real code."""
    _, source_pos, valid, _ = needle_spans(batch)
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    fresh = random_token_ids(model.tokenizer, g, tuple(source_pos.shape))
    rows = torch.arange(ids.shape[0])[:, None].expand_as(source_pos)
    ids[rows[valid], source_pos[valid]] = fresh[valid]
    return replace(batch, input_ids=ids)


def _select_documents(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    """The last position, which predicts the gold document's city."""
    rows = torch.arange(batch.input_ids.shape[0])
    query = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    query[rows, batch.extras["end_pos"]] = True
    target = torch.zeros_like(batch.input_ids)
    target[rows, batch.extras["end_pos"]] = batch.extras["answer"]
    return query, target


def _corrupt_documents(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """The gold document's city replaced by another one-token city; the answer keeps the
    real one (the question's answer is no longer in the context)."""
    from headmech.probes.documents import one_token_cities

    cities = torch.tensor(one_token_cities(model.tokenizer))
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    rows = torch.arange(ids.shape[0])
    pick = torch.randint(len(cities) - 1, (len(rows),), generator=g)
    answer = batch.extras["answer"]
    # another city: skip the answer's own index in the list
    index = (cities[None, :] == answer[:, None]).float().argmax(-1)
    other = cities[pick + (pick >= index).long()]
    ids[rows, batch.extras["answer_pos"]] = other
    return replace(batch, input_ids=ids)


def _corrupt_needle_name(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """The needle's name replaced by another single-token name; the answer keeps the real
    one (the name asked for is no longer in the context)."""
    from headmech.probes.ioi import ioi_names

    names = torch.tensor(ioi_names(model.tokenizer))
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    rows = torch.arange(ids.shape[0])
    pick = torch.randint(len(names) - 1, (len(rows),), generator=g)
    index = (names[None, :] == batch.extras["answer"][:, None]).float().argmax(-1)
    ids[rows, batch.extras["name_pos"]] = names[pick + (pick >= index).long()]
    return replace(batch, input_ids=ids)


def _corrupt_facts(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """The subject's tokens replaced by random tokens; the answer keeps the real one (the
    relation is left: which fact is asked is gone)."""
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    subject = batch.extras["subject"]
    fresh = random_token_ids(model.tokenizer, g, tuple(ids.shape))
    ids[subject] = fresh[subject]
    return replace(batch, input_ids=ids)


def _select_succession(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    query, target = select_lm(batch)
    return query & batch.extras["next_item"], target


def _corrupt_succession(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Each sequence's items in a random order (the same tokens, no succession)."""
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    items = batch.extras["item"]
    for row in range(ids.shape[0]):
        pos = items[row].nonzero()[:, 0]
        ids[row, pos] = ids[row, pos[torch.randperm(len(pos), generator=g)]]
    return replace(batch, input_ids=ids)


def _succession(model: Any) -> Task:
    import headmech.probes.ordinal  # noqa: F401  (registers the ordinal probe)

    return TokenLossTask(
        "succession",
        "ordinal",
        _select_succession,
        "mean loss of the next item in ordinal sequences (days, months, letters, ...)",
        _corrupt_succession,
    )


def _contrast_at_end(
    batch: ProbeBatch, good_key: str, bad_key: str
) -> tuple[Tensor, Tensor, Tensor]:
    """At each prompt's ``end_pos``, the tokens ``extras[good_key]`` against
    ``extras[bad_key]`` (a :class:`LogitDiffTask` contrast)."""
    e = batch.extras
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
    end = e["end_pos"].to(rows.device)
    query = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    query[rows, end] = True
    good = torch.zeros_like(batch.input_ids)
    bad = torch.zeros_like(batch.input_ids)
    good[rows, end] = e[good_key].to(rows.device)
    bad[rows, end] = e[bad_key].to(rows.device)
    return query, good, bad


def _select_ioi(batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor]:
    """The prompt's last token; there the indirect object against the subject."""
    return _contrast_at_end(batch, "io", "s")


def _ioi(model: Any) -> Task:
    from headmech.probes.ioi import corrupt_ioi

    return LogitDiffTask(
        "ioi",
        "ioi",
        _select_ioi,
        "logit(S) - logit(IO) at the end of IOI prompts (minus the IOI logit difference)",
        corrupt_ioi,
    )


def _select_agreement(batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor]:
    """The attractor (which predicts the verb); there the verb of the subject's number
    against the verb of the attractor's."""
    return _contrast_at_end(batch, "good", "bad")


def _agreement(model: Any) -> Task:
    from headmech.probes.agreement import corrupt_agreement

    return LogitDiffTask(
        "agreement",
        "agreement",
        _select_agreement,
        "logit(verb of the attractor's number) - logit(verb of the subject's) after "
        "'The <subject> <preposition> the <attractor>' (minus the agreement logit difference)",
        corrupt_agreement,
    )


def _select_icl(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    """The query's last token (the colon); there the answer."""
    lengths = batch.attention_mask.sum(1)
    rows = torch.arange(lengths.shape[0], device=lengths.device)
    query = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    query[rows, lengths - 1] = True
    target = torch.zeros_like(batch.input_ids)
    target[rows, lengths - 1] = batch.extras["answer"].to(target.device)
    return query, target


def icl_task(probability: bool = False) -> TokenLossTask:
    """The ``icl`` task; with ``probability``, its metric is minus the answer's probability
    (function-vector heads' indirect effect) instead of its loss."""
    from headmech.probes.icl import shuffle_labels

    what = "minus the probability" if probability else "loss"
    return TokenLossTask(
        "icl",
        "icl",
        _select_icl,
        f"{what} of the answer to an in-context query (antonyms, capitals, capitalisation)",
        shuffle_labels,
        probability=probability,
    )


def _icl(model: Any) -> Task:
    return icl_task()


def _lm(model: Any) -> Task:
    if is_causal(model):
        return TokenLossTask(
            "lm",
            "prose",
            select_lm,
            "mean next-token cross-entropy on the prose probe",
            corrupt_prose,
        )
    return EmbeddingTask()


def _induction(model: Any) -> Task:
    return TokenLossTask(
        "induction",
        "repeated_random",
        _select_induction,
        "mean loss on the repeated half of random-token sequences",
        _corrupt_induction,
    )


def _documents(model: Any) -> Task:
    return TokenLossTask(
        "documents",
        "documents",
        _select_documents,
        "mean NLL of the gold document's city at the end of multi-document questions",
        _corrupt_documents,
    )


def _facts(model: Any) -> Task:
    return TokenLossTask(
        "facts",
        "facts",
        _select_documents,  # the same: the last position, which predicts ``answer``
        "mean NLL of a fact's answer (its first token) after the subject and relation",
        _corrupt_facts,
    )


def _nonliteral(model: Any) -> Task:
    return TokenLossTask(
        "nonliteral",
        "nonliteral",
        _select_documents,  # the last position, which predicts ``answer`` (the name)
        "mean NLL of the needle's name after a question sharing no word with the needle",
        _corrupt_needle_name,
    )


def _literal(model: Any) -> Task:
    return TokenLossTask(
        "literal",
        "literal",
        _select_documents,
        "mean NLL of the needle's name after a question asked with the needle's words",
        _corrupt_needle_name,
    )


def _retrieval(model: Any) -> Task:
    return TokenLossTask(
        "retrieval",
        "needle",
        _select_retrieval,
        "mean NLL of the teacher-forced needle answer tokens",
        _corrupt_retrieval,
    )


TASKS.register(
    "lm", _lm, summary="next-token loss (decoders), 1 - cos of the sentence embedding (encoders)"
)
TASKS.register(
    "induction", _induction, summary="loss on the repeated half of random-token sequences"
)
TASKS.register(
    "retrieval", _retrieval, summary="NLL of the needle's answer in a haystack (decoders)"
)
TASKS.register(
    "documents",
    _documents,
    summary="NLL of the gold document's city after five documents (QRHead's setting; decoders)",
)
TASKS.register(
    "facts",
    _facts,
    summary="NLL of a fact's answer after subject and relation (Chughtai et al.; decoders)",
)
TASKS.register(
    "nonliteral",
    _nonliteral,
    summary="NLL of a hidden name asked without the needle's words (NoLiMa's; decoders)",
)
TASKS.register(
    "literal",
    _literal,
    summary="NLL of a hidden name asked with the needle's words (nonliteral's control)",
)
TASKS.register(
    "agreement",
    _agreement,
    summary="minus the logit difference of the verb's number across an attractor (decoders)",
)
TASKS.register("ioi", _ioi, summary="minus the logit difference IO - S on IOI prompts (decoders)")
TASKS.register(
    "icl", _icl, summary="answer loss of in-context prompts: antonyms, capitals, ... (decoders)"
)
TASKS.register("succession", _succession, summary="next-item loss on ordinal sequences (decoders)")
