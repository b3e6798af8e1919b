"""A toy attention-only induction model that trains on CPU in a few minutes.

The model is a Hugging Face :class:`~transformers.GPT2LMHeadModel` with two layers
whose MLPs are frozen at zero (so it is attention-only, and TransformerLens'
``TransformerBridge`` GPT-2 adapter wraps it unchanged). It is trained on the
classic induction task: a BOS token, ``n`` uniformly random tokens, then the same
``n`` tokens again, with ``n`` drawn afresh for every batch. Because the repeat
offset changes from batch to batch, no fixed positional shortcut predicts the
second half; the model must look up the earlier copy of the current token and
copy the token that followed it, which is the two-head induction circuit
(a previous-token head in layer 0 feeding an induction head in layer 1 by
K-composition).

Example:
    >>> model, tok, metrics = train_toy_induction()          # doctest: +SKIP
    >>> metrics["induction_score"] > 0.5                     # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

__all__ = [
    "ToyInductionConfig",
    "make_toy_tokenizer",
    "repeated_random_tokens",
    "train_toy_induction",
    "induction_mechanism_scores",
    "BOS_TOKEN",
    "PAD_TOKEN",
]

BOS_TOKEN = "<bos>"
PAD_TOKEN = "<pad>"


@dataclass
class ToyInductionConfig:
    """Recipe for :func:`train_toy_induction` (defaults reproduce the tested model)."""

    vocab_size: int = 500  # ordinary tokens "t0".."t{V-1}"; <bos> and <pad> come on top
    n_layers: int = 2  # layer 0: previous-token head, layer 1: induction head
    n_heads: int = 4  # heads per layer
    d_model: int = 64  # residual width (head dim = d_model // n_heads)
    n_ctx: int = 128  # learned absolute positions; must be >= 1 + 2 * max_half_len
    steps: int = 3000  # optimizer steps
    batch_size: int = 32  # sequences per step
    lr: float = 1e-3  # peak AdamW learning rate
    seed: int = 0  # seeds weights and data (nothing reads the global RNG state)
    warmup_steps: int = 100  # linear warmup, then cosine decay to lr / 10
    weight_decay: float = 0.01  # AdamW weight decay
    min_half_len: int = 8  # each batch repeats a random block of n tokens,
    max_half_len: int = 48  # with n uniform in [min_half_len, max_half_len]
    train_len: int = 128  # training sequence length
    periodic: bool = False  # fill the rest of the sequence with repeats of the block
    sinusoidal_init: bool = True  # start the learned positions from a sinusoidal table
    pos_init_scale: float = 0.02  # ... scaled to the token embeddings' init std
    aux_fraction: float = 0.0  # share of each batch that is a skip-bigram chain x[t+1] = perm(x[t-1])
    classic: bool = True
    random_offsets: bool = True
    init_std: float = 0.02
    eval_sequences: int = 64  # eval probe: sequences ...
    eval_half_len: int = 40  # ... of BOS + 40 random tokens + the same 40 again
    eval_seed: int = 12345  # the probe's own seed, distinct from training data


def make_toy_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Build the toy word-level tokenizer in code.

    Token ids ``0..vocab_size-1`` are the words ``"t0".."t{vocab_size-1}"``;
    ``<bos>`` is ``vocab_size`` and ``<pad>`` is ``vocab_size + 1``. Words are split
    on whitespace, and ``<bos>`` is not added automatically.

    Args:
        vocab_size: Number of ordinary tokens.

    Returns:
        A fast tokenizer with ``bos_token`` and ``pad_token`` set, which round-trips
        through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab[BOS_TOKEN] = vocab_size
    vocab[PAD_TOKEN] = vocab_size + 1
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        model_max_length=1_000_000,
    )


def repeated_random_tokens(
    n_sequences: int,
    half_len: int,
    vocab_size: int,
    *,
    generator: torch.Generator,
    bos_id: int | None,
) -> torch.Tensor:
    """Sample the standard induction probe: random tokens, then the same tokens again.

    Args:
        n_sequences: Number of sequences.
        half_len: Length ``n`` of the random block.
        vocab_size: Tokens are drawn uniformly from ``0..vocab_size-1``.
        generator: Source of randomness.
        bos_id: Token prepended to every sequence; ``None`` for no BOS.

    Returns:
        Long tensor ``[n_sequences, 1 + 2 * half_len]`` (``2 * half_len`` without
        BOS) where ``out[:, b + half_len + j] == out[:, b + j]`` with ``b`` the BOS
        offset (1 or 0).
    """
    block = torch.randint(0, vocab_size, (n_sequences, half_len), generator=generator)
    parts = [block, block]
    if bos_id is not None:
        parts.insert(0, torch.full((n_sequences, 1), bos_id, dtype=torch.long))
    return torch.cat(parts, dim=1)


def _build_model(config: ToyInductionConfig) -> GPT2LMHeadModel:
    """An attention-only GPT-2 (MLPs frozen at zero), initialised from ``config.seed``."""
    hf_config = GPT2Config(
        vocab_size=config.vocab_size + 2,
        n_positions=config.n_ctx,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=4,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=config.vocab_size,
        eos_token_id=config.vocab_size,
        pad_token_id=config.vocab_size + 1,
        attn_implementation="eager",
        initializer_range=config.init_std,
    )
    # Weight init uses the global RNG; fork it so the caller's state is untouched
    # and the weights depend only on the seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = GPT2LMHeadModel(hf_config)
    if config.sinusoidal_init:
        model.transformer.wpe.weight.data.copy_(_sinusoidal(config.n_ctx, config.d_model) * config.init_std)
    for block in model.transformer.h:
        for lin in (block.mlp.c_fc, block.mlp.c_proj):
            lin.weight.data.zero_()
            lin.bias.data.zero_()
            lin.weight.requires_grad_(False)
            lin.bias.requires_grad_(False)
        # ln_2 only feeds the zeroed MLP; freeze it so weight decay leaves it alone.
        block.ln_2.weight.requires_grad_(False)
        block.ln_2.bias.requires_grad_(False)
    return model


def _training_batch(config: ToyInductionConfig, gen: torch.Generator) -> torch.Tensor:
    """``[batch, n_ctx]``: BOS, random tokens, and a random block repeated at a random place."""
    B, L, V = config.batch_size, config.train_len, config.vocab_size
    ids = torch.randint(0, V, (B, L), generator=gen)
    ids[:, 0] = V
    for b in range(B):
        n = int(torch.randint(config.min_half_len, config.max_half_len + 1, (1,), generator=gen))
        if config.periodic:
            start = int(torch.randint(1, L - 2 * n + 1, (1,), generator=gen))
            reps = (L - start + n - 1) // n
            ids[b, start:] = ids[b, start : start + n].repeat(reps)[: L - start]
        else:
            start = int(torch.randint(1, L - 2 * n + 1, (1,), generator=gen))
            ids[b, start + n : start + 2 * n] = ids[b, start : start + n]
    n_aux = int(round(config.aux_fraction * B))
    if n_aux:
        perm = torch.randperm(V, generator=gen)
        for b in range(n_aux):
            for t in range(3, L):
                ids[b, t] = perm[ids[b, t - 2]]
    return ids


def _sinusoidal(n_ctx: int, d_model: int) -> torch.Tensor:
    """Unit-variance sinusoidal table ``[n_ctx, d_model]`` (starting point for learned positions)."""
    pos = torch.arange(n_ctx, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
    table = torch.zeros(n_ctx, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table * math.sqrt(2.0)


def _lr_at(step: int, config: ToyInductionConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def induction_mechanism_scores(
    model: GPT2LMHeadModel, input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Previous-token and induction attention scores of every head.

    ``input_ids`` must be repeated random tokens as made by
    :func:`repeated_random_tokens` with a BOS token (odd length ``1 + 2 * half_len``).

    Args:
        model: A GPT-2 style model that returns attentions with ``output_attentions=True``.
        input_ids: ``[batch, 1 + 2 * half_len]`` repeated random tokens.

    Returns:
        ``'previous_token'``: ``[n_layers, n_heads]`` mean attention from position
        ``i`` to ``i - 1`` over ``i >= 1``; ``'induction'``: ``[n_layers, n_heads]``
        mean attention from each position ``i`` of the repeated half to
        ``i - half_len + 1`` (the token after its earlier copy), averaged over the
        repeated half only.
    """
    seq_len = input_ids.shape[1]
    if seq_len % 2 != 1:
        raise ValueError("expected BOS + 2 * half_len tokens (odd length)")
    half_len = (seq_len - 1) // 2
    device = next(model.parameters()).device
    out = model(input_ids.to(device), output_attentions=True)
    attn = torch.stack([a.float().cpu() for a in out.attentions])  # [L, B, H, Q, K]
    i = torch.arange(1, seq_len)
    prev = attn[:, :, :, i, i - 1].mean(dim=(1, 3))
    q = torch.arange(1 + half_len, seq_len)
    ind = attn[:, :, :, q, q - half_len + 1].mean(dim=(1, 3))
    return {"previous_token": prev, "induction": ind}


