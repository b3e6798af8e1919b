"""Multi-document question answering (QRHead's setting, Zhang et al. 2025), written offline.

QRHead scores a head by the attention mass that the *question's* tokens put on the *gold
document*, the one that holds the answer, among distractors. Each sequence here: the start
tokens, :data:`N_DOCUMENTS` short documents, each ``\\nDocument k:`` then one sentence of
prose and one fact about a different person (``" Mary lives in Lisbon."``, a one-token
name and a one-token city, both distinct within the trial), then
``\\nQuestion: Where does Mary live?\\nAnswer: Mary lives in``, whose next token is the
gold document's city. The gold document moves through the positions in turn (trial ``i``: document
``i mod N``), so no position explains the question's attention to it; the other documents
name other people in other cities, so only the question's name points at the gold one.

``extras``: ``doc_start`` / ``doc_end`` (``LongTensor[batch, n_documents]``, half-open spans
from each document's header to its last token), ``gold`` (the gold document's index),
``query_start`` / ``query_end`` (the question's span, from ``Question`` to ``?``),
``name_pos`` (the question's name), ``answer_pos`` (the city in the gold document),
``end_pos`` (the last token, which predicts the city) and ``answer`` (the city's token).
Where the model's context is short the prose sentences are left out, then documents, down
to two (``info["documents"]`` says how many).
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

__all__ = [
    "CITIES",
    "NULL_QUERY",
    "N_DOCUMENTS",
    "document_recall",
    "documents_probe",
    "null_query_batch",
    "one_token_cities",
    "query_documents_probe",
    "query_to_gold",
    "with_null_twins",
]

N_DOCUMENTS = 5
"""Documents per question: the gold one and four distractors."""
MAX_SENTENCE_TOKENS = 24  # a longer prose sentence is not used as a document's filler
CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Cairo", "Lisbon", "Vienna",
    "Dublin", "Oslo", "Prague", "Boston", "Chicago", "Sydney", "Moscow", "Toronto", "Denver",
    "Dallas", "Seattle", "Athens", "Warsaw", "Brussels", "Munich", "Milan", "Geneva",
    "Delhi", "Mumbai", "Lagos", "Nairobi", "Lima", "Havana", "Manila", "Seoul", "Beijing",
    "Shanghai", "Bangkok", "Istanbul", "Stockholm", "Helsinki", "Copenhagen", "Budapest",
    "Amsterdam", "Barcelona", "Venice", "Florence", "Houston", "Phoenix", "Miami",
    "Atlanta", "Detroit", "Portland", "Austin", "Montreal", "Vancouver", "Melbourne",
]  # fmt: skip


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def one_token_cities(tokenizer: Any) -> list[int]:
    """Token ids of the :data:`CITIES` that are one token with a leading space (sorted)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    out = set()
    for city in CITIES:
        ids = _encode(tokenizer, " " + city)
        if len(ids) == 1 and ids[0] != unknown:
            out.add(ids[0])
    return sorted(out)


def _trial(
    tok: Any, rng: random.Random, people: list[tuple[int, int]], gold: int, fillers: list[list[int]], start: list[int]
) -> tuple[list[int], dict[str, Any]]:  # fmt: skip
    """One sequence and its extras: a document per ``(name, city)`` of ``people``."""
    ids = list(start)
    doc_start, doc_end, answer_pos = [], [], -1
    for k, (name, city) in enumerate(people):
        doc_start.append(len(ids))
        ids += _encode(tok, f"\nDocument {k + 1}:")
        if fillers:
            ids += fillers[rng.randrange(len(fillers))]
        ids += [*_encode(tok, " " + tok.decode([name]).strip() + " lives in")]
        if k == gold:
            answer_pos = len(ids)
        ids += [city, *_encode(tok, ".")]
        doc_end.append(len(ids))
    name = people[gold][0]
    before = _encode(tok, "\nQuestion: Where does")
    query_start = len(ids) + 1  # "Question", after the line break
    ids += before
    name_pos = len(ids)
    ids += [name, *_encode(tok, " live?")]
    query_end = len(ids)
    # the answer begun as the documents state facts: its next token is the city
    ids += [*_encode(tok, "\nAnswer:"), name, *_encode(tok, " lives in")]
    extras = {
        "doc_start": doc_start, "doc_end": doc_end, "gold": gold, "query_start": query_start,
        "query_end": query_end, "name_pos": name_pos, "answer_pos": answer_pos,
        "end_pos": len(ids) - 1, "answer": people[gold][1],
    }  # fmt: skip
    return ids, extras


