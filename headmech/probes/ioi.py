"""Indirect object identification prompts (Wang et al. 2022), written offline.

"When Mary and John went to the store, John gave a drink to" → " Mary". Two names enter
in the first clause; the subject (S) is repeated in the second, and the model should
complete with the indirect object (IO), the name that is not repeated. The templates,
places and objects are Wang et al.'s (``ioi_dataset.py`` of their repository,
redwoodresearch/Easy-Transformer), the answer left off; half the prompts are ABBA (IO
first), half BABA (S first). Names are common first names that are one token with a
leading space for the model's tokenizer (the form they take in running text), so every
prompt of a template has the same length and the same positions.

The ``ioi`` probe: BOS + one prompt per sequence; ``extras`` (``LongTensor[batch]`` each):
``io``, ``s`` (the two names' token ids), ``io_pos``, ``s1_pos``, ``s2_pos`` (where the
names stand) and ``end_pos`` (the final " to", which predicts the IO).
:func:`corrupt_ioi` gives Wang et al.'s ABC distribution: the three name positions hold
three other random names, so no name is repeated.
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

__all__ = ["IOI_TEMPLATES", "corrupt_ioi", "end_targets", "ioi_names", "ioi_probe"]

# Wang et al.'s BABA templates ([B] is the subject, [A] the indirect object), answer dropped
IOI_TEMPLATES = [
    "Then, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a lot of fun at the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] were working at the [PLACE]. [B] decided to give a [OBJECT] to",
    "Then, [B] and [A] were thinking about going to the [PLACE]. [B] wanted to give a [OBJECT] to",
    "Then, [B] and [A] had a long argument, and afterwards [B] said to",
    "After [B] and [A] went to the [PLACE], [B] gave a [OBJECT] to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give it to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give the [OBJECT] to",
    "While [B] and [A] were working at the [PLACE], [B] gave a [OBJECT] to",
    "While [B] and [A] were commuting to the [PLACE], [B] gave a [OBJECT] to",
    "After the lunch, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Afterwards, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a long argument. Afterwards [B] said to",
    "The [PLACE] [B] and [A] went to had a [OBJECT]. [B] gave it to",
    "Friends [B] and [A] found a [OBJECT] at the [PLACE]. [B] gave it to",
]
PLACES = ["store", "garden", "restaurant", "school", "hospital", "office", "house", "station"]
OBJECTS = ["ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack"]
_NAMES = (
    "Mary John Tom James Dan Sid Alice Bob Mark Paul Kate Anna Sarah Lisa David Michael "
    "Robert Peter Jack Emma Laura Rose Max Ben Sam Tim Joe Anne Jane Amy Lucy Ryan Adam "
    "Eric Nick Chris Kevin Steve Mike Jessica Andrew Thomas Daniel Matthew George Edward "
    "Richard Charles Joseph Brian William Henry Frank Karen Nancy Linda Susan Helen Carol "
    "Ruth Sharon Laura Emily Rachel Jason Justin Aaron Adam Simon Luke Victoria Grace"
)
NAMES = _NAMES.split()


def ioi_names(tokenizer: Any) -> list[int]:
    """Token ids of the names that are one token with a leading space (sorted, unique)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    out = set()
    for name in NAMES:
        ids = tokenizer.encode(" " + name, add_special_tokens=False)
        if len(ids) == 1 and ids[0] != unknown:
            out.add(int(ids[0]))
    return sorted(out)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] if text else []


def _prompt(
    tokenizer: Any, template: str, io: int, s: int, place: str, obj: str, abba: bool
) -> tuple[list[int], dict[str, int]]:
    """One prompt's tokens and its name positions (names are inserted as single tokens)."""
    text = template.replace("[PLACE]", place).replace("[OBJECT]", obj)
    first, second = (io, s) if abba else (s, io)
    ids: list[int] = []
    where: dict[str, int] = {}
    head, rest = text.split("[B] and [A]", 1)
    mid, tail = rest.split("[B]", 1)
    ids += _encode(tokenizer, head.rstrip())
    where["first"] = len(ids)
    ids.append(first)
    ids += _encode(tokenizer, " and")
    where["second"] = len(ids)
    ids.append(second)
    ids += _encode(tokenizer, mid.rstrip())
    where["s2_pos"] = len(ids)
    ids.append(s)
    ids += _encode(tokenizer, tail)
    where["end_pos"] = len(ids) - 1
    where["io_pos"], where["s1_pos"] = (
        (where["first"], where["second"]) if abba else (where["second"], where["first"])
    )
    del where["first"], where["second"]
    return ids, where


@register_probe("ioi", "BOS + indirect object identification prompts (Wang et al. 2022)")
def ioi_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``options.n_sequences`` IOI prompts, templates in turn, ABBA and BABA alternating,
    names, places and objects drawn from ``options.seed`` (module docstring)."""
    tokenizer = model.tokenizer
    names = ioi_names(tokenizer)
    if len(names) < 5:
        raise InputError(
            f"the tokenizer has {len(names)} single-token names; IOI prompts need at least 5"
        )
    g = torch.Generator().manual_seed(options.seed)
    prefix = start_ids(model)
    seqs, extras = [], []
    for i in range(options.n_sequences):
        template = IOI_TEMPLATES[(i // 2) % len(IOI_TEMPLATES)]
        io, s = (names[int(j)] for j in torch.randperm(len(names), generator=g)[:2])
        place = PLACES[int(torch.randint(len(PLACES), (), generator=g))]
        obj = OBJECTS[int(torch.randint(len(OBJECTS), (), generator=g))]
        ids, where = _prompt(tokenizer, template, io, s, place, obj, abba=i % 2 == 0)
        seqs.append(prefix + ids)
        extras.append(
            {"io": io, "s": s, **{k: v + len(prefix) for k, v in where.items()}, "abba": i % 2 == 0}
        )
    batches = batch_sequences(seqs, tokenizer, options.batch_size, extras)
    for b in batches:
        for key in ("io", "s", "io_pos", "s1_pos", "s2_pos", "end_pos"):
            b.extras[key] = torch.tensor(b.extras[key], dtype=torch.long)
    return Probe("ioi", batches, {"names": len(names), "templates": len(IOI_TEMPLATES)})


def corrupt_ioi(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Wang et al.'s ABC prompts: the IO, S1 and S2 positions hold three other distinct
    names (no name repeats, so nothing singles out an indirect object); answer extras kept."""
    names = torch.tensor(ioi_names(model.tokenizer))
    g = torch.Generator().manual_seed(0x5EED_C0DE + seed)
    ids = batch.input_ids.clone()
    e = batch.extras
    for row in range(ids.shape[0]):
        avoid = {int(e["io"][row]), int(e["s"][row])}
        pool = names[[int(n) not in avoid for n in names]]
        fresh = pool[torch.randperm(len(pool), generator=g)[:3]]
        for k, key in enumerate(("io_pos", "s1_pos", "s2_pos")):
            ids[row, int(e[key][row])] = fresh[k]
    return replace(batch, input_ids=ids)


def end_targets(batch: ProbeBatch, key: str) -> Tensor:
    """Per query, the key position a head at the prompt's end attends to when it reads
    ``key`` (``io_pos``, ``s1_pos`` or ``s2_pos``): ``Int[batch, pos]``, -1 except at
    ``end_pos``."""
    e = batch.extras
    out = torch.full_like(batch.input_ids, -1)
    rows = torch.arange(out.shape[0], device=out.device)
    out[rows, e["end_pos"].to(out.device)] = e[key].to(out.device)
    return out
