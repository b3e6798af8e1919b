"""Exact evaluation of a KV plan by masks: needle recall, answer log-probability and
long-prose perplexity with every windowed head restricted to its sinks and window.

The model runs whole sequences once per plan (:func:`~headmech.kv.attention.planned`:
a per-head mask inside the model's own fused attention), which is what a compressed
cache computes, step by step, for every position (:mod:`headmech.kv.cache`).

* Needle: the ``needle`` probe (:mod:`headmech.probes.needle`) with one haystack length
  per context (:func:`needle_batches`), the answer teacher-forced after the question; per
  trial the answer's log-probability (sum over its tokens), its mean token NLL, whether
  greedy decoding would give it whole (every answer token the argmax: ``exact``) and the
  fraction of its tokens that are the argmax.
* Perplexity: ``exp`` of the mean next-token NLL over every position of long prose
  sequences (:func:`prose_batches`: the corpus' sentences in a seeded order, one
  sequence per seed, ``context`` tokens each).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from headmech.core.errors import InputError
from headmech.kv.attention import planned
from headmech.kv.plan import KVPlan
from headmech.stream.engine import ProbeBatch

__all__ = ["NEEDLE_OVERHEAD", "KVEval", "evaluate", "needle_batches", "prose_batches"]

# needle probe tokens besides the haystack (BOS, needle, question, answer), so that a
# trial of haystack ``context - NEEDLE_OVERHEAD`` is about ``context`` tokens long
NEEDLE_OVERHEAD = 48
_LOGIT_ROWS = 512  # positions per unembedding call (a [rows, d_vocab] fp32 block)


def needle_batches(
    model: Any,
    context: int,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    seeds: Sequence[int] = (0,),
    corpus: Any = None,
) -> list[ProbeBatch]:
    """Needle trials of about ``context`` tokens, one per depth and seed (batch size 1)."""
    from headmech.probes import ProbeOptions, build_probe

    if context <= NEEDLE_OVERHEAD + 32:
        raise InputError(f"a needle context needs more than {NEEDLE_OVERHEAD + 32} tokens")
    out: list[ProbeBatch] = []
    for seed in seeds:
        opts = ProbeOptions(
            corpus=corpus, seed=int(seed), batch_size=1,
            needle_lengths=(context - NEEDLE_OVERHEAD,), needle_depths=tuple(depths),
        )  # fmt: skip
        out += build_probe("needle", model, opts).batches
    return out


def prose_batches(
    model: Any, context: int, n: int = 2, seed: int = 0, corpus: Any = None
) -> list[ProbeBatch]:
    """``n`` prose sequences of ``context`` tokens (BOS, then the corpus' sentences in a
    seeded order), batch size 1."""
    from headmech.probes import batch_sequences, load_sentences

    tok = model.tokenizer
    sentences = load_sentences(corpus)
    encoded = [tok(" " + s, add_special_tokens=False)["input_ids"] for s in sentences]
    total = sum(len(e) for e in encoded)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    if total < context - len(bos):
        raise InputError(f"the corpus has {total} tokens, fewer than a context of {context}")
    out: list[ProbeBatch] = []
    for i in range(n):
        order = list(range(len(encoded)))
        random.Random(seed * 1_000_003 + i).shuffle(order)
        ids = list(bos)
        for j in order:
            ids += encoded[j]
            if len(ids) >= context:
                break
        out += batch_sequences([ids[:context]], tok, 1)
    return out


@dataclass
class KVEval:
    """What one plan keeps of the model's long-context behaviour.

    Attributes:
        plan: summary of the plan (source, KV heads full, sinks, window, KV fraction).
        trials: per needle trial: ``tokens``, ``depth`` (the needle's position / length),
            ``logprob`` (answer, summed), ``nll`` (per answer token), ``exact``,
            ``token_accuracy``.
        nll_sum, n_tokens: next-token NLL summed over the prose positions, and their count.
        seconds: time of the evaluation.
    """

    plan: dict[str, Any]
    trials: list[dict[str, float]] = field(default_factory=list)
    nll_sum: float = 0.0
    n_tokens: int = 0
    seconds: float = 0.0

    def _mean(self, key: str) -> float:
        vals = [float(t[key]) for t in self.trials]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def recall(self) -> float:
        """Fraction of needle trials answered exactly (greedy)."""
        return self._mean("exact")

    @property
    def token_accuracy(self) -> float:
        """Fraction of answer tokens that are the argmax."""
        return self._mean("token_accuracy")

    @property
    def logprob(self) -> float:
        """Mean log-probability of the whole answer."""
        return self._mean("logprob")

    @property
    def perplexity(self) -> float:
        """Perplexity on the prose sequences."""
        return math.exp(self.nll_sum / self.n_tokens) if self.n_tokens else float("nan")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (the trials included)."""
        return {
            "plan": self.plan,
            "recall": self.recall,
            "token_accuracy": self.token_accuracy,
            "logprob": self.logprob,
            "perplexity": self.perplexity,
            "n_prose_tokens": self.n_tokens,
            "trials": self.trials,
        }


def _hidden(hf: Any, batch: ProbeBatch) -> Tensor:
    dev = next(hf.parameters()).device
    out = hf.base_model(
        input_ids=batch.input_ids.to(dev),
        attention_mask=batch.attention_mask.to(dev),
        use_cache=False,
    )
    return out.last_hidden_state  # [batch, pos, d_model]


def _logits(hf: Any, hidden: Tensor) -> Tensor:
    """The model's logits of final hidden states (Gemma 2's final soft-capping included)."""
    logits = hf.get_output_embeddings()(hidden).float()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def needle_scores(hf: Any, batch: ProbeBatch, hidden: Tensor) -> list[dict[str, float]]:
    """Per needle trial of ``batch``, its answer's scores from the final hidden states."""
    from headmech.probes.needle import needle_spans

    answer_pos, _, valid, _ = needle_spans(batch)
    out = []
    for row in range(hidden.shape[0]):
        pos = answer_pos[row][valid[row]].to(hidden.device)
        logits = _logits(hf, hidden[row, pos - 1])  # [answer, d_vocab]
        target = batch.input_ids[row].to(hidden.device)[pos]
        nll = F.cross_entropy(logits, target, reduction="none")
        hit = (logits.argmax(-1) == target).float()
        length = int(batch.attention_mask[row].sum())
        out.append(
            {
                "tokens": length,
                "depth": round(int(batch.extras["needle_start"][row]) / length, 2),
                "logprob": -float(nll.sum()),
                "nll": float(nll.mean()),
                "exact": float(hit.all()),
                "token_accuracy": float(hit.mean()),
            }
        )
    return out


def prose_nll(hf: Any, batch: ProbeBatch, hidden: Tensor) -> tuple[float, int]:
    """The next-token NLL summed over ``batch``'s prose positions, and their count, from
    the final hidden states."""
    ids = batch.input_ids.to(hidden.device)
    mask = batch.attention_mask.to(hidden.device).bool()
    total, count = 0.0, 0
    for start in range(0, hidden.shape[1] - 1, _LOGIT_ROWS):
        stop = min(start + _LOGIT_ROWS, hidden.shape[1] - 1)
        logits = _logits(hf, hidden[:, start:stop])  # [batch, rows, d_vocab]
        target = ids[:, start + 1 : stop + 1]
        keep = mask[:, start + 1 : stop + 1]
        # rows x vocabulary, contiguous: over a transposed [batch, vocab, rows] view the
        # reduction is strided, 7x slower at a 262k-word vocabulary (Gemma 3)
        flat = logits.reshape(-1, logits.shape[-1])
        nll = F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
        total += float(nll[keep].sum())
        count += int(keep.sum())
    return total, count


def plan_summary(plan: KVPlan | None, context: int) -> dict[str, Any]:
    """What a result needs to say about its plan."""
    if plan is None:
        return {"kind": "full", "n_full": None, "kv_fraction": 1.0}
    return {
        "kind": plan.source.get("kind", "heads"),
        "n_full": plan.n_full,
        "n_kv_heads_total": plan.full.numel(),
        "sinks": plan.sinks,
        "window": plan.window,
        "kv_fraction": plan.kv_fraction(context),
        "per_layer": plan.per_layer(),
    }


def evaluate(
    model: Any,
    plan: KVPlan | None,
    needle: Sequence[ProbeBatch] = (),
    prose: Sequence[ProbeBatch] = (),
) -> KVEval:
    """Needle recall and log-probability, and prose perplexity, under ``plan``'s masks
    (``plan`` None: every head full).

    Args:
        model: a causal bridge (or its plain Hugging Face model).
        plan: the KV plan.
        needle: needle batches (:func:`needle_batches`).
        prose: prose batches (:func:`prose_batches`).
    """
    context = max((int(b.input_ids.shape[1]) for b in [*needle, *prose]), default=0)
    result = KVEval(plan_summary(plan, context))
    t0 = time.perf_counter()
    with planned(model, plan) as hf, torch.inference_mode():
        for batch in needle:
            result.trials += needle_scores(hf, batch, _hidden(hf, batch))
        for batch in prose:
            nll, n = prose_nll(hf, batch, _hidden(hf, batch))
            result.nll_sum += nll
            result.n_tokens += n
    result.seconds = time.perf_counter() - t0
    return result
