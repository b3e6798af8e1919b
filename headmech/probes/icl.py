"""In-context learning prompts for function vectors (Todd et al. 2023), written offline.

Three of Todd et al.'s tasks, from small word lists written here: ``antonyms`` (hot →
cold), ``country_capital`` (France → Paris) and ``capitalize`` (apple → Apple). A pair
counts for a tokenizer when both words are one token with a leading space, so every
prompt has the same length: BOS + k examples " x: y\\n" + the query " x:", whose answer is
the query's ``y``.

The ``icl`` probe: ``options.n_sequences`` prompts, tasks in turn, k = 8 examples drawn
without replacement from the seed. ``extras``: ``answer`` (``LongTensor[batch]``, the
answer's token), ``label`` (``Bool[batch, pos]``, the examples' answer tokens), ``task``
(names). :func:`shuffle_labels` gives Todd et al.'s corrupted prompts: the examples'
answers permuted among them (the task no longer shows), the query unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import InputError
from headmech.core.stats import ProbeBatch
from headmech.probes import Probe, ProbeOptions, batch_sequences, register_probe, start_ids

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["ICL_TASKS", "icl_pairs", "icl_probe", "shuffle_labels"]

_ANTONYMS = (
    "hot:cold big:small up:down good:bad happy:sad fast:slow high:low old:new open:closed "
    "hard:soft early:late light:dark rich:poor strong:weak long:short wet:dry love:hate "
    "in:out left:right full:empty true:false first:last black:white young:old win:lose "
    "buy:sell push:pull clean:dirty thick:thin heavy:light loud:quiet safe:dangerous "
    "cheap:expensive wide:narrow deep:shallow top:bottom north:south east:west day:night "
    "start:end yes:no before:after inside:outside above:below"
)
_CAPITALS = (
    "France:Paris Japan:Tokyo Italy:Rome Germany:Berlin Spain:Madrid Russia:Moscow "
    "China:Beijing Egypt:Cairo Greece:Athens England:London Canada:Ottawa Kenya:Nairobi "
    "Peru:Lima Cuba:Havana Austria:Vienna Ireland:Dublin Norway:Oslo Sweden:Stockholm "
    "Poland:Warsaw Portugal:Lisbon Thailand:Bangkok India:Delhi Iran:Tehran Iraq:Baghdad "
    "Turkey:Ankara Chile:Santiago Finland:Helsinki Denmark:Copenhagen Hungary:Budapest "
    "Korea:Seoul Vietnam:Hanoi Syria:Damascus Lebanon:Beirut Australia:Canberra "
    "Belgium:Brussels Netherlands:Amsterdam Scotland:Edinburgh Wales:Cardiff "
    "Ukraine:Kyiv Israel:Jerusalem Qatar:Doha Nepal:Kathmandu"
)
_WORDS = (
    "apple house water river music paper garden window table chair money city color "
    "friend family school world night light stone green story power game market street "
    "summer winter morning forest island doctor church bridge letter father mother "
    "king queen north ocean plant spring silver golden"
)
ICL_TASKS: dict[str, list[tuple[str, str]]] = {
    "antonyms": [(a, b) for a, b in (p.split(":") for p in _ANTONYMS.split())],
    "country_capital": [(a, b) for a, b in (p.split(":") for p in _CAPITALS.split())],
    "capitalize": [(w, w.capitalize()) for w in _WORDS.split()],
}
N_EXAMPLES = 8  # in-context examples per prompt


def icl_pairs(tokenizer: Any) -> dict[str, list[tuple[int, int]]]:
    """Per task, its pairs whose two words are single tokens with a leading space."""
    unknown = getattr(tokenizer, "unk_token_id", None)

    def one(word: str) -> int | None:
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 and ids[0] != unknown else None

    out: dict[str, list[tuple[int, int]]] = {}
    for task, pairs in ICL_TASKS.items():
        kept = [(x, y) for a, b in pairs if (x := one(a)) is not None and (y := one(b)) is not None]
        if len(kept) > N_EXAMPLES:
            out[task] = kept
    return out


def _single(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise InputError(f"the tokenizer has no single token for {text!r}")
    return int(ids[0])


@register_probe("icl", "BOS + 8 in-context examples ' x: y' + a query (Todd et al. 2023)")
def icl_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``options.n_sequences`` in-context prompts, tasks in turn (module docstring)."""
    tokenizer = model.tokenizer
    pairs = icl_pairs(tokenizer)
    if not pairs:
        raise InputError("the tokenizer has no in-context task with enough single-token pairs")
    tasks = sorted(pairs)
    colon, newline = _single(tokenizer, ":"), _single(tokenizer, "\n")
    prefix = start_ids(model)
    g = torch.Generator().manual_seed(options.seed)
    seqs, extras = [], []
    for i in range(options.n_sequences):
        task = tasks[i % len(tasks)]
        pick = torch.randperm(len(pairs[task]), generator=g)[: N_EXAMPLES + 1].tolist()
        shown = [pairs[task][j] for j in pick]
        body = [t for x, y in shown[:-1] for t in (x, colon, y, newline)]
        seqs.append(prefix + body + [shown[-1][0], colon])
        extras.append({"task": task, "answer": shown[-1][1]})
    batches = batch_sequences(seqs, tokenizer, options.batch_size, extras)
    for b in batches:
        b.extras["answer"] = torch.tensor(b.extras["answer"], dtype=torch.long)
        label = torch.zeros_like(b.attention_mask, dtype=torch.bool)
        label[:, len(prefix) + 2 : len(prefix) + 4 * N_EXAMPLES : 4] = True
        b.extras["label"] = label
    info = {"tasks": {t: len(p) for t, p in pairs.items()}, "examples": N_EXAMPLES}
    return Probe("icl", batches, info)


def shuffle_labels(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Todd et al.'s corrupted prompts: each prompt's example answers permuted among its
    examples (the query and its answer unchanged)."""
    g = torch.Generator().manual_seed(0x5EED_C0DE + seed)
    ids = batch.input_ids.clone()
    for row in range(ids.shape[0]):
        pos = batch.extras["label"][row].nonzero()[:, 0]
        ids[row, pos] = ids[row, pos[torch.randperm(len(pos), generator=g)]]
    return replace(batch, input_ids=ids)
