"""Hand-built models whose head :data:`PLANTED` really does a head type's job: the positive
controls of the types scored from weights (copy suppression, successor) or from runs of the
model itself (function vectors, inactive heads), which no planted attention pattern can
stand in for. The type's own score, computed from such a model as from any other, must
rank head PLANTED first (``headmech.testing.check_positive_control``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.head_index import HeadIndex
from headmech.core.scratch import scratch_folder

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "PLANTED",
    "POSITIVE_CONTROLS",
    "copy_suppression_model",
    "documents_model",
    "facts_model",
    "function_vector_model",
    "inactive_model",
    "successor_model",
]

PLANTED = HeadIndex(1, 2)  # the head that does the job, in every control model

# --- hand-built positive controls ------------------------------------------------------
# A type scored from weights (copy_suppression, successor) or from runs of the model
# itself (function_vector, inactive) is not found by replacing an attention pattern: its
# positive control is a tiny model built by hand in which head PLANTED does the job, and
# the type's score is computed from that model as from any other. Each is a 2-layer,
# 4-head attention-only LLaMA (MLPs zeroed, as in headmech.models.toys) with SmolLM2's tokenizer,
# random wherever it is not set. Embedding rows have unit RMS, so block 0 reads them as
# they are, and a constant dimension (ORD) lets a head read a fixed query or key at every
# position: with rotary embeddings, a fixed query and key score by the distance between
# the positions alone (_rotary_qk), which is how the positional heads below are built.

ORD = 0  # embedding dimension holding the same value for every ordinary token


@functools.lru_cache(maxsize=1)
def _smollm2() -> Any:
    from headmech.models.bundled import smollm2_tokenizer

    return smollm2_tokenizer()


def _llama(d_model: int, d_head: int, rope_theta: float, seed: int) -> Any:
    """The random attention-only LLaMA a control model starts from (weights from ``seed``,
    the caller's random stream untouched)."""
    from headmech.models.tiny import tiny_hf

    model, _ = tiny_hf(
        "llama",
        seed=seed,
        tokenizer=_smollm2(),
        init=0.02,  # transformers' own
        d_model=d_model,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        d_mlp=4,  # zeroed below: attention-only
        n_ctx=256,
        head_dim=d_head,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=None,  # SmolLM2's pad token is no padding row of the embedding
        tie_word_embeddings=False,
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
    return model


def _load(model: Any, name: str) -> TransformerBridge:
    from headmech.models import load_model

    path = scratch_folder(f"headmech-{name}-")  # removed at exit
    model.save_pretrained(path)
    _smollm2().save_pretrained(path)
    return load_model(str(path))


@torch.no_grad()
def _set_head(model: Any, layer: int, head: int, **weights: torch.Tensor) -> None:
    """Set what head ``head`` of block ``layer`` reads (``q``, ``k``, ``v``: ``[d_head,
    d_model]``, from the normalised residual) and writes (``o``: ``[d_model, d_head]``)."""
    attn = model.model.layers[layer].self_attn
    d_head = int(model.config.head_dim)
    rows = slice(head * d_head, (head + 1) * d_head)
    for name in ("q", "k", "v"):
        if name in weights:
            getattr(attn, f"{name}_proj").weight[rows] = weights[name]
    if "o" in weights:
        attn.o_proj.weight[:, rows] = weights["o"]


def _rotary_freqs(model: Any) -> torch.Tensor:
    """The rotation per position of each pair of head dimensions ``(i, i + d_head / 2)``."""
    d_head = int(model.config.head_dim)
    theta = float(model.config.rope_parameters["rope_theta"])
    return theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)


def _rotary_qk(model: Any, offset: int, pairs: range) -> tuple[torch.Tensor, torch.Tensor]:
    """A query and a key in head space whose rotary score is ``sum over pairs of
    cos((i - j - offset) * freq)`` for query position i and key position j: largest at
    ``i - j = offset``, whatever the tokens."""
    freq = _rotary_freqs(model)
    half = len(freq)
    q = torch.zeros(2 * half, dtype=torch.float64)
    k = torch.zeros_like(q)
    p = torch.tensor(list(pairs))
    q[p], q[p + half] = torch.cos(offset * freq[p]), -torch.sin(offset * freq[p])
    k[p] = 1.0
    return q.float(), k.float()


def _still_dims(model: Any, n: int, span: int = 256) -> list[int]:
    """``n`` head dimensions that rotary embeddings turn by under 0.1 radian over ``span``
    positions: a query and key there score by content alone."""
    freq = _rotary_freqs(model)
    pairs = (freq * span < 0.1).nonzero()[:, 0].tolist()
    dims = [d for p in pairs for d in (p, p + len(freq))]
    assert len(dims) >= n, f"only {len(dims)} head dimensions stay still over {span} positions"
    return sorted(dims[:n])


def _unit_rms(emb: torch.Tensor, fill: list[int]) -> None:
    """Scale each row's ``fill`` columns so that the row has unit RMS (in place)."""
    d_model = emb.shape[1]
    rest = emb.pow(2).sum(1) - emb[:, fill].pow(2).sum(1)
    assert bool((rest < d_model).all()), "the fixed part of an embedding is too large"
    emb[:, fill] *= ((d_model - rest) / emb[:, fill].pow(2).sum(1).clamp(min=1e-12)).sqrt()[:, None]


def _random_rows(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=1, keepdim=True)


@functools.lru_cache(maxsize=1)
def copy_suppression_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED attends to the copies of the current token (itself and any earlier
    one) and lowers their logit.

    Every token's embedding has a code of one norm in dimensions 0-15 (the rest random);
    the unembedding is the embedding's transpose. PLANTED's values read the code and its
    output writes minus the code: through the unembedding each token's own logit is then
    the lowest of the vocabulary (no other code is as aligned with a token's code as the
    code itself). Its query and key read the same code in head dimensions that rotary
    embeddings leave still (rope base 1e12), so a token's copies score highest.
    """
    model = _llama(d_model=64, d_head=32, rope_theta=1e12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n_vocab, code = model.config.vocab_size, list(range(16))
    emb = torch.randn(n_vocab, 64, generator=g)
    emb[:, code] = 6.0 * _random_rows(n_vocab, len(code), g)  # one norm for every code
    _unit_rms(emb, list(range(16, 64)))
    eye = torch.eye(64)[code]  # [16, d_model]: reads the code
    still = _still_dims(model, len(code))
    qk = torch.zeros(32, 64)
    qk[still] = eye
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
    # scores in nats: 40 x the cosine of the two codes (|code| = 6 in a unit-RMS row)
    scale = 40.0 * 32**0.5 / 36.0
    v = torch.zeros(32, 64)
    v[: len(code)] = eye
    _set_head(model, 1, PLANTED.head, q=scale * qk, k=qk, v=v, o=-v.T)
    return _load(model, "copy-suppression")


@functools.lru_cache(maxsize=1)
def successor_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED attends to the previous token and its OV circuit maps each ordinal
    item to the next one (Monday to Tuesday, C to D).

    Each run of ordinal items of one length n (:func:`headmech.probes.ordinal.ordinal_runs`)
    has a plane of the residual stream; its i-th item is embedded at angle ``2 pi i / n``
    there, and the unembedding is the embedding's transpose. PLANTED's values read the
    planes and its output turns each by ``2 pi / n``: item i comes out where item i + 1
    is, so among a task's items the next one gets the highest logit. Its query and key
    read the constant dimension ORD (_rotary_qk, offset 1): a comma reads the item before it.
    """
    from headmech.probes.ordinal import ordinal_runs

    model = _llama(d_model=64, d_head=16, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    runs = [run for task in ordinal_runs(_smollm2()).values() for run in task]
    lengths = sorted({len(run) for run in runs})
    assert 2 * len(lengths) <= 16, "more ordinal planes than head dimensions"
    plane = {n: [1 + 2 * i, 2 + 2 * i] for i, n in enumerate(lengths)}
    emb = torch.randn(model.config.vocab_size, 64, generator=g)
    planes = [d for n in lengths for d in plane[n]]
    emb[:, planes] = 0.0
    emb[:, ORD] = 4.0
    for run in runs:
        angle = 2 * torch.pi * torch.arange(len(run), dtype=torch.float64) / len(run)
        # months and their prefixes share a plane and put " May" at the same angle
        emb[torch.tensor(run)[:, None], plane[len(run)]] = (
            5.0 * torch.stack([angle.cos(), angle.sin()], 1).float()
        )
    _unit_rms(emb, list(range(planes[-1] + 1, 64)))
    v = torch.zeros(16, 64)
    o = torch.zeros(64, 16)
    for i, d in enumerate(planes):
        v[i, d] = 1.0
    for n in lengths:
        a = 2 * torch.pi / n
        turn = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
        (x, y), cols = plane[n], [planes.index(d) for d in plane[n]]
        o[[x, y], cols[0]] = turn[:, 0]
        o[[x, y], cols[1]] = turn[:, 1]
    q, k = _rotary_qk(model, offset=1, pairs=range(4))
    # scores in nats: 25 x the sum of the cosines (ORD reads 4 in a unit-RMS row)
    wq, wk = torch.zeros(16, 64), torch.zeros(16, 64)
    wq[:, ORD] = 25.0 * 16**0.5 * q / 16.0
    wk[:, ORD] = k
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
    _set_head(model, 1, PLANTED.head, q=wq, k=wk, v=v, o=o)
    return _load(model, "successor")


@functools.lru_cache(maxsize=1)
def inactive_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED parks its attention on BOS and writes almost nothing.

    Its query reads the constant dimension ORD and its key a dimension only BOS has, in
    head dimensions rotary embeddings leave still, so every query that sees a BOS puts its
    attention there; its output weights are its random ones scaled by 1e-3, so on every
    domain its output norm is about a thousandth of its layer's mean. The other heads stay
    random.
    """
    model = _llama(d_model=64, d_head=16, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    bos = int(_smollm2().bos_token_id)
    emb = torch.randn(model.config.vocab_size, 64, generator=g)
    emb[:, ORD], emb[:, 1] = 4.0, 0.0
    _unit_rms(emb, list(range(2, 64)))
    emb[bos] = 0.0
    emb[bos, 1] = 8.0  # the sink's own dimension: the whole of its unit-RMS row
    still = _still_dims(model, 1)
    wq, wk = torch.zeros(16, 64), torch.zeros(16, 64)
    wq[still, ORD] = 20.0 * 16**0.5 / (4.0 * 8.0)  # 20 nats on BOS
    wk[still, 1] = 1.0
    attn = model.model.layers[1].self_attn
    o = attn.o_proj.weight[:, PLANTED.head * 16 : (PLANTED.head + 1) * 16].detach().clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
    _set_head(model, 1, PLANTED.head, q=wq, k=wk, o=1e-3 * o)
    return _load(model, "inactive")


@functools.lru_cache(maxsize=1)
def function_vector_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED carries the in-context task from the examples to the query.

    The prompts are those of the ``icl`` probe, `` x: y`` examples then `` x:``. Block 0
    checks the examples: head T (one per task) at each token looks two tokens back (a
    positional query and key on ORD, :func:`_rotary_qk`) and, when that token is the
    current one's partner in task T (their codes, fitted by least squares, agree), reads
    it and writes the task's direction; otherwise it parks on BOS, which writes nothing.
    Head 3 copies the previous token (the query's x at the final colon). In block 1,
    PLANTED attends to the answer words (a dimension they share) and copies the task
    directions into a function-vector direction; the unembedding adds, to the query x's
    own logit 18 nats and its partners' 10, 16 nats to every answer of the task the
    function vector names. So the model answers when its examples show the task and
    echoes the query when they do not (answers shuffled): PLANTED's mean output, patched
    into a shuffled prompt, brings the answer back.
    """
    from headmech.probes.icl import icl_pairs

    tok = _smollm2()
    d = 128  # d_model = d_head: head 3 copies a whole identity code
    model = _llama(d_model=d, d_head=d, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    pairs = icl_pairs(tok)
    tasks = sorted(pairs)
    assert len(tasks) <= 3, "one block-0 head per task, and head 3 copies the previous token"
    bos, ans, task_dim, fv_dim, pad = 1, 2, 3, 6, 9  # dimensions of the residual stream
    ident = list(range(10, d))  # each token's identity: a random unit code z
    n_vocab, n_id, rms = model.config.vocab_size, len(ident), d**0.5
    z = _random_rows(n_vocab, n_id, g)
    emb = torch.zeros(n_vocab, d)
    emb[:, ORD], emb[:, ident] = 3.0, 6.0 * z
    answers = sorted({y for task in tasks for _, y in pairs[task]})
    emb[answers, ans] = 3.0
    for text in (":", "\n"):  # no identity: nothing to copy or to match
        (t,) = tok.encode(text, add_special_tokens=False)
        emb[t, ident] = 0.0
    emb[:, pad] = 1.0
    _unit_rms(emb, [pad])
    emb[tok.bos_token_id] = 0.0
    emb[tok.bos_token_id, bos] = rms

    content = _still_dims(model, 36, span=2)  # still between a query and the key 2 back
    sink = d // 2 - 1  # the slowest pair: still over the whole context
    q_pos, k_pos = _rotary_qk(model, offset=2, pairs=range(16))
    for h, task in enumerate(tasks):
        xs = torch.tensor([x for x, _ in pairs[task]])
        ys = torch.tensor([y for _, y in pairs[task]])
        codes = _random_rows(len(xs), len(content), g)  # [pair, content]: x's key, y's query
        keys = codes.T @ torch.linalg.pinv(z[xs].T)  # [content, identity]: z_x -> code
        queries = codes.T @ torch.linalg.pinv(z[ys].T)  # z_y -> its partner's code
        wq, wk, wv, wo = (torch.zeros(d, d) for _ in range(4))
        # scores in nats: 8 x the positional cosines (16 at two back), 40 x the agreement
        # of the codes, and BOS 16 x 8 + 28: between a partner and any other token
        wq[:, ORD] = 8.0 * d**0.5 * q_pos / 3.0
        wk[:, ORD] = k_pos / 3.0
        wq[torch.tensor(content)[:, None], torch.tensor(ident)] = 40.0 * d**0.5 * queries / 6.0
        wk[torch.tensor(content)[:, None], torch.tensor(ident)] = keys / 6.0
        wq[sink, ORD] = (16 * 8.0 + 28.0) * d**0.5 / 3.0
        wk[sink, bos] = 1.0 / rms
        wv[0, ORD] = 1.0 / 3.0  # 1 from every token, 0 from BOS
        wo[task_dim + h, 0] = 2.0
        _set_head(model, 0, h, q=wq, k=wk, v=wv, o=wo)
    q_prev, k_prev = _rotary_qk(model, offset=1, pairs=range(16))
    wq, wk, wv, wo = (torch.zeros(d, d) for _ in range(4))
    wq[:, ORD] = 8.0 * d**0.5 * q_prev / 3.0
    wk[:, ORD] = k_prev / 3.0
    wv[torch.arange(n_id), torch.tensor(ident)] = 1.0 / 6.0
    wo[torch.tensor(ident), torch.arange(n_id)] = 6.0
    _set_head(model, 0, 3, q=wq, k=wk, v=wv, o=wo)
    # PLANTED: the final colon (residual RMS about 1.13) attends to the answer words
    # (about 1.02) with 10 nats, and copies the task directions
    wq, wk, wv, wo = (torch.zeros(d, d) for _ in range(4))
    wq[sink, ORD] = 10.0 * d**0.5 * 1.13 / 3.0
    wk[sink, ans] = 1.02 / 3.0
    wv[:3, task_dim : task_dim + 3] = torch.eye(3)
    wo[fv_dim : fv_dim + 3, :3] = torch.eye(3)
    _set_head(model, 1, PLANTED.head, q=wq, k=wk, v=wv, o=wo)
    # the unembedding, read at the final colon: the query's code is 6 z / 1.13, the
    # function vector about 2 / 1.13 in its task's direction
    unemb = torch.zeros(n_vocab, d)
    scale = 1.13 / 6.0
    queries_x = sorted({x for task in tasks for x, _ in pairs[task]})
    unemb[torch.tensor(queries_x)[:, None], ident] = 18.0 * scale * z[queries_x]  # echo x
    for task in tasks:
        for x, y in pairs[task]:
            unemb[y, ident] += 10.0 * scale * z[x]  # or give its partner
    for h, task in enumerate(tasks):
        for _, y in pairs[task]:
            unemb[y, fv_dim + h] = 16.0 * 1.13 / 2.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return _load(model, "function-vector")


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

    tok = _smollm2()
    d, d_head = 192, 64
    model = _llama(d_model=d, d_head=d_head, rope_theta=1e12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    subj_dim, rel_dim, fill = 1, 2, list(range(3, 20))
    ident, answer_space = list(range(20, 100)), list(range(100, d))

    def enc(text: str) -> list[int]:
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    # no more facts than the codes of their subjects' tokens tell apart: "The capital of
    # France" and "People in France" share " France", and a linear map from the subject's
    # codes cannot send it to both " Paris" and " French" (a real model's relation heads
    # choose between them); the first 16 facts' subjects are distinct in their tokens
    facts = [(enc(s), enc(r), enc(a)[0]) for s, r, a in FACTS[:n_facts]]
    in_subjects = {t for s, _, _ in facts for t in s}
    in_relations = {t for _, r, _ in facts for t in r}
    marks = {"subject": sorted(in_subjects - in_relations), "relation": sorted(in_relations - in_subjects)}  # fmt: skip
    n_vocab = model.config.vocab_size
    emb = torch.zeros(n_vocab, d)
    emb[:, ORD] = 3.0
    emb[:, fill] = torch.randn(n_vocab, len(fill), generator=g)
    emb[:, ident] = 6.0 * _random_rows(n_vocab, len(ident), g)
    emb[marks["subject"], subj_dim] = 3.0
    emb[marks["relation"], rel_dim] = 3.0
    _unit_rms(emb, fill)
    answers = sorted({a for _, _, a in facts})
    unit = _random_rows(len(answers), len(answer_space), g)  # [answer, answer_space]
    row = {a: unit[i] for i, a in enumerate(answers)}

    def mean_code(ids: list[int], group: str) -> torch.Tensor:
        marked = [t for t in ids if t in set(marks[group])]
        return emb[marked][:, ident].mean(0)

    # subject: a fact's answer; relation: the mean answer of the facts that share it
    by_relation: dict[tuple[int, ...], list[int]] = {}
    for _, r, a in facts:
        by_relation.setdefault(tuple(r), []).append(a)
    x_subject = torch.stack([mean_code(s, "subject") for s, _, _ in facts])
    y_subject = torch.stack([8.0 * row[a] for _, _, a in facts])
    x_relation = torch.stack([mean_code(list(r), "relation") for r in by_relation])
    y_relation = torch.stack([4.0 * torch.stack([row[a] for a in v]).mean(0) for v in by_relation.values()])  # fmt: skip
    still = _still_dims(model, 1)
    heads = {"subject": PLANTED.head, "relation": 0} if planted == "subject" else {"subject": 0, "relation": PLANTED.head}  # fmt: skip
    for group, (x, y, mark) in {
        "subject": (x_subject, y_subject, subj_dim),
        "relation": (x_relation, y_relation, rel_dim),
    }.items():
        read, write = _lookup(x, y, d_head)
        wq, wk, wv, wo = torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d, d_head)  # fmt: skip
        wq[still, ORD] = 20.0 * d_head**0.5 / 9.0  # 20 nats on the group's tokens
        wk[still, mark] = 1.0
        wv[: read.shape[0], ident] = read
        wo[answer_space, : write.shape[1]] = write
        _set_head(model, 1, heads[group], q=wq, k=wk, v=wv, o=wo)
    unemb = torch.zeros(n_vocab, d)
    for a in answers:
        unemb[a, answer_space] = 1.5 * row[a]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return _load(model, f"facts-{planted}")


@functools.lru_cache(maxsize=1)
def documents_model(seed: int = 0) -> TransformerBridge:
    """A model that answers the ``documents`` probe's questions through head PLANTED,
    which reads the gold document's city and writes it.

    Block 0 binds each name to what follows it: head 0 looks three tokens back (a
    positional query and key on ORD, :func:`_rotary_qk`) and copies that token's identity
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

    tok = _smollm2()
    d, d_head, code = 192, 64, 32
    model = _llama(d_model=d, d_head=d_head, rope_theta=1e8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    city_dim = 1
    ident, key_space, query_space, answer_space = (
        list(range(2 + i * code, 2 + (i + 1) * code)) for i in range(4)
    )
    fill = list(range(2 + 4 * code, d))
    n_vocab = model.config.vocab_size
    emb = torch.zeros(n_vocab, d)
    emb[:, ORD] = 3.0
    emb[:, ident] = 4.0 * _random_rows(n_vocab, code, g)
    emb[:, fill] = torch.randn(n_vocab, len(fill), generator=g)
    cities = one_token_cities(tok)
    emb[cities, city_dim] = 3.0
    _unit_rms(emb, fill)
    assert ioi_names(tok), "the tokenizer has no one-token names"
    copy = torch.zeros(d_head, d)
    copy[torch.arange(code), torch.tensor(ident)] = 1.0  # values: the identity code
    for head, (offset, space) in enumerate([(3, key_space), (2, query_space)]):
        q, k = _rotary_qk(model, offset=offset, pairs=range(0, 16, 4))
        wq, wk, wo = torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d, d_head)
        # scores in nats: 40 x the sum of the positional cosines (ORD reads 3)
        wq[:, ORD] = 40.0 * d_head**0.5 * q / 9.0
        wk[:, ORD] = k
        wo[torch.tensor(space), torch.arange(code)] = 1.0
        _set_head(model, 0, head, q=wq, k=wk, v=copy, o=wo)
    still = _still_dims(model, code + 1)
    wq, wk, wo = torch.zeros(d_head, d), torch.zeros(d_head, d), torch.zeros(d, d_head)
    # the asked name's code against each key's name code (|code| = 4 both): 10 x their
    # cosine x 16 / 8 nats; and 10 nats more on every city
    wq[torch.tensor(still[:code]), torch.tensor(query_space)] = 10.0
    wk[torch.tensor(still[:code]), torch.tensor(key_space)] = 1.0
    wq[still[code], ORD] = 10.0 * d_head**0.5 / 9.0
    wk[still[code], city_dim] = 1.0
    wo[torch.tensor(answer_space), torch.arange(code)] = 1.0
    _set_head(model, 1, PLANTED.head, q=wq, k=wk, v=copy, o=wo)
    unemb = torch.zeros(n_vocab, d)
    unemb[torch.tensor(cities)[:, None], torch.tensor(answer_space)] = (
        3.0 * emb[cities][:, ident] / 4.0
    )
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return _load(model, "documents")


# Types whose score reads no attention pattern: the hand-built model each is checked on.
POSITIVE_CONTROLS: dict[str, Callable[[], TransformerBridge]] = {
    "copy_suppression": copy_suppression_model,
    "function_vector": function_vector_model,
    "inactive": inactive_model,
    "locos": documents_model,
    "relation": functools.partial(facts_model, "relation"),
    "subject": functools.partial(facts_model, "subject"),
    "successor": successor_model,
}