@torch.no_grad()
def _eval_metrics(model: GPT2LMHeadModel, config: ToyInductionConfig) -> dict:
    gen = torch.Generator().manual_seed(config.eval_seed)
    ids = repeated_random_tokens(
        config.eval_sequences,
        config.eval_half_len,
        config.vocab_size,
        generator=gen,
        bos_id=config.vocab_size,
    )
    n = config.eval_half_len
    logits = model(ids).logits.float()
    # loss of predicting token t+1 from position t; targets ids[:, 1:]
    tok_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    first = tok_loss[:, 1:n].mean().item()  # predicting tokens 2..n (token 1 follows BOS only)
    repeated = (
        tok_loss[:, n + 1 :].mean().item()
    )  # predicting tokens n+2..2n (2nd-half, 2nd onwards)
    scores = induction_mechanism_scores(model, ids)
    prev0 = scores["previous_token"][0]
    ind1 = scores["induction"][config.n_layers - 1]
    return {
        "loss_first_half": first,
        "loss_repeated_half": repeated,
        "previous_token_score": prev0.max().item(),
        "previous_token_head": (0, int(prev0.argmax())),
        "induction_score": ind1.max().item(),
        "induction_head": (config.n_layers - 1, int(ind1.argmax())),
        "previous_token_scores": scores["previous_token"].tolist(),
        "induction_scores": scores["induction"].tolist(),
    }