@register_probe("documents", "multi-document questions: the answer in one of five (QRHead, 2025)")
def documents_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``options.n_sequences`` questions, each over :data:`N_DOCUMENTS` documents (module
    docstring); ``options.corpus`` gives the documents' prose sentences."""
    tok = model.tokenizer
    names, cities = ioi_names(tok), one_token_cities(tok)
    if len(names) < N_DOCUMENTS or len(cities) < N_DOCUMENTS:
        raise InputError(
            f"the tokenizer has {len(names)} one-token names and {len(cities)} one-token "
            f"cities; documents need {N_DOCUMENTS} of each"
        )
    start = start_ids(model)
    context = int(getattr(model.cfg, "n_ctx", 2048) or 2048)
    sentences = [_encode(tok, " " + s) for s in load_sentences(options.corpus)]
    fillers = [s for s in sentences if len(s) <= MAX_SENTENCE_TOKENS]
    rng = random.Random(options.seed)
    trials = [
        (rng.sample(names, N_DOCUMENTS), rng.sample(cities, N_DOCUMENTS), rng.randrange(2**31))
        for _ in range(options.n_sequences)
    ]
    # the longest layout that fits every trial: prose fillers, then fewer documents
    for n_docs, with_fillers in [(N_DOCUMENTS, True), *((n, False) for n in range(N_DOCUMENTS, 1, -1))]:  # fmt: skip
        built = []
        for i, (who, where, seed) in enumerate(trials):
            people = list(zip(who[:n_docs], where[:n_docs], strict=True))
            used = fillers if with_fillers else []
            built.append(_trial(tok, random.Random(seed), people, i % n_docs, used, start))
        if max(len(ids) for ids, _ in built) <= context:
            break
    else:
        raise InputError(f"the model's context of {context} tokens holds no two documents")
    batches = batch_sequences(
        [ids for ids, _ in built], tok, options.batch_size, [e for _, e in built]
    )
    for b in batches:
        for key in ("doc_start", "doc_end"):  # padded to the batch's length: one per document
            b.extras[key] = b.extras[key][:, :n_docs]
        for key in (
            "gold",
            "query_start",
            "query_end",
            "name_pos",
            "answer_pos",
            "end_pos",
            "answer",
        ):
            b.extras[key] = torch.tensor(b.extras[key], dtype=torch.long)
    info = {"documents": n_docs, "prose_fillers": with_fillers, "cities": len(cities)}
    return Probe("documents", batches, info)


def query_to_gold(batch: ProbeBatch) -> Tensor:
    """``Bool[batch, query_pos, key_pos]``: from each token of the question (``query_start``
    to ``query_end``) to every token of the gold document (``doc_start`` to ``doc_end`` of
    document ``gold``); other queries have no target."""
    n_seq, n_pos = batch.input_ids.shape
    pos = torch.arange(n_pos)
    rows = torch.arange(n_seq)
    gold = batch.extras["gold"]
    lo, hi = batch.extras["doc_start"][rows, gold], batch.extras["doc_end"][rows, gold]
    asks = (pos >= batch.extras["query_start"][:, None]) & (
        pos < batch.extras["query_end"][:, None]
    )
    keys = (pos >= lo[:, None]) & (pos < hi[:, None])  # [batch, key_pos]
    return asks[:, :, None] & keys[:, None, :]


NULL_QUERY = "Question: N/A"
"""QRHead's calibration query ("N/A", the authors' ``null_query``), with the probe's label."""


def null_query_batch(batch: ProbeBatch, tokenizer: Any) -> ProbeBatch:
    """A ``documents`` batch with each question replaced by :data:`NULL_QUERY` (QRHead's
    calibration prompt): the same tokens before ``query_start``, the null query from there,
    nothing after it (masked, special); ``query_end`` moves to its end."""
    from dataclasses import replace

    null = torch.tensor(tokenizer.encode(NULL_QUERY, add_special_tokens=False))
    ids, special = batch.input_ids.clone(), batch.special.clone()
    mask = torch.zeros_like(batch.attention_mask)
    start = batch.extras["query_start"]
    end = start + len(null)
    if int(end.max()) > ids.shape[1]:
        raise ValueError("the null query does not fit where the question stood")
    for r in range(ids.shape[0]):
        s, e = int(start[r]), int(end[r])
        ids[r, s:e] = null
        mask[r, :e] = 1
        special[r, s:e] = False
        special[r, e:] = True
    return replace(
        batch, input_ids=ids, attention_mask=mask, special=special,
        extras={**batch.extras, "query_end": end},
    )  # fmt: skip


def document_recall(model: Any, batches: list[ProbeBatch]) -> Tensor:
    """Per question (in batch order), whether the model's top next token at the end is
    the gold document's city (``Bool[n]``; :func:`headmech.probes.facts.answer_is_top`)."""
    return answer_is_top(model, batches)


def with_null_twins(batch: ProbeBatch, tokenizer: Any) -> ProbeBatch:
    """The batch with each question followed by its :func:`null_query_batch` twin, rows
    interleaved (row ``2i`` the question, ``2i + 1`` the same prompt with the null query),
    ``extras["null"]`` True on the twins: QRHead's calibration read from one forward
    pass of both. A cut at an even row keeps every pair."""
    from dataclasses import replace

    null = null_query_batch(batch, tokenizer)

    def weave(a: Any, b: Any) -> Any:
        if isinstance(a, Tensor):
            return torch.stack([a, b], 1).flatten(0, 1)
        return [x for pair in zip(a, b, strict=True) for x in pair]

    n = batch.input_ids.shape[0]
    extras = {k: weave(batch.extras[k], null.extras[k]) for k in batch.extras}
    extras["null"] = torch.arange(2 * n) % 2 == 1
    return replace(
        batch,
        input_ids=weave(batch.input_ids, null.input_ids),
        attention_mask=weave(batch.attention_mask, null.attention_mask),
        special=weave(batch.special, null.special),
        extras=extras,
    )


@register_probe(
    "query_documents",
    "the documents probe with each question's null-query twin (QRHead's calibration)",
)
def query_documents_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """The ``documents`` probe (:func:`documents_probe`) with every batch given its null
    twins (:func:`with_null_twins`): ``options.batch_size`` questions a batch, twice as
    many rows."""
    probe = documents_probe(model, options)
    batches = [with_null_twins(b, model.tokenizer) for b in probe.batches]
    return Probe("query_documents", batches, {**probe.info, "null_query": NULL_QUERY})
