"""Tasks: what a head is important *for*.

A task pairs a probe (the data) with a differentiable **metric**. The metric has one
meaning everywhere in headmech: a loss, higher is worse, so the effect of removing heads
is ``metric(intervened) - metric(clean)`` and a positive effect means they were needed.
Importance methods, pruning, catalog validation and circuits all take a task object.

The protocol (:class:`Task`): ``batches(model, options)`` builds the probe;
``metric(model, batch, copies=k)`` runs one forward pass on the batch stacked ``k``
times and returns a sum and a count per copy, so the intervention runner
(:func:`headmech.interventions.run_variants`) can carry ``k`` interventions in one pass
(copy ``i`` carries variant ``i``); the interventions themselves are hooks the caller
has applied around the call. ``reference`` gives clean-run data a metric compares with,
``corrupt`` a corrupted batch for patching methods.

Built-in tasks:

* ``lm`` — causal models: mean next-token loss on the prose probe. Encoders: sentence
  embedding fidelity, ``1 - cos(e, e0)`` between the mean-pooled final hidden state ``e``
  and the unablated model's ``e0``.
* ``induction`` — loss on the repeated half of random-token sequences
  (``repeated_random`` probe; Olsson et al. 2022).
* ``retrieval`` — teacher-forced needle-answer NLL (``needle`` probe; causal only).
* :class:`CallableTask` — any function of the logits (or of the final hidden state),
  ``CallableTask(fn, on="logits" | "hidden")`` with ``fn(output, batch) -> scalar``.

Tasks are registered in :data:`headmech.core.registry.TASKS` (a plug-in package adds one
through the entry-point group ``headmech.tasks``: a factory ``model -> Task``); the
built-in ones' selections and corruptions live in :mod:`headmech.tasks.data`.

**The encoder ``lm`` subtlety.** Cosine fidelity is at its optimum on the clean model, so
its gradient with respect to head masks or head outputs is exactly zero there, and every
first-order method (mask gradient, attribution patching) would see nothing. Gradient
methods therefore use the *projection metric* ``1 - e·e0/|e0|²`` (the embedding's
component along its clean direction, relative to the clean norm): it equals the cosine
metric's value 0 at the clean point, is linear in ``e`` and has a non-zero gradient.
A head that rotates the embedding away from ``e0`` also shrinks that component, so the
two agree on which heads matter to first order in the direction of ``e0``; what the
projection misses is a pure rotation that keeps ``e·e0``. Results say which metric each
method used (``ImportanceResult.metric_description``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from headmech.core.errors import UnknownTaskError
from headmech.core.placement import model_device
from headmech.core.registry import TASKS
from headmech.models.unembedding import token_losses, unembed
from headmech.probes import ProbeOptions, build_probe, random_token_ids
from headmech.stream.engine import ProbeBatch, run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "CallableTask",
    "EmbeddingTask",
    "LogitDiffTask",
    "Task",
    "TokenLossTask",
    "UnknownTaskError",
    "corrupt_prose",
    "get_task",
    "is_causal",
    "stack_copies",
    "unembed",
]


def is_causal(model: TransformerBridge) -> bool:
    """Whether the model is a decoder (causal attention) rather than an encoder."""
    return getattr(model.cfg, "attention_dir", "causal") != "bidirectional"


class Task:
    """A probe plus a differentiable metric (a loss: higher is worse).

    Attributes:
        name: registry key.
        probe: the probe it runs on (:func:`headmech.probes.build_probe`).
        causal_only: refused on encoders.
        description: what :meth:`metric` measures (recorded in results).
        gradient_description: what :meth:`metric` with ``linear=True`` measures (gradient
            methods use it; the same unless the metric is flat at the clean model).
    """

    name: str = "task"
    probe: str = "prose"
    causal_only: bool = False
    description: str = ""
    gradient_description: str = ""

    def check(self, model: TransformerBridge) -> None:
        """Raise a one-line error when the task does not fit the model."""
        if self.causal_only and not is_causal(model):
            raise UnknownTaskError(
                f"task '{self.name}' needs a causal (decoder) model; this one is an encoder"
            )

    def batches(self, model: TransformerBridge, options: ProbeOptions) -> list[ProbeBatch]:
        """The task's probe batches under ``options``."""
        return build_probe(self.probe, model, options).batches

    def reference(self, model: TransformerBridge, batch: ProbeBatch) -> Any:
        """Clean-run data the metric compares with (None unless the task needs it); computed
        with no intervention applied."""
        return None

    def metric(
        self,
        model: TransformerBridge,
        batch: ProbeBatch,
        *,
        copies: int = 1,
        reference: Any = None,
        linear: bool = False,
    ) -> tuple[Float[Tensor, "copies units"], Float[Tensor, "copies units"]]:
        """Sum and count of the metric per copy of ``batch`` stacked ``copies`` times and
        per unit (sequence; a whole-batch metric has one unit), from one forward pass under
        whatever interventions the caller applied. Per-unit values let
        :mod:`headmech.stream.uncertainty` resample the probe's examples.

        Gradients flow when autograd is enabled (callers choose ``torch.no_grad``).
        """
        raise NotImplementedError

    def corrupt(self, batch: ProbeBatch, model: TransformerBridge, seed: int) -> ProbeBatch:
        """A corrupted version of ``batch`` (same length) for patching methods."""
        raise UnknownTaskError(
            f"task '{self.name}' defines no corrupted inputs: patching needs clean/corrupt pairs"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def stack_copies(
    batch: ProbeBatch, copies: int, device: torch.device
) -> tuple[Int[Tensor, "rows pos"], Int[Tensor, "rows pos"]]:
    """The batch's token ids and attention mask on ``device``, stacked ``copies`` times
    (copy-major: rows ``c * batch + i``), as every task's :meth:`Task.metric` reads them."""
    ids = batch.input_ids.to(device).repeat(copies, 1)  # [copies * batch, pos]
    mask = batch.attention_mask.to(device).repeat(copies, 1)
    return ids, mask


# offset so corruptions never replay the probe's own draws (probes seed from 0, 1, ...)
CORRUPT_SEED = 0x5EED_C0DE


def corrupt_prose(batch: ProbeBatch, model: Any, seed: int) -> ProbeBatch:
    """Every ordinary token replaced by a random ordinary token (special tokens, padding
    and length kept): the sentence is gone, its frame stays."""
    g = torch.Generator().manual_seed(CORRUPT_SEED + seed)
    ids = batch.input_ids.clone()
    fresh = random_token_ids(model.tokenizer, g, tuple(ids.shape)).to(ids.device)
    ordinary = ~batch.special.to(ids.device)
    ids[ordinary] = fresh[ordinary]
    return replace(batch, input_ids=ids)


class TokenLossTask(Task):
    """Cross-entropy of chosen target tokens at chosen query positions (causal models).

    ``select(batch)`` returns the query positions (``Bool[batch, pos]``) and the token each
    should predict there (``Int[batch, pos]``): the same selection serves the loss and
    direct logit attribution. With ``probability=True`` the metric is minus the target's
    probability instead of its cross-entropy (Todd et al. 2023 measure indirect effects
    in probability).
    """

    causal_only = True

    def __init__(
        self,
        name: str,
        probe: str,
        select: Callable[[ProbeBatch], tuple[Tensor, Tensor]],
        description: str,
        corrupt: Callable[[ProbeBatch, Any, int], ProbeBatch] | None = None,
        *,
        probability: bool = False,
    ) -> None:
        self.name = name
        self.probe = probe
        self.select = select
        self.description = description
        self.gradient_description = description
        self._corrupt = corrupt
        self.probability = probability

    def metric(self, model, batch, *, copies=1, reference=None, linear=False):
        dev = model_device(model)
        ids, mask = stack_copies(batch, copies, dev)
        query, target = self.select(batch.to(dev))  # [batch, pos] each
        # [copies * batch, pos, d_model], exact at the query positions (the rows read)
        resid = run_blocks(model, ids, mask, rows=query.repeat(copies, 1))
        resid = resid.view(copies, *query.shape, -1)  # [copies, batch, pos, d_model]
        sel = query[None].expand(copies, -1, -1)
        loss = token_losses(model, resid[sel], target[None].expand(copies, -1, -1)[sel])
        if self.probability:
            loss = -torch.exp(-loss)  # minus the target's probability
        return _per_sequence(loss, query, copies)

    def corrupt(self, batch, model, seed):
        if self._corrupt is None:
            return super().corrupt(batch, model, seed)
        return self._corrupt(batch, model, seed)


class LogitDiffTask(Task):
    """Logit difference between a correct and a contrasting token at chosen positions
    (causal models), as a loss: ``logit[bad] - logit[good]``, higher is worse.

    ``contrast(batch)`` returns the query positions (``Bool[batch, pos]``) and, there, the
    correct and the contrasting token (``Int[batch, pos]`` each): for IOI (Wang et al.
    2022) the indirect object and the subject at the prompt's last token. Direct logit
    attribution reads the same contrast (its direction is ``W_U[:, good] - W_U[:, bad]``).
    """

    causal_only = True

    def __init__(
        self,
        name: str,
        probe: str,
        contrast: Callable[[ProbeBatch], tuple[Tensor, Tensor, Tensor]],
        description: str,
        corrupt: Callable[[ProbeBatch, Any, int], ProbeBatch] | None = None,
    ) -> None:
        self.name = name
        self.probe = probe
        self.contrast = contrast
        self.description = description
        self.gradient_description = description
        self._corrupt = corrupt

    def metric(self, model, batch, *, copies=1, reference=None, linear=False):
        dev = model_device(model)
        ids, mask = stack_copies(batch, copies, dev)
        query, good, bad = self.contrast(batch.to(dev))  # [batch, pos] each
        rows = query.repeat(copies, 1)  # the rows read: exact there (run_blocks)
        resid = run_blocks(model, ids, mask, rows=rows).view(copies, *query.shape, -1)
        sel = query[None].expand(copies, -1, -1)
        pick = torch.stack([good[query], bad[query]], -1).repeat(copies, 1)  # [n, 2]
        # only the tokens compared: logits of the (few) distinct ones, not the vocabulary
        tokens, where = pick.unique(return_inverse=True)  # where: [n, 2] into tokens
        logits = unembed(model, resid[sel], tokens).float()  # [n, distinct tokens]
        two = logits.gather(1, where)
        diff = two[:, 1] - two[:, 0]  # bad - good
        return _per_sequence(diff, query, copies)

    def corrupt(self, batch, model, seed):
        if self._corrupt is None:
            return super().corrupt(batch, model, seed)
        return self._corrupt(batch, model, seed)


class EmbeddingTask(Task):
    """Encoder ``lm``: fidelity of the mean-pooled sentence embedding to the clean model's.

    ``description``: ``1 - cos(e, e0)``; ``gradient_description`` (``linear=True``):
    ``1 - e·e0/|e0|²``, whose gradient at the clean model is not zero (module docstring).
    The reference ``e0`` is computed with no intervention applied.
    """

    name = "lm"
    probe = "prose"
    description = "1 - cos(e, e0), mean-pooled final hidden state vs the clean model"
    gradient_description = "1 - e.e0/|e0|^2 (projection on the clean embedding; cosine's gradient is 0 at the clean model)"

    def reference(self, model, batch):
        with torch.no_grad():
            return self._pool(model, batch, 1)[0].detach()

    def _pool(self, model: Any, batch: ProbeBatch, copies: int) -> Tensor:
        dev = model_device(model)
        ids, mask = stack_copies(batch, copies, dev)
        h = run_blocks(model, ids, mask)  # [copies * batch, pos, d_model]
        m = mask[..., None].to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)  # [copies * batch, d_model]
        return pooled.view(copies, batch.input_ids.shape[0], -1)  # [copies, batch, d_model]

    def corrupt(self, batch, model, seed):
        """Random ordinary tokens in place of the sentence's (patching on encoders)."""
        return corrupt_prose(batch, model, seed)

    def metric(self, model, batch, *, copies=1, reference=None, linear=False):
        if reference is None:
            raise UnknownTaskError(
                "the encoder lm task needs the clean embedding: pass reference=task.reference(model, batch)"
            )
        e = self._pool(model, batch, copies).float()
        e0 = reference.float()[None]  # [1, batch, d_model]
        if linear:
            sim = (e * e0).sum(-1) / (e0 * e0).sum(-1)
        else:
            sim = F.cosine_similarity(e, e0.expand_as(e), dim=-1)
        sums = 1.0 - sim  # [copies, batch]: per sequence
        return sums, torch.ones_like(sums)