def train_toy_induction(
    config: ToyInductionConfig = ToyInductionConfig(),
    *,
    progress: bool = False,
) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast, dict]:
    """Train the toy induction model from scratch.

    Args:
        config: The recipe; the seed fixes both weights and data.
        progress: Print the loss every few hundred steps.

    Returns:
        ``(model, tokenizer, metrics)``: the model in eval mode on CPU, its
        tokenizer, and a dict with ``steps``, ``seconds``, ``final_train_loss``
        (mean over the last 50 steps, all positions), ``loss_first_half`` and
        ``loss_repeated_half`` on a fresh probe, ``previous_token_score`` /
        ``previous_token_head`` (best layer-0 head) and ``induction_score`` /
        ``induction_head`` (best last-layer head), the full score grids, and the
        ``config`` as a dict.
    """
    if config.n_ctx < max(config.train_len, 1 + 2 * config.eval_half_len) or config.train_len < 2 * config.max_half_len + 1:
        raise ValueError("n_ctx too small for max_half_len / eval_half_len")
    tokenizer = make_toy_tokenizer(config.vocab_size)
    model = _build_model(config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
    )
    gen = torch.Generator().manual_seed(config.seed + 1)
    bos = config.vocab_size
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        if config.classic:
            n = int(torch.randint(config.min_half_len, config.max_half_len + 1, (1,), generator=gen))
            ids = repeated_random_tokens(config.batch_size, n, config.vocab_size, generator=gen, bos_id=bos)
        else:
            ids = _training_batch(config, gen)
        position_ids = None
        if config.random_offsets:
            off = torch.randint(0, config.n_ctx - ids.shape[1] + 1, (ids.shape[0], 1), generator=gen)
            position_ids = off + torch.arange(ids.shape[1])[None]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config)
        logits = model(ids, position_ids=position_ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if progress and (step % 250 == 0 or step == config.steps - 1):
            print(
                f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:.1f}s",
                flush=True,
            )
    seconds = time.perf_counter() - start
    model.eval()
    metrics: dict = {
        "steps": config.steps,
        "seconds": seconds,
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
    }
    metrics.update(_eval_metrics(model, config))
    metrics["config"] = asdict(config)
    return model, tokenizer, metrics
