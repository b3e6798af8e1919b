"""Ordinal sequences (Gould et al. 2023): runs of consecutive items of a familiar order.

The eight tasks of Gould et al.'s successor-head paper, written offline: numbers 1–200,
number words, ordinals, days, day prefixes, months, month prefixes and capital letters.
An item counts for a tokenizer when ``" " + item`` is one token (the form it takes inside
running text); items that are not single tokens split a task into runs, and succession is
only asked within a run (for SmolLM2's tokenizer, which splits numbers into digits, the
numbers task is empty).

The ``ordinal`` probe: BOS + 4 to 8 consecutive items of one task, comma-separated as in
running text (" Monday, Tuesday, Wednesday": SmolLM2-135M gives " Wednesday" a
log-probability of -0.12 there and -10 in a bare space-separated list), tasks drawn in
turn, starts drawn from the seed. ``extras["item"]`` marks the item tokens,
``extras["next_item"]`` the commas followed by the next item: the queries of the
``succession`` task (next-item loss); ``extras["task"]`` names each sequence's task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import InputError
from headmech.probes import Probe, ProbeOptions, batch_sequences, register_probe, start_ids

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["ORDINAL_TASKS", "ordinal_runs", "ordinal_probe"]

_WORDS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
ORDINAL_TASKS: dict[str, list[str]] = {
    "numbers": [str(i) for i in range(1, 201)],
    "number_words": _WORDS.split(),
    "ordinals": [
        "first",
        "second",
        "third",
        "fourth",
        "fifth",
        "sixth",
        "seventh",
        "eighth",
        "ninth",
        "tenth",
    ],
    "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "day_prefixes": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"],
    "months": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    "month_prefixes": [
        "Jan",
        "Feb",
        "Mar",
        "Apr",
        "May",
        "Jun",
        "Jul",
        "Aug",
        "Sep",
        "Oct",
        "Nov",
        "Dec",
    ],
    "letters": [chr(c) for c in range(ord("A"), ord("Z") + 1)],
}
MIN_RUN, MAX_RUN = 4, 8  # items per probe sequence


def ordinal_runs(tokenizer: Any) -> dict[str, list[list[int]]]:
    """Per task, its maximal runs of consecutive single-token items, as token ids (runs
    of at least two items: one pair of succession)."""
    out: dict[str, list[list[int]]] = {}
    unknown = getattr(tokenizer, "unk_token_id", None)
    for task, items in ORDINAL_TASKS.items():
        runs: list[list[int]] = [[]]
        for item in items:
            ids = tokenizer.encode(" " + item, add_special_tokens=False)
            if len(ids) == 1 and ids[0] != unknown:
                runs[-1].append(int(ids[0]))
            elif runs[-1]:
                runs.append([])
        kept = [r for r in runs if len(r) >= 2]
        if kept:
            out[task] = kept
    return out


@register_probe("ordinal", "BOS + 4-8 consecutive ordinal items (days, months, letters, ...)")
def ordinal_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """``options.n_sequences`` sequences of consecutive ordinal items (module docstring)."""
    tokenizer = model.tokenizer
    runs = ordinal_runs(tokenizer)
    long_runs = {t: [r for r in rs if len(r) >= MIN_RUN] for t, rs in runs.items()}
    tasks = sorted(t for t, rs in long_runs.items() if rs)
    if not tasks:
        raise InputError("the tokenizer has no run of 4 single-token ordinal items")
    g = torch.Generator().manual_seed(options.seed)
    prefix = start_ids(model)
    comma = tokenizer.encode(",", add_special_tokens=False)
    if len(comma) != 1:
        raise InputError("the tokenizer has no single-token comma")
    seqs, names = [], []
    for i in range(options.n_sequences):
        task = tasks[i % len(tasks)]
        pool = long_runs[task]
        run = pool[int(torch.randint(len(pool), (), generator=g))]
        n = min(len(run), int(torch.randint(MIN_RUN, MAX_RUN + 1, (), generator=g)))
        start = int(torch.randint(len(run) - n + 1, (), generator=g))
        body = [x for t in run[start : start + n] for x in (t, comma[0])][:-1]
        seqs.append(prefix + body)
        names.append(task)
    batches = batch_sequences(seqs, tokenizer, options.batch_size, [{"task": t} for t in names])
    for b in batches:
        item = torch.zeros_like(b.attention_mask, dtype=torch.bool)
        next_item = torch.zeros_like(item)
        for row, length in enumerate(b.attention_mask.sum(1).tolist()):
            item[row, len(prefix) : length : 2] = True  # items at even offsets
            next_item[row, len(prefix) + 1 : length : 2] = True  # the commas between them
        b.extras["item"], b.extras["next_item"] = item, next_item
    info = {"tasks": {t: len(rs) for t, rs in runs.items()}}
    return Probe("ordinal", batches, info)
