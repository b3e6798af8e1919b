"""Needle-in-a-haystack probe: a fact hidden in long prose, then asked for.

Each trial is one sequence::

    BOS  haystack[:k]  NEEDLE  haystack[k:]  QUESTION  ANSWER

* the haystack is whole prose sentences (the default corpus or the user's) shuffled per
  trial and cut to a target number of tokens;
* the needle is a sentence with an answer the model cannot guess: " The secret code of
  the blue door is 7-4-2-9-1-3." (colour, object and six digits drawn per trial);
* the question repeats the needle's wording up to the answer ("...\\nAnswer: The secret
  code of the blue door is"), so the answer is the code, teacher-forced after it.

Trials cross the context lengths (``ProbeOptions.needle_lengths``) with the needle depths
(``ProbeOptions.needle_depths``); lengths that do not fit the model's context are scaled
down together. Pieces are tokenised separately and concatenated, so the needle's span and
its answer tokens are known exactly (byte-level BPE splits at spaces, so this is the
tokenisation of the whole text).

``ProbeBatch.extras`` carries, padded with -1 to ``[batch, pos]``:
``answer_pos`` (positions of the answer tokens at the end of the sequence) and
``source_pos`` (position of the same token inside the needle), and, as lists,
``needle_start`` / ``needle_end`` (the needle sentence's half-open token span).

References:
    Kamradt 2023, "Needle In A Haystack — Pressure Testing LLMs" (github.com/gkamradt);
    Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Int
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.placement import model_device
from headmech.probes import (
    Probe,
    ProbeOptions,
    batch_sequences,
    load_sentences,
    register_probe,
    start_ids,
)
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["NeedleTrial", "answer_losses", "needle_probe", "needle_recall", "needle_spans"]

COLORS = ("blue", "red", "green", "yellow", "white", "black", "orange", "silver", "purple")
THINGS = ("door", "box", "gate", "safe", "locker", "chest", "vault", "drawer")
N_DIGITS = 6
# the shortest haystack kept when contexts are scaled down to a small model's n_ctx
MIN_HAYSTACK = 32
# bounds one forward pass: batch * pos**2 (attention) and batch * pos (logits)
_PATTERN_BUDGET = 4_000_000
_TOKEN_BUDGET = 1_600


@dataclass(frozen=True)
class NeedleTrial:
    """The text of one trial (before tokenisation).

    Attributes:
        needle_lead: the needle up to its answer (``" The secret code of the blue door is"``).
        answer: the answer with its leading space (``" 7-4-2-9-1-3"``).
        question: the question and the answer's lead-in.
        length: haystack size in tokens.
        depth: needle position in the haystack, 0..1.
    """

    needle_lead: str
    answer: str
    question: str
    length: int
    depth: float


def _trials(options: ProbeOptions, lengths: Sequence[int]) -> list[tuple[NeedleTrial, int]]:
    """Every (length, depth) trial with its own needle and haystack seed."""
    out = []
    for i, (length, depth) in enumerate(
        (length, depth) for length in lengths for depth in options.needle_depths
    ):
        rng = random.Random(options.seed * 1_000_003 + i)
        color, thing = rng.choice(COLORS), rng.choice(THINGS)
        code = "-".join(str(rng.randrange(10)) for _ in range(N_DIGITS))
        subject = f"the secret code of the {color} {thing}"
        trial = NeedleTrial(
            needle_lead=f" The secret code of the {color} {thing} is",
            answer=f" {code}",
            question=f"\n\nQuestion: What is {subject}?\nAnswer: The secret code of the {color} {thing} is",
            length=int(length),
            depth=float(depth),
        )
        out.append((trial, rng.randrange(2**31)))
    return out


def _fit_lengths(lengths: Sequence[int], room: int) -> list[int]:
    """Scale the haystack sizes down together so the longest fits in ``room`` tokens."""
    if not lengths:
        raise InputError("needle_lengths is empty")
    if min(lengths) < 1:
        raise InputError(f"needle lengths must be positive, got {list(lengths)}")
    if room < MIN_HAYSTACK:
        raise InputError(
            f"the needle probe needs {MIN_HAYSTACK} tokens of haystack besides the needle and "
            f"question; the model's context leaves {max(room, 0)}"
        )
    factor = min(1.0, room / max(lengths))
    return sorted({max(MIN_HAYSTACK, int(length * factor)) for length in lengths})


def _haystack(encoded: Sequence[list[int]], length: int, seed: int) -> list[list[int]]:
    """Sentences in a seeded random order, as many as fit in ``length`` tokens."""
    order = list(range(len(encoded)))
    random.Random(seed).shuffle(order)
    out, n = [], 0
    for i in order:
        if n + len(encoded[i]) <= length:
            out.append(encoded[i])
            n += len(encoded[i])
        if n >= length - 4:
            break
    return out


def _encoder(tok: Any) -> Callable[[str], list[int]]:
    """A function that tokenises a piece of text without special tokens."""

    def enc(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False)["input_ids"])

    return enc


def _trial_sequence(
    trial: NeedleTrial,
    seed: int,
    encoded: Sequence[list[int]],
    enc: Callable[[str], list[int]],
    bos: list[int],
) -> tuple[list[int], dict[str, Any]]:
    """One trial's token ids (BOS, haystack with the needle, question, answer) and extras."""
    hay = _haystack(encoded, trial.length, seed)
    k = round(trial.depth * len(hay))
    before = [i for s in hay[:k] for i in s]
    after = [i for s in hay[k:] for i in s]
    lead, answer = enc(trial.needle_lead), enc(trial.answer)
    needle = lead + answer + enc(".")
    start = len(bos) + len(before)
    prompt = bos + before + needle + after + enc(trial.question)
    ids = prompt + answer
    extras = {
        "answer_pos": list(range(len(prompt), len(ids))),
        "source_pos": list(range(start + len(lead), start + len(lead) + len(answer))),
        "needle_start": start,
        "needle_end": start + len(needle),
    }
    return ids, extras


