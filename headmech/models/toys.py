"""A toy attention-only induction model that trains on CPU in about a minute.

A 2-layer Hugging Face ``LlamaForCausalLM`` with MLPs frozen at zero (attention-only,
rotary positions; wrapped like any other model), trained on the classic induction task:
BOS, ``n`` random tokens, the same ``n`` again, ``n`` drawn afresh for every batch.

Why this recipe: with learned absolute positions (GPT-2 style) a 2-layer model found
shortcuts here instead of induction heads — attention to about position q/2 when the
first copy always starts at position 1, or, with random position offsets, a blurred
"look back ~6 tokens" head that matched several earlier tokens at once; repeated-half
loss fell while attention to the induction target stayed near 0. Rotary embeddings
make "the previous position" a single relative rotation for every query, so a sharp
previous-token head is cheap to learn; the induction circuit (previous-token head in
layer 0 K-composing with a prefix-matching head in layer 1) then forms in ~800 steps,
with the abrupt loss drop Olsson et al. describe.

Example: ``model, tok, metrics = train_toy_induction()``; ``metrics["induction_score"]``
is above 0.8.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from headmech.models.toy_data import (
    BOS_TOKEN,
    PAD_TOKEN,
    make_toy_tokenizer,
    repeated_random_tokens,
)

__all__ = [
    "BOS_TOKEN",
    "PAD_TOKEN",
    "ToyInductionConfig",
    "induction_mechanism_scores",
    "make_toy_tokenizer",
    "repeated_random_tokens",
    "train_toy_induction",
]


@dataclass(frozen=True)
class ToyInductionConfig:
    """Recipe for :func:`train_toy_induction` (the defaults are the cached ``toy-induction``)."""

    vocab_size: int = 256  # ordinary tokens "t0".."t255"; <bos> and <pad> come on top
    n_layers: int = 2  # layer 0: previous-token head, layer 1: induction head
    n_heads: int = 4  # heads per layer
    d_model: int = 128  # residual width (d_head = 32)
    n_ctx: int = 128  # rotary positions; >= 1 + 2 * max_half_len
    steps: int = 1500  # optimizer steps (the circuit forms around step 800)
    batch_size: int = 32  # sequences per step
    lr: float = 2e-3  # peak AdamW learning rate, after a linear warm-up
    warmup_steps: int = 100
    weight_decay: float = 0.01
    min_half_len: int = 8  # each batch: BOS + n random tokens + the same n tokens,
    max_half_len: int = 47  # n uniform in [min_half_len, max_half_len]
    seed: int = 0  # seeds weights and data (the global RNG is not used)
    eval_sequences: int = 64  # evaluation probe: sequences of
    eval_half_len: int = 40  # BOS + 40 random tokens + the same 40 again,
    eval_seed: int = 12345  # with their own seed


def _build_model(config: ToyInductionConfig) -> LlamaForCausalLM:
    with torch.random.fork_rng():  # HF initialises weights from the global generator
        torch.manual_seed(config.seed)
        return _init_model(config)


def _init_model(config: ToyInductionConfig) -> LlamaForCausalLM:
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size + 2,
        hidden_size=config.d_model,
        intermediate_size=4,  # the MLPs are frozen at zero: attention-only
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=config.n_ctx,
        bos_token_id=config.vocab_size,
        eos_token_id=config.vocab_size,
        pad_token_id=config.vocab_size + 1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM._from_config(hf_config, attn_implementation="eager")
    for layer in model.model.layers:
        for p in layer.mlp.parameters():
            p.data.zero_()
            p.requires_grad_(False)
    return model


def induction_mechanism_scores(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Previous-token and induction attention of every head on repeated random tokens.

    Args:
        model: a Hugging Face causal LM with eager attention.
        input_ids: ``[batch, 1 + 2 * half_len]`` from :func:`repeated_random_tokens` (with BOS).

    Returns:
        ``previous_token``: ``[n_layers, n_heads]`` mean attention from i to i - 1 (i >= 1);
        ``induction``: mean attention from each position i of the repeated half to
        i - half_len + 1, the token after its earlier copy.
    """
    seq_len = input_ids.shape[1]
    if seq_len % 2 != 1:
        raise ValueError("expected BOS + 2 * half_len tokens (odd length)")
    half = (seq_len - 1) // 2
    with torch.no_grad():
        out = model(input_ids, output_attentions=True)
    attn = torch.stack([a.float() for a in out.attentions])  # [n_layers, batch, head, query, key]
    i = torch.arange(1, seq_len)
    q = torch.arange(1 + half, seq_len)
    return {
        "previous_token": attn[:, :, :, i, i - 1].mean(dim=(1, 3)),
        "induction": attn[:, :, :, q, q - half + 1].mean(dim=(1, 3)),
    }


