"""Hand-built models that answer a probe through one planted head: the positive controls
of the types scored from what the model writes toward an answer (subject, relation,
locos; :data:`headmech.testing.controls.POSITIVE_CONTROLS`).

Built as :mod:`headmech.testing.controls` builds its models (a 2-layer attention-only
LLaMA with SmolLM2's tokenizer, head PLANTED doing the job), but these also *answer*: the
scores they control average over the prompts the model completes, so a control model
that answers nothing would control nothing.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from headmech.testing.building import (
    ORD,
    PLANTED,
    llama,
    load,
    random_rows,
    rotary_qk,
    set_head,
    smollm2,
    still_dims,
    unit_rms,
)

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["documents_model", "facts_model"]


# the facts model's residual stream: ORD, the two groups' marks, a filler for unit RMS, the
# tokens' identity codes and the answer space (0 in every embedding)
D_FACTS, SUBJ_DIM, REL_DIM = 192, 1, 2
FILL, IDENT, ANSWER_SPACE = list(range(3, 20)), list(range(20, 100)), list(range(100, 192))


def _enc(text: str) -> list[int]:
    return [int(t) for t in smollm2().encode(text, add_special_tokens=False)]


def _facts_embeddings(
    n_vocab: int, facts: list[tuple[list[int], list[int], int]], g: torch.Generator
) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """Unit-RMS embeddings with ORD, a random identity code (norm 6) and a mark on the
    tokens found only in subjects (SUBJ_DIM) or only in relations (REL_DIM); the marks."""
    in_subjects = {t for s, _, _ in facts for t in s}
    in_relations = {t for _, r, _ in facts for t in r}
    marks = {"subject": sorted(in_subjects - in_relations), "relation": sorted(in_relations - in_subjects)}  # fmt: skip
    emb = torch.zeros(n_vocab, D_FACTS)
    emb[:, ORD] = 3.0
    emb[:, FILL] = torch.randn(n_vocab, len(FILL), generator=g)
    emb[:, IDENT] = 6.0 * random_rows(n_vocab, len(IDENT), g)
    emb[marks["subject"], SUBJ_DIM] = 3.0
    emb[marks["relation"], REL_DIM] = 3.0
    unit_rms(emb, FILL)
    return emb, marks


def _answer_head(model: Any, head: int, x: torch.Tensor, y: torch.Tensor, mark: int) -> None:
    """Block 1's ``head``: from every position, 20 nats on the tokens with ``mark`` (ORD
    against the mark, in a head dimension rotary embeddings leave still); its values read
    the identity codes and its output maps a group's mean code ``x_i`` to ``y_i`` in the
    answer space (:func:`_lookup`)."""
    d_head = int(model.config.head_dim)
    read, write = _lookup(x, y, d_head)
    still = still_dims(model, 1)
    wq, wk, wv = torch.zeros(d_head, D_FACTS), torch.zeros(d_head, D_FACTS), torch.zeros(d_head, D_FACTS)  # fmt: skip
    wo = torch.zeros(D_FACTS, d_head)
    wq[still, ORD] = 20.0 * d_head**0.5 / 9.0
    wk[still, mark] = 1.0
    wv[: read.shape[0], IDENT] = read
    wo[ANSWER_SPACE, : write.shape[1]] = write
    set_head(model, 1, head, q=wq, k=wk, v=wv, o=wo)


def _lookup(x: torch.Tensor, y: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and write weights ``(r [rank, d_in], w [d_out, rank])`` with ``w @ r @ x_i ≈
    y_i`` for every row pair: the least-squares map ``y^T pinv(x^T)``, cut to ``rank``."""
    m = y.T.double() @ torch.linalg.pinv(x.T.double(), rtol=1e-6)  # [d_out, d_in]
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return (s[:rank, None] * vh[:rank]).float(), u[:, :rank].float()


