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
from torch import Tensor

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
from headmech.testing.recall_controls import documents_model, facts_model

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "PLANTED",
    "POSITIVE_CONTROLS",
    "copy_suppression_model",
    "function_vector_model",
    "inactive_model",
    "successor_model",
]


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
    model = llama(d_model=64, d_head=32, rope_theta=1e12, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n_vocab, code = model.config.vocab_size, list(range(16))
    emb = torch.randn(n_vocab, 64, generator=g)
    emb[:, code] = 6.0 * random_rows(n_vocab, len(code), g)  # one norm for every code
    unit_rms(emb, list(range(16, 64)))
    eye = torch.eye(64)[code]  # [16, d_model]: reads the code
    still = still_dims(model, len(code))
    qk = torch.zeros(32, 64)
    qk[still] = eye
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
    # scores in nats: 40 x the cosine of the two codes (|code| = 6 in a unit-RMS row)
    scale = 40.0 * 32**0.5 / 36.0
    v = torch.zeros(32, 64)
    v[: len(code)] = eye
    set_head(model, 1, PLANTED.head, q=scale * qk, k=qk, v=v, o=-v.T)
    return load(model, "copy-suppression")


@functools.lru_cache(maxsize=1)
def successor_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED attends to the previous token and its OV circuit maps each ordinal
    item to the next one (Monday to Tuesday, C to D).

    Each run of ordinal items of one length n (:func:`headmech.probes.ordinal.ordinal_runs`)
    has a plane of the residual stream; its i-th item is embedded at angle ``2 pi i / n``
    there, and the unembedding is the embedding's transpose. PLANTED's values read the
    planes and its output turns each by ``2 pi / n``: item i comes out where item i + 1
    is, so among a task's items the next one gets the highest logit. Its query and key
    read the constant dimension ORD (rotary_qk, offset 1): a comma reads the item before it.
    """
    from headmech.probes.ordinal import ordinal_runs

    model = llama(d_model=64, d_head=16, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    runs = [run for task in ordinal_runs(smollm2()).values() for run in task]
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
    unit_rms(emb, list(range(planes[-1] + 1, 64)))
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
    q, k = rotary_qk(model, offset=1, pairs=range(4))
    # scores in nats: 25 x the sum of the cosines (ORD reads 4 in a unit-RMS row)
    wq, wk = torch.zeros(16, 64), torch.zeros(16, 64)
    wq[:, ORD] = 25.0 * 16**0.5 * q / 16.0
    wk[:, ORD] = k
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
    set_head(model, 1, PLANTED.head, q=wq, k=wk, v=v, o=o)
    return load(model, "successor")


@functools.lru_cache(maxsize=1)
def inactive_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED parks its attention on BOS and writes almost nothing.

    Its query reads the constant dimension ORD and its key a dimension only BOS has, in
    head dimensions rotary embeddings leave still, so every query that sees a BOS puts its
    attention there; its output weights are its random ones scaled by 1e-3, so on every
    domain its output norm is about a thousandth of its layer's mean. The other heads stay
    random.
    """
    model = llama(d_model=64, d_head=16, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    bos = int(smollm2().bos_token_id)
    emb = torch.randn(model.config.vocab_size, 64, generator=g)
    emb[:, ORD], emb[:, 1] = 4.0, 0.0
    unit_rms(emb, list(range(2, 64)))
    emb[bos] = 0.0
    emb[bos, 1] = 8.0  # the sink's own dimension: the whole of its unit-RMS row
    still = still_dims(model, 1)
    wq, wk = torch.zeros(16, 64), torch.zeros(16, 64)
    wq[still, ORD] = 20.0 * 16**0.5 / (4.0 * 8.0)  # 20 nats on BOS
    wk[still, 1] = 1.0
    attn = model.model.layers[1].self_attn
    o = attn.o_proj.weight[:, PLANTED.head * 16 : (PLANTED.head + 1) * 16].detach().clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
    set_head(model, 1, PLANTED.head, q=wq, k=wk, o=1e-3 * o)
    return load(model, "inactive")


@functools.lru_cache(maxsize=1)
def function_vector_model(seed: int = 0) -> TransformerBridge:
    """Head PLANTED carries the in-context task from the examples to the query.

    The prompts are those of the ``icl`` probe, `` x: y`` examples then `` x:``. Block 0
    checks the examples: head T (one per task) at each token looks two tokens back (a
    positional query and key on ORD, :func:`rotary_qk`) and, when that token is the
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

    tok = smollm2()
    d = 128  # d_model = d_head: head 3 copies a whole identity code
    model = llama(d_model=d, d_head=d, rope_theta=1e4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    pairs = icl_pairs(tok)
    tasks = sorted(pairs)
    assert len(tasks) <= 3, "one block-0 head per task, and head 3 copies the previous token"
    bos, ans, task_dim, fv_dim, pad = _FV_DIMS
    ident = list(range(10, d))  # each token's identity: a random unit code z
    n_vocab, n_id, rms = model.config.vocab_size, len(ident), d**0.5
    z = random_rows(n_vocab, n_id, g)
    emb = torch.zeros(n_vocab, d)
    emb[:, ORD], emb[:, ident] = 3.0, 6.0 * z
    answers = sorted({y for task in tasks for _, y in pairs[task]})
    emb[answers, ans] = 3.0
    for text in (":", "\n"):  # no identity: nothing to copy or to match
        (t,) = tok.encode(text, add_special_tokens=False)
        emb[t, ident] = 0.0
    emb[:, pad] = 1.0
    unit_rms(emb, [pad])
    emb[tok.bos_token_id] = 0.0
    emb[tok.bos_token_id, bos] = rms

    _fv_block0(model, pairs, tasks, z, ident, g)
    sink = d // 2 - 1  # the slowest rotary pair: still over the whole context
    # PLANTED: the final colon (residual RMS about 1.13) attends to the answer words
    # (about 1.02) with 10 nats, and copies the task directions
    wq, wk, wv, wo = (torch.zeros(d, d) for _ in range(4))
    wq[sink, ORD] = 10.0 * d**0.5 * 1.13 / 3.0
    wk[sink, ans] = 1.02 / 3.0
    wv[:3, task_dim : task_dim + 3] = torch.eye(3)
    wo[fv_dim : fv_dim + 3, :3] = torch.eye(3)
    set_head(model, 1, PLANTED.head, q=wq, k=wk, v=wv, o=wo)
    unemb = _fv_unembedding(n_vocab, d, pairs, tasks, z, ident)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(unemb)
    return load(model, "function-vector")


# function_vector_model's residual dimensions: BOS, answer word, the 3 task directions,
# the 3 function-vector directions, a constant
_FV_DIMS = (1, 2, 3, 6, 9)


def _fv_block0(
    model: Any, pairs: dict, tasks: list, z: Tensor, ident: list[int], g: torch.Generator
) -> None:
    """function_vector_model's block 0: head T per task checks the example two tokens
    back and writes task T's direction; head 3 copies the previous token."""
    bos, _, task_dim, _, _ = _FV_DIMS
    d, n_id = int(model.config.hidden_size), len(ident)
    rms = d**0.5
    content = still_dims(model, 36, span=2)  # still between a query and the key 2 back
    sink = d // 2 - 1  # the slowest pair: still over the whole context
    q_pos, k_pos = rotary_qk(model, offset=2, pairs=range(16))
    for h, task in enumerate(tasks):
        xs = torch.tensor([x for x, _ in pairs[task]])
        ys = torch.tensor([y for _, y in pairs[task]])
        codes = random_rows(len(xs), len(content), g)  # [pair, content]: x's key, y's query
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
        set_head(model, 0, h, q=wq, k=wk, v=wv, o=wo)
    q_prev, k_prev = rotary_qk(model, offset=1, pairs=range(16))
    wq, wk, wv, wo = (torch.zeros(d, d) for _ in range(4))
    wq[:, ORD] = 8.0 * d**0.5 * q_prev / 3.0
    wk[:, ORD] = k_prev / 3.0
    wv[torch.arange(n_id), torch.tensor(ident)] = 1.0 / 6.0
    wo[torch.tensor(ident), torch.arange(n_id)] = 6.0
    set_head(model, 0, 3, q=wq, k=wk, v=wv, o=wo)


def _fv_unembedding(
    n_vocab: int, d: int, pairs: dict, tasks: list, z: Tensor, ident: list[int]
) -> Tensor:
    """function_vector_model's unembedding, read at the final colon."""
    fv_dim = _FV_DIMS[3]
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
    return unemb


# Types whose score reads no attention pattern: the hand-built model each is checked on.
POSITIVE_CONTROLS: dict[str, Callable[[], TransformerBridge]] = {
    "copy_suppression": copy_suppression_model,
    "cri": documents_model,
    "function_vector": function_vector_model,
    "inactive": inactive_model,
    "locos": documents_model,
    "relation": functools.partial(facts_model, "relation"),
    "subject": functools.partial(facts_model, "subject"),
    "successor": successor_model,
}