def _eval_metrics(model: LlamaForCausalLM, config: ToyInductionConfig) -> dict[str, Any]:
    g = torch.Generator().manual_seed(config.eval_seed)
    ids = repeated_random_tokens(
        config.eval_sequences,
        config.eval_half_len,
        config.vocab_size,
        generator=g,
        bos_id=config.vocab_size,
    )
    half = config.eval_half_len
    with torch.no_grad():
        logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    loss = loss.view(ids.shape[0], -1)  # loss[:, i] predicts token i + 1
    scores = induction_mechanism_scores(model, ids)
    prev, ind = scores["previous_token"], scores["induction"]
    return {
        "loss_first_half": float(loss[:, 1:half].mean()),
        "loss_repeated_half": float(loss[:, half + 1 :].mean()),
        "previous_token_score": float(prev[0].max()),
        "previous_token_head": [0, int(prev[0].argmax())],
        "induction_score": float(ind[-1].max()),
        "induction_head": [config.n_layers - 1, int(ind[-1].argmax())],
        "previous_token_scores": prev.tolist(),
        "induction_scores": ind.tolist(),
    }


def _train_step(
    model: LlamaForCausalLM,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    config: ToyInductionConfig,
    step: int,
    g: torch.Generator,
) -> float:
    """One AdamW step on a fresh batch of repeated random tokens (half length drawn anew)."""
    n = int(torch.randint(config.min_half_len, config.max_half_len + 1, (1,), generator=g))
    ids = repeated_random_tokens(
        config.batch_size, n, config.vocab_size, generator=g, bos_id=config.vocab_size
    )
    for group in opt.param_groups:
        group["lr"] = config.lr * min(1.0, (step + 1) / config.warmup_steps)
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()


def _checkpoint(
    model: LlamaForCausalLM,
    step: int,
    callback: Callable[[int, LlamaForCausalLM], None] | None,
    every: int,
    last: int,
) -> None:
    """Call ``callback(step, model)`` in eval mode at step 0, every ``every`` steps and at
    the last step."""
    if callback is None or every <= 0 or (step % every and step != last):
        return
    model.eval()
    with torch.no_grad():
        callback(step, model)
    model.train()


# Training runs on this many CPU threads whatever the machine has: with another count the
# float sums are reduced in another order and 1,500 steps give other weights (seen: 1 and 2
# threads train different toys), so the cached toy and its published catalog would depend
# on the machine's cores.
TRAINING_THREADS = 1


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's CPU threads set to ``n`` inside the block, the caller's count restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_toy_induction(
    config: ToyInductionConfig | None = None,
    *,
    progress: bool = False,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[int, LlamaForCausalLM], None] | None = None,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    """Train the toy induction model from scratch (deterministic under ``config.seed``; on
    ``TRAINING_THREADS`` CPU threads, so the same on every machine of one CPU type).

    Args:
        config: the recipe (default :class:`ToyInductionConfig`).
        progress: print the loss every 250 steps.
        checkpoint_every: call ``on_checkpoint(step, model)`` before training (step 0),
            after every ``checkpoint_every`` optimizer steps and after the last one, with
            the model in eval mode (0: never). Checkpoints do not change the training run.
        on_checkpoint: the callback, e.g. one that saves the model; it must not modify it.

    Returns:
        ``(model, tokenizer, metrics)``: the model in eval mode, its tokenizer, and
        ``steps``, ``seconds``, ``final_train_loss``, the evaluation probe's
        ``loss_first_half`` / ``loss_repeated_half``, the best layer-0 previous-token head
        and last-layer induction head with their scores, the full score grids, and the
        recipe.
    """
    config = config or ToyInductionConfig()
    if config.n_ctx < 1 + 2 * max(config.max_half_len, config.eval_half_len):
        raise ValueError("n_ctx is too small for max_half_len / eval_half_len")
    tokenizer = make_toy_tokenizer(config.vocab_size)
    model = _build_model(config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
    )
    g = torch.Generator().manual_seed(config.seed + 1)
    losses: list[float] = []
    save = (on_checkpoint, checkpoint_every, config.steps)
    start = time.perf_counter()
    with _threads(TRAINING_THREADS):
        _checkpoint(model, 0, *save)
        for step in range(config.steps):
            losses.append(_train_step(model, opt, params, config, step, g))
            _checkpoint(model, step + 1, *save)
            if progress and (step % 250 == 0 or step == config.steps - 1):
                elapsed = time.perf_counter() - start
                print(f"step {step:5d}  loss {losses[-1]:.3f}  {elapsed:.0f}s", flush=True)
    model.eval()
    metrics: dict[str, Any] = {
        "steps": config.steps,
        "seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        **_eval_metrics(model, config),
        "config": asdict(config),
    }
    return model, tokenizer, metrics