@functools.lru_cache(maxsize=2)
def facts_model(planted: str = "subject", seed: int = 0, n_facts: int = 16) -> TransformerBridge:
    """A model that completes the ``facts`` probe's first ``n_facts`` facts (the
    conformance checks' probe size) through two heads of block 1:
    a subject head that writes each fact's answer from the subject's tokens and a relation
    head that writes, from the relation's, the mean answer of the facts that share it.
    ``planted`` says which of the two is PLANTED (the other is head 0).

    The residual stream: a constant dimension ORD, a dimension marking the tokens found
    only in subjects (SUBJ) and one marking those found only in relations (REL), each
    token's random identity code, and an answer space where the embedding is 0. Each head's
    query reads ORD and its key its group's mark, in head dimensions that rotary
    embeddings leave still (rope base 1e12), so at every position it spreads its
    attention over the group's tokens. Its values read the identity codes and its output
    writes, by a least-squares map from the mean code of a prompt's group, the answer's
    direction (subject: 8 x the answer's unit vector; relation: 4 x the mean of the unit
    vectors of the answers its relation has); the unembedding gives each answer token
    1.5 x its unit vector and every other token 0. So the answer's logit is about 10 nats
    and a head's direct effect from its own group is the whole of its effect.
    """
    from headmech.probes.facts import FACTS

    # no more facts than the codes of their subjects' tokens tell apart: "The capital of
    # France" and "People in France" share " France", and a linear map from the subject's
    # codes cannot send it to both " Paris" and " French" (a real model's relation heads
    # choose between them); the first 16 facts' subjects are distinct in their tokens
    facts = [(_enc(s), _enc(r), _enc(a)[0]) for s, r, a in FACTS[:n_facts]]
    model = llama(d_model=D_FACTS, d_head=64, rope_theta=1e12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    emb, marks = _facts_embeddings(model.config.vocab_size, facts, g)
    answers = sorted({a for _, _, a in facts})
    unit = random_rows(len(answers), len(ANSWER_SPACE), g)  # [answer, answer space]
    row = {a: unit[i] for i, a in enumerate(answers)}

    def mean_code(ids: list[int], group: str) -> torch.Tensor:
        marked = [t for t in ids if t in set(marks[group])]
        return emb[marked][:, IDENT].mean(0)

    # subject: a fact's answer; relation: the mean answer of the facts that share it
    by_relation: dict[tuple[int, ...], list[int]] = {}
    for _, r, a in facts:
        by_relation.setdefault(tuple(r), []).append(a)
    x_subject = torch.stack([mean_code(s, "subject") for s, _, _ in facts])
    y_subject = torch.stack([8.0 * row[a] for _, _, a in facts])
    x_relation = torch.stack([mean_code(list(r), "relation") for r in by_relation])
    y_relation = torch.stack([4.0 * torch.stack([row[a] for a in v]).mean(0) for v in by_relation.values()])  # fmt: skip
    heads = {"subject": PLANTED.head, "relation": 0} if planted == "subject" else {"subject": 0, "relation": PLANTED.head}  # fmt: skip
    _answer_head(model, heads["subject"], x_subject, y_subject, SUBJ_DIM)
    _answer_head(model, heads["relation"], x_relation, y_relation, REL_DIM)
    unemb = torch.zeros(model.config.vocab_size, D_FACTS)
    for a in answers:
        unemb[a, ANSWER_SPACE] = 1.5 * row[a]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return load(model, f"facts-{planted}")


def _offset_copy(model: Any, head: int, offset: int, copy: torch.Tensor, space: list[int]) -> None:
    """Block 0's ``head``: each token attends ``offset`` tokens back (a positional query
    and key on ORD, :func:`rotary_qk`; 40 x the sum of the cosines in nats, ORD reads 3)
    and writes that token's identity code (``copy``, the values) into ``space``."""
    d_head, d = copy.shape
    q, k = rotary_qk(model, offset=offset, pairs=range(0, 16, 4))
    wq, wk, wo = torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d, d_head)
    wq[:, ORD] = 40.0 * d_head**0.5 * q / 9.0
    wk[:, ORD] = k
    wo[torch.tensor(space), torch.arange(len(space))] = 1.0
    set_head(model, 0, head, q=wq, k=wk, v=copy, o=wo)


@functools.lru_cache(maxsize=1)
def documents_model(seed: int = 0) -> TransformerBridge:
    """A model that answers the ``documents`` probe's questions through head PLANTED,
    which reads the gold document's city and writes it.

    Block 0 binds each name to what follows it: head 0 looks three tokens back (a
    positional query and key on ORD, :func:`rotary_qk`) and copies that token's identity
    code into a key space, so the city of "Mary lives in Lisbon" carries Mary's code; head
    1 looks two back and copies into a query space, so the answer's last token ("Answer:
    Mary lives in") carries Mary's code too. In block 1, PLANTED's query reads the query
    space and its key the key space (plus a bonus for city tokens, a dimension they share),
    in head dimensions that rotary embeddings leave still (rope base 1e8), so from the
    last token it attends to the city whose name was asked; its values copy the city's
    identity code into an answer space, which the unembedding reads: 3 x a city's code
    for each city token, nothing for any other token. So the gold city gets about 12
    nats and the others about 0.
    """
    from headmech.probes.documents import one_token_cities
    from headmech.probes.ioi import ioi_names

    tok = smollm2()
    d, d_head, code = 192, 64, 32
    model = llama(d_model=d, d_head=d_head, rope_theta=1e8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    city_dim = 1
    ident, key_space, query_space, answer_space = (
        list(range(2 + i * code, 2 + (i + 1) * code)) for i in range(4)
    )
    fill = list(range(2 + 4 * code, d))
    n_vocab = model.config.vocab_size
    emb = torch.zeros(n_vocab, d)
    emb[:, ORD] = 3.0
    emb[:, ident] = 4.0 * random_rows(n_vocab, code, g)
    emb[:, fill] = torch.randn(n_vocab, len(fill), generator=g)
    cities = one_token_cities(tok)
    emb[cities, city_dim] = 3.0
    unit_rms(emb, fill)
    assert ioi_names(tok), "the tokenizer has no one-token names"
    copy = torch.zeros(d_head, d)
    copy[torch.arange(code), torch.tensor(ident)] = 1.0  # values: the identity code
    for head, (offset, space) in enumerate([(3, key_space), (2, query_space)]):
        _offset_copy(model, head, offset, copy, space)
    still = still_dims(model, code + 1)
    wq, wk, wo = torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d, d_head)
    # the asked name's code against each key's name code (|code| = 4 both): 10 x their
    # cosine x 16 / 8 nats; and 10 nats more on every city
    wq[torch.tensor(still[:code]), torch.tensor(query_space)] = 10.0
    wk[torch.tensor(still[:code]), torch.tensor(key_space)] = 1.0
    wq[still[code], ORD] = 10.0 * d_head**0.5 / 9.0
    wk[still[code], city_dim] = 1.0
    wo[torch.tensor(answer_space), torch.arange(code)] = 1.0
    set_head(model, 1, PLANTED.head, q=wq, k=wk, v=copy, o=wo)
    unemb = torch.zeros(n_vocab, d)
    unemb[torch.tensor(cities)[:, None], torch.tensor(answer_space)] = (
        3.0 * emb[cities][:, ident] / 4.0
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return load(model, "documents")