class CallableTask(Task):
    """A user metric: ``fn(output, batch) -> scalar`` per batch (a loss: higher is worse).

    ``output`` is the logits ``[batch, pos, d_vocab]`` (``on="logits"``) or the final
    hidden state ``[batch, pos, d_model]`` (``on="hidden"``). The task's value is the mean
    of ``fn`` over the probe's batches. With stacked copies, ``fn`` sees one copy at a time,
    so a TransformerLens-style metric (a scalar over the batch) works unchanged.
    """

    def __init__(
        self,
        fn: Callable[[Tensor, ProbeBatch], Tensor],
        *,
        name: str = "custom",
        probe: str = "prose",
        on: Literal["logits", "hidden"] = "logits",
        metric: str | None = None,
        batches: list[ProbeBatch] | None = None,
        corrupt_batches: list[ProbeBatch] | None = None,
    ) -> None:
        if on not in ("logits", "hidden"):
            raise ValueError(f"on must be 'logits' or 'hidden', got {on!r}")
        self.fn = fn
        self.name = name
        self.probe = probe
        self.on = on
        self.description = metric or f"{getattr(fn, '__name__', 'user metric')} on the {on}"
        self.gradient_description = self.description
        self._batches = batches
        self._corrupt = corrupt_batches

    def batches(self, model, options):
        return self._batches if self._batches is not None else super().batches(model, options)

    def metric(self, model, batch, *, copies=1, reference=None, linear=False):
        dev = model_device(model)
        ids, mask = stack_copies(batch, copies, dev)
        if self.on == "logits":
            out = model(ids, attention_mask=mask)
        else:
            out = run_blocks(model, ids, mask)
        out = out.view(copies, *batch.input_ids.shape, -1)  # [copies, batch, pos, d]
        b = batch.to(dev)
        vals = torch.stack(
            [torch.as_tensor(self.fn(out[i], b)).float().reshape(1) for i in range(copies)]
        )  # [copies, 1]: the metric is of the whole batch, one unit
        return vals, torch.ones_like(vals)

    def corrupt(self, batch, model, seed):
        if self._corrupt is None or self._batches is None:
            return super().corrupt(batch, model, seed)
        for b, c in zip(self._batches, self._corrupt, strict=True):
            if b is batch:
                return c
        raise UnknownTaskError("no corrupted counterpart for this batch")


def get_task(task: str | Task, model: TransformerBridge) -> Task:
    """A task by name (see :data:`headmech.core.registry.TASKS`) or as given; checked for the model.

    Raises:
        UnknownTaskError: an unknown name, or a causal-only task on an encoder.
    """
    out = task if isinstance(task, Task) else TASKS.get(str(task))(model)
    out.check(model)
    return out


def _per_sequence(values: Tensor, query: Tensor, copies: int) -> tuple[Tensor, Tensor]:
    """Per copy and sequence, the sum of ``values`` (one per selected position: ``query``
    ``[batch, pos]`` repeated ``copies`` times, in that order) and the count summed."""
    n_seq = query.shape[0]
    sel = query[None].expand(copies, -1, -1)
    unit = torch.arange(copies * n_seq, device=values.device).view(copies, n_seq, 1)
    sums = values.new_zeros(copies * n_seq).index_add(0, unit.expand_as(sel)[sel], values)
    counts = query.sum(1).to(values.dtype)[None].expand(copies, -1)
    return sums.view(copies, n_seq), counts