def _length_batches(
    sequences: dict[int, list[list[int]]],
    extras: dict[int, list[dict[str, Any]]],
    tok: Any,
    batch_size: int,
) -> list[ProbeBatch]:
    """Batch each haystack length on its own, shortest first, within the memory budgets."""
    batches: list[ProbeBatch] = []
    for length in sorted(sequences):
        width = max(len(s) for s in sequences[length])
        size = max(1, min(batch_size, _PATTERN_BUDGET // width**2, _TOKEN_BUDGET // width))
        batches += batch_sequences(sequences[length], tok, size, extras[length])
    return batches


@register_probe("needle")
def needle_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """Needle-in-a-haystack sequences: every context length crossed with every depth.

    Args:
        model: a causal ``TransformerBridge`` with its tokenizer.
        options: ``needle_lengths``, ``needle_depths``, ``corpus``, ``batch_size`` and
            ``seed`` are used.

    Returns:
        A :class:`~headmech.probes.Probe` whose batches carry ``answer_pos``,
        ``source_pos``, ``needle_start`` and ``needle_end`` in their extras.

    Raises:
        InputError: if the model's context cannot hold a haystack of ``MIN_HAYSTACK``
            tokens besides the needle and the question.
    """
    tok = model.tokenizer
    if not options.needle_depths or not all(0.0 <= d <= 1.0 for d in options.needle_depths):
        raise InputError(f"needle depths must lie in [0, 1], got {list(options.needle_depths)}")
    enc = _encoder(tok)
    bos = start_ids(model)
    drafts = _trials(options, options.needle_lengths)
    overhead = len(bos) + max(
        len(enc(t.needle_lead)) + 2 * len(enc(t.answer)) + 1 + len(enc(t.question))
        for t, _ in drafts
    )
    lengths = _fit_lengths(options.needle_lengths, int(model.cfg.n_ctx) - overhead)
    encoded = [enc(" " + s) for s in load_sentences(options.corpus)]

    sequences: dict[int, list[list[int]]] = {}
    extras: dict[int, list[dict[str, Any]]] = {}
    for trial, seed in _trials(options, lengths):
        ids, trial_extras = _trial_sequence(trial, seed, encoded, enc, bos)
        sequences.setdefault(trial.length, []).append(ids)
        extras.setdefault(trial.length, []).append(trial_extras)
    batches = _length_batches(sequences, extras, tok, options.batch_size)
    info = {
        "needle_lengths": lengths,
        "needle_depths": list(options.needle_depths),
        "n_trials": sum(len(v) for v in sequences.values()),
        "answer_tokens": len(enc(drafts[0][0].answer)),
    }
    return Probe("needle", batches, info)


# --- per-batch views of the extras ----------------------------------------------------


def needle_spans(
    batch: ProbeBatch,
) -> tuple[
    Int[Tensor, "batch answer"],
    Int[Tensor, "batch answer"],
    Bool[Tensor, "batch answer"],
    Bool[Tensor, "batch pos"],
]:
    """The answer positions, their source positions in the needle, which of them are
    real (not padding), and the needle span as a mask, from a needle batch's extras."""
    answer_pos = batch.extras["answer_pos"]
    n_answer = int((answer_pos >= 0).sum(1).max())
    answer_pos = answer_pos[:, :n_answer]  # [batch, answer]
    source_pos = batch.extras["source_pos"][:, :n_answer]  # [batch, answer]
    valid = answer_pos >= 0
    pos = torch.arange(batch.input_ids.shape[1], device=answer_pos.device)
    start = torch.as_tensor(batch.extras["needle_start"], device=pos.device)[:, None]
    end = torch.as_tensor(batch.extras["needle_end"], device=pos.device)[:, None]
    span = (pos >= start) & (pos < end)  # [batch, pos]
    return answer_pos, source_pos, valid, span


def answer_losses(
    model: TransformerBridge, batch: ProbeBatch, fwd_hooks: Sequence[Any] = ()
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced loss and correctness of each answer token.

    Returns:
        ``(nll, correct, valid)``, each ``[batch, answer]``: the answer token's negative
        log-likelihood, whether it is the model's argmax, and which entries are real.
    """
    dev = model_device(model)
    b = batch.to(dev)
    answer_pos, _, valid, _ = needle_spans(b)
    from headmech.models.unembedding import unembed
    from headmech.stream.forward import run_blocks

    with torch.inference_mode(), model.hooks(fwd_hooks=list(fwd_hooks)):
        resid = run_blocks(model, b.input_ids, b.attention_mask)  # [batch, pos, d_model]
        query = (answer_pos - 1).clamp(min=0)  # the position that predicts each answer token
        picked = resid.gather(1, query[..., None].expand(-1, -1, resid.shape[-1]))
        # logits at the answer rows only: [batch, pos, d_vocab] would be 1.6 GB for one
        # 1,500-token sequence of Gemma 3's 262k-token vocabulary
        rows = unembed(model, picked).float()  # [batch, answer, d_vocab]
    target = b.input_ids.gather(1, answer_pos.clamp(min=0))  # [batch, answer]
    nll = F.cross_entropy(rows.transpose(1, 2), target, reduction="none")  # [batch, answer]
    correct = rows.argmax(-1) == target
    return nll.cpu(), correct.cpu(), valid.cpu()


def needle_recall(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Sequence[Any] = ()
) -> dict[str, float]:
    """Needle recall under teacher forcing.

    Returns:
        ``nll``: mean negative log-likelihood of the answer tokens; ``token_accuracy``:
        fraction of answer tokens that are the model's argmax; ``exact_match``: fraction
        of trials whose every answer token is the argmax — exactly the trials that greedy
        decoding answers correctly; ``n_trials``.
    """
    nll_sum, n_tok, n_correct, n_exact, n_trials = 0.0, 0, 0, 0, 0
    for batch in batches:
        nll, correct, valid = answer_losses(model, batch, fwd_hooks)
        nll_sum += float(nll[valid].sum())
        n_tok += int(valid.sum())
        n_correct += int(correct[valid].sum())
        n_exact += int((correct | ~valid).all(1).sum())
        n_trials += int(valid.shape[0])
    return {
        "nll": nll_sum / max(n_tok, 1),
        "token_accuracy": n_correct / max(n_tok, 1),
        "exact_match": n_exact / max(n_trials, 1),
        "n_trials": float(n_trials),
    }
