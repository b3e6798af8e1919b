"""Layer-wise relevance propagation of attention heads (AttnLRP), in one backward pass.

The idea: LRP explains one output (here a logit) by redistributing its value backwards,
layer by layer, onto the neurons that produced it. For the rules AttnLRP uses, that
redistribution equals *input × modified gradient*: run the ordinary backward pass with
a few local gradients replaced, then multiply every activation by its gradient. A head's
relevance is then ``z · ∂̃logit/∂z`` summed over the head's output ``z`` (``hook_z``), the
quantity Voita et al. normalise per layer to rank heads. One forward and one backward
pass explain every position of a batch at once, because the modified backward is linear
in the relevance it starts from.

The modified gradients (Achtibat et al. 2024, as implemented in LXT's "efficient" mode),
installed by :func:`lrp_rules` with forward hooks that leave every forward value
bit-identical:

============================  ==============================================================
operation                     rule, as a gradient change
============================  ==============================================================
LayerNorm / RMSNorm           identity rule: the 1/std (1/rms) factor is a constant
element-wise activation       identity rule: gradient ``f(x)/x`` (GELU, SiLU, ...)
gated MLP ``act(g) * up``     uniform rule: gradient ÷2 on both factors
attention ``softmax(qkᵀ)v``   uniform rule on both bilinear products: ÷4 on ``q`` and ``k``,
                              ÷2 on ``v``; softmax keeps its gradient (× input it is the
                              AttnLRP softmax rule)
linear layers, embeddings     plain gradient (LRP-0 / ε-rule without ε)
dropout                       off (the model runs in eval mode)
============================  ==============================================================

What is conserved. Every rule above but the softmax's passes on exactly the relevance
it receives, except that an additive bias ``b`` keeps ``b · grad`` for itself. So the
explained logit splits exactly (to float rounding) into

    logit = R(embeddings) + R(biases) + R(softmax),

where R(embeddings) sums ``embedding output × gradient`` over every embedding the model
adds at its input (token, and for BERT/GPT-2 also position and token type), R(biases)
sums ``b · ∂̃logit/∂b`` over every bias parameter (linear layers, LayerNorm shifts, the
unembedding's bias), and R(softmax) is what the softmax rule absorbs: per query row,
``(Σ_j A_j g_j − Σ_j s_j A_j (g_j − Σ_k A_k g_k)) / 2`` with pattern ``A``, scores ``s``
and ``g = ∂̃/∂A``. The softmax rule is not conservative (it behaves like a bias,
Achtibat et al. 2024, Sec. 3.3.1), so "logit = R(embeddings)" holds only approximately,
and exactly only on models with no biases *and* no attention; :func:`lrp_relevance`
reports every term so the split can be checked.

For an encoder (BERT, ``minilm-l6``) the explained "logit" is the masked-language-model
head's logit of the top-1 token. ``minilm-l6`` ships without an MLM head, so
:func:`headmech.models.load_model` gives it a fixed one: identity dense layer, GELU,
LayerNorm without affine parameters, decoder tied to the word embeddings, zero bias. Its
top-1 logit at a position is the dot product of the normalised, GELU-rectified final
hidden state with the nearest word embedding: relevance explains which inputs make the
final state point at that word (usually the input token itself), not a trained
prediction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from headmech.engine import ProbeBatch
from headmech.errors import InputError, UnsupportedModelError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["lrp_head_relevance", "lrp_relevance", "lrp_rules"]

# Gradient factors of the uniform rule on softmax(q kᵀ) v (LXT, efficient mode).
_QKV_SCALE = {"q": 0.25, "k": 0.25, "v": 0.5}
# Embeddings whose outputs the model adds at its input (the bridge's names).
_EMBEDDINGS = ("embed", "pos_embed", "token_type_embed")


class _GradScale(torch.autograd.Function):
    """Identity forward; gradient multiplied by a constant."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class _SwapGrad(torch.autograd.Function):
    """Forward value of ``value``; gradient routed to ``surrogate`` instead.

    Lets a rule change a gradient without recomputing the forward value, so outputs stay
    bit-identical to the unmodified model.
    """

    @staticmethod
    def forward(ctx: Any, value: Tensor, surrogate: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, grad


class _Slope(torch.autograd.Function):
    """Forward value of ``value``; gradient to ``x`` is ``grad * slope`` (a constant)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, slope: Tensor) -> Tensor:
        ctx.save_for_backward(slope)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    if args and isinstance(args[0], Tensor):
        return args[0]
    x = kwargs.get("hidden_states", kwargs.get("input"))
    return x if isinstance(x, Tensor) else None


def _norm_surrogate(module: Any, x: Tensor) -> Tensor:
    """The norm's output with its 1/std (1/rms) factor detached: the identity rule."""
    orig = module.original_component
    if isinstance(orig, nn.Identity):
        return x
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    xc = xf if module.uses_rms_norm else xf - xf.mean(-1, keepdim=True)
    eps: Any = getattr(orig, "eps", None)
    if eps is None:
        eps = getattr(orig, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module.config, "eps", 1e-5)
    inv = torch.rsqrt(xc.detach().pow(2).mean(-1, keepdim=True) + eps)
    y = xc * inv
    weight = getattr(orig, "weight", None)
    if isinstance(weight, Tensor):
        y = y * ((1.0 + weight) if module.uses_weight_offset else weight)
    bias = getattr(orig, "bias", None)
    if isinstance(bias, Tensor):
        y = y + bias
    return y.to(x.dtype)


def _norm_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    x = _first_tensor(args, kwargs)
    if x is None or not isinstance(output, Tensor) or not torch.is_grad_enabled():
        return None
    return _SwapGrad.apply(output, _norm_surrogate(module, x))


def _activation_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
        return None
    if not torch.is_grad_enabled():
        return None
    x = args[0]
    with torch.no_grad():
        # f(x)/x; where x == 0 the relevance x * grad is 0 whatever the slope
        slope = output / torch.where(x == 0, torch.ones_like(x), x)
        slope = torch.where(x == 0, torch.zeros_like(slope), slope)
    return _Slope.apply(x, output, slope)


def _is_activation(module: nn.Module) -> bool:
    if isinstance(
        module, (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Mish, nn.ELU, nn.LeakyReLU, nn.Softplus)
    ):
        return True
    return type(module).__module__.startswith("transformers.activations")


def _modules(model: TransformerBridge) -> list[nn.Module]:
    """Bridge components and the wrapped Hugging Face modules, each once."""
    seen: dict[int, nn.Module] = {}
    roots: list[nn.Module] = [model]
    with contextlib.suppress(Exception):
        roots.append(model.original_model)
    for root in roots:
        for m in root.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


class _Rules:
    """The rule hooks on one model, with a record of which gradient rules fired."""

    def __init__(self, model: TransformerBridge) -> None:
        from transformer_lens.model_bridge.generalized_components.gated_mlp import (
            GatedMLPBridge,
        )
        from transformer_lens.model_bridge.generalized_components.normalization import (
            NormalizationBridge,
        )

        self.handles: list[RemovableHandle] = []
        self.required: dict[str, bool] = {}  # "blocks.3.attn.q" -> fired this forward
        for m in _modules(model):
            if isinstance(m, NormalizationBridge):
                self.handles.append(m.register_forward_hook(_norm_hook, with_kwargs=True))
            elif _is_activation(m):
                self.handles.append(m.register_forward_hook(_activation_hook))
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            for name, scale in _QKV_SCALE.items():
                self._scale(attn, name, scale, f"blocks.{layer}.attn.{name}")
            mlp = getattr(block, "mlp", None)
            if isinstance(mlp, GatedMLPBridge):
                for name in ("gate", "in"):
                    self._scale(mlp, name, 0.5, f"blocks.{layer}.mlp.{name}")

    def _scale(self, parent: nn.Module, name: str, scale: float, key: str) -> None:
        sub = parent._modules.get(name)
        if sub is None:
            raise UnsupportedModelError(f"LRP needs {key}, which this bridge does not expose")
        self.required[key] = False

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self.required[key] = True
            if not isinstance(output, Tensor) or not torch.is_grad_enabled():
                return None
            return _GradScale.apply(output, scale)

        self.handles.append(sub.register_forward_hook(hook))

    def reset(self) -> None:
        for key in self.required:
            self.required[key] = False

    def check(self) -> None:
        """Raise if a projection the rules scale was bypassed by the last forward."""
        missed = [k for k, fired in self.required.items() if not fired]
        if missed:
            raise UnsupportedModelError(
                f"LRP rules not applied: {', '.join(missed[:3])} never ran in the forward pass "
                "(this bridge computes them another way)"
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


@contextlib.contextmanager
def lrp_rules(model: TransformerBridge) -> Iterator[None]:
    """Within the block, the model's backward pass computes AttnLRP's modified gradient.

    Forward values are unchanged (bit-identical); only gradients differ. The model is put
    in eval mode (dropout off) and everything is restored on exit, also on error.

    Args:
        model: a ``TransformerBridge``.

    References:
        Achtibat et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
        for Transformers", ICML 2024.

    Examples:
        >>> with lrp_rules(model):  # doctest: +SKIP
        ...     logits = model(tokens)
        ...     logits[0, -1].max().backward()  # .grad × input is now LRP relevance
    """
    with _rules(model):
        yield


@contextlib.contextmanager
def _rules(model: TransformerBridge) -> Iterator[_Rules]:
    was_training = model.training
    rules: _Rules | None = None
    try:
        model.eval()
        rules = _Rules(model)
        yield rules
    finally:
        if rules is not None:
            rules.remove()
        model.train(was_training)


@dataclass
class _Taps:
    """Activations captured during one forward pass, to take gradients against."""

    embeddings: dict[str, Tensor] = field(default_factory=dict)
    z: dict[int, Tensor] = field(default_factory=dict)  # [batch, pos, n_heads * d_head]
    attn_out: dict[int, Tensor] = field(default_factory=dict)  # o projection's output
    pattern: dict[int, Tensor] = field(default_factory=dict)  # [batch, head, q_pos, k_pos]


@contextlib.contextmanager
def _tapped(model: TransformerBridge, taps: _Taps, *, patterns: bool) -> Iterator[None]:
    handles: list[RemovableHandle] = []

    def keep(store: dict, key: Any, *, leaf: bool) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not isinstance(output, Tensor):
                return None
            if leaf and not output.requires_grad:  # frozen embeddings: start the graph here
                output = output.detach().requires_grad_(True)
                store[key] = output
                return output
            store[key] = output
            return None

        return hook

    def keep_io(layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
                taps.z[layer], taps.attn_out[layer] = args[0], output

        return hook

    try:
        for name in _EMBEDDINGS:
            mod = getattr(model, name, None)
            if isinstance(mod, nn.Module):
                handles.append(mod.register_forward_hook(keep(taps.embeddings, name, leaf=True)))
        for layer, block in enumerate(model.blocks):
            handles.append(block.attn.o.register_forward_hook(keep_io(layer)))
            if patterns:
                hp = block.attn.hook_pattern
                handles.append(hp.register_forward_hook(keep(taps.pattern, layer, leaf=False)))
        yield
    finally:
        for h in handles:
            h.remove()


def _head_relevance(
    z: Tensor, grad: Tensor | None, n_heads: int
) -> Float[Tensor, "batch pos n_heads"]:
    if grad is None:
        return torch.zeros(*z.shape[:2], n_heads, dtype=torch.float64, device=z.device)
    zg = z.detach().double() * grad.double()  # [batch, pos, n_heads * d_head]
    return zg.view(*zg.shape[:2], n_heads, -1).sum(-1)


def _softmax_absorbed(pattern: Tensor, grad: Tensor | None) -> float:
    """Relevance the AttnLRP softmax rule does not pass on, summed over rows and heads.

    With ``s_j = log A_j + c`` per row (the row constant cancels because
    ``Σ_j A_j (g_j - ḡ) = 0``), relevance in is ``Σ_j A_j g_j`` and relevance out is
    ``Σ_j s_j A_j (g_j - ḡ)``; the uniform rule gives the pattern half of the product's
    relevance, hence the 1/2.
    """
    if grad is None:
        return 0.0
    a, g = pattern.detach().double(), grad.double()
    ag = a * g
    g_bar = ag.sum(-1, keepdim=True)
    log_a = torch.where(a > 0, a.clamp_min(1e-300).log(), torch.zeros_like(a))
    r_out = (a * log_a * (g - g_bar)).sum()
    return float((ag.sum() - r_out) / 2)


def _explained(
    logits: Float[Tensor, "batch pos d_vocab"],
    select: Bool[Tensor, "batch pos"],
    target: Int[Tensor, "batch pos"] | None,
) -> tuple[Float[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """The selected logits (top-1 unless ``target`` is given), zero where not selected."""
    if target is None:
        target = logits.detach().argmax(-1)
    picked = logits.gather(-1, target[..., None])[..., 0]
    return picked * select.to(picked.dtype), target


def _bias_parameters(model: TransformerBridge) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for name, p in model.named_parameters():
        if name.split(".")[-1] == "bias" or name.endswith("_bias"):
            seen.setdefault(id(p), p)
    return list(seen.values())


def _device(model: TransformerBridge) -> torch.device:
    return next(model.parameters()).device


def lrp_relevance(
    model: TransformerBridge,
    input_ids: Int[Tensor, " pos"] | Int[Tensor, "1 pos"],
    attention_mask: Int[Tensor, " pos"] | Int[Tensor, "1 pos"] | None = None,
    *,
    position: int = -1,
    target: int | None = None,
) -> dict[str, Any]:
    """AttnLRP relevance of one logit for the input embeddings and every head.

    One forward and one modified backward pass (see the module docstring for the rules).

    Args:
        model: a ``TransformerBridge``.
        input_ids: one token sequence.
        attention_mask: 1 for real tokens (default: all real).
        position: the position whose logit is explained; negative values count back from
            the last real token.
        target: the vocabulary id whose logit is explained (default: the top-1 logit).

    Returns:
        A dict with
        ``logit`` (the explained logit value), ``target`` and ``position`` (ints);
        ``embedding``: ``Float[pos, d_model]`` relevance of the token embeddings and
        ``tokens``: the same summed to ``Float[pos]``;
        ``other_embeddings``: ``{name: Float[pos]}`` for position / token-type embeddings;
        ``heads``: ``Float[n_layers, n_heads]`` per-head relevance (``hook_z`` × gradient
        summed over positions and ``d_head``; not normalised);
        ``attn_out``: ``Float[n_layers]`` relevance at each attention output projection's
        output (bias included), and ``attn_bias``: ``Float[n_layers]`` the part its bias
        keeps;
        ``input``: relevance summed over every input embedding; ``bias``: relevance
        absorbed by all bias parameters; ``softmax``: ``Float[n_layers]`` relevance absorbed
        by the softmax rule; ``conservation_error``: ``logit - input`` and ``residual``:
        ``logit - input - bias - softmax.sum()`` (zero up to rounding).

    Raises:
        InputError: more than one sequence, or ``position`` outside the real tokens.

    References:
        Achtibat et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
        for Transformers", ICML 2024.
        Arras et al. 2025, input × modified gradient as LRP ("efficient" AttnLRP).
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention", ACL 2019.

    Examples:
        >>> out = lrp_relevance(model, model.to_tokens("The cat sat")[0])  # doctest: +SKIP
        >>> out["heads"].shape  # doctest: +SKIP
        torch.Size([30, 9])
    """
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if ids.shape[0] != 1:
        raise InputError(f"lrp_relevance explains one sequence, got {ids.shape[0]}")
    device = _device(model)
    ids = ids.to(device)
    mask = (
        torch.ones_like(ids)
        if attention_mask is None
        else (attention_mask if attention_mask.dim() == 2 else attention_mask[None]).to(device)
    )
    n_real = int(mask.sum())
    pos = n_real + position if position < 0 else position
    if not 0 <= pos < ids.shape[1] or not bool(mask[0, pos]):
        raise InputError(f"position {position} is not a real token of a {n_real}-token input")
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[0, pos] = True
    tgt = None if target is None else torch.full_like(ids, int(target))

    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    biases = _bias_parameters(model)
    frozen = [p for p in biases if not p.requires_grad]
    taps = _Taps()
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.enable_grad(), _rules(model) as rules, _tapped(model, taps, patterns=True):
            logits = model(ids, attention_mask=mask, return_type="logits")
            rules.check()
            picked, tgt = _explained(logits, select, tgt)
            objective = picked.sum()
            names = list(taps.embeddings)
            layers = sorted(taps.z)
            inputs = [
                *(taps.embeddings[n] for n in names),
                *(taps.z[i] for i in layers),
                *(taps.attn_out[i] for i in layers),
                *(taps.pattern[i] for i in layers if i in taps.pattern),
                *biases,
            ]
            grads = torch.autograd.grad(objective, inputs, allow_unused=True)
    finally:
        for p in frozen:
            p.requires_grad_(False)

    it = iter(grads)
    emb_rel = {}
    for n in names:
        g = next(it)
        e = taps.embeddings[n]
        r = e.detach().double() * g.double() if g is not None else torch.zeros_like(e).double()
        emb_rel[n] = r.expand(ids.shape[0], *r.shape[-2:])[0]  # [pos, d_model]
    heads = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    attn_out = torch.zeros(n_layers, dtype=torch.float64)
    attn_bias = torch.zeros(n_layers, dtype=torch.float64)
    softmax = torch.zeros(n_layers, dtype=torch.float64)
    for i in layers:
        heads[i] = _head_relevance(taps.z[i], next(it), n_heads).sum((0, 1)).cpu()
    for i in layers:
        g = next(it)
        if g is not None:
            attn_out[i] = float((taps.attn_out[i].detach().double() * g.double()).sum())
            b = getattr(model.blocks[i].attn.o, "bias", None)
            if isinstance(b, Tensor):
                attn_bias[i] = float((b.detach().double() * g.double()).sum())
    for i in layers:
        if i in taps.pattern:
            softmax[i] = _softmax_absorbed(taps.pattern[i], next(it))
    bias_total = 0.0
    for p in biases:
        g = next(it)
        if g is not None:
            bias_total += float((p.detach().double() * g.double()).sum())

    logit = float(picked.detach().double().sum())
    token_rel = emb_rel.pop("embed")
    input_total = float(token_rel.sum()) + sum(float(r.sum()) for r in emb_rel.values())
    return {
        "logit": logit,
        "target": int(tgt[0, pos]),
        "position": pos,
        "embedding": token_rel.float().cpu(),
        "tokens": token_rel.sum(-1).float().cpu(),
        "other_embeddings": {n: r.sum(-1).float().cpu() for n, r in emb_rel.items()},
        "heads": heads.float(),
        "attn_out": attn_out.float(),
        "attn_bias": attn_bias.float(),
        "input": input_total,
        "bias": bias_total,
        "softmax": softmax.float(),
        "conservation_error": logit - input_total,
        "residual": logit - input_total - bias_total - float(softmax.sum()),
    }


def lrp_head_relevance(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    *,
    normalise: bool = True,
    per_prediction: bool = False,
    progress: bool = False,
) -> Float[Tensor, "n_layers n_heads"]:
    """AttnLRP head relevance (Voita et al. 2019) averaged over probe data.

    Every real, non-special position of every sequence is a prediction to explain; its
    top-1 logit is the relevance that starts the backward pass. A head's relevance for a
    prediction is ``hook_z × modified gradient`` summed over its positions and ``d_head``.

    Normalisation (``normalise=True``): within each layer, a head's relevance is divided
    by the sum of the absolute relevances of that layer's heads, so the absolute values
    in a layer sum to 1 and a head's sign is kept (a head that lowers the logit stays
    negative). By default one backward pass explains all predictions of a batch at once
    (LRP is linear in the starting relevance, so this gives the *sum* over a sequence's
    predictions exactly); the per-layer normalisation is then applied per sequence, and
    the result averaged over sequences. ``per_prediction=True`` normalises each prediction
    before averaging, as Voita et al. do, at the cost of one backward pass per position.

    Without normalisation the result is the mean relevance per explained prediction, in
    logit units.

    Args:
        model: a ``TransformerBridge``.
        batches: right-padded probe batches (:class:`~headmech.engine.ProbeBatch`).
        normalise: normalise within each layer (see above).
        per_prediction: normalise each prediction separately (one backward per position).
        progress: show a progress bar.

    Returns:
        Per-head relevance, ``[n_layers, n_heads]`` (query heads under grouped-query
        attention).

    Raises:
        InputError: the batches contain no position to explain.

    References:
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
        Heavy Lifting, the Rest Can Be Pruned", ACL 2019.
        Achtibat et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
        for Transformers", ICML 2024.
        Arras et al. 2025, input × modified gradient as LRP ("efficient" AttnLRP).

    Examples:
        >>> probe = build_probe("repeated_random", model, ProbeOptions(n_sequences=8))  # doctest: +SKIP
        >>> rel = lrp_head_relevance(model, probe.batches)  # doctest: +SKIP
        >>> rel.abs().sum(-1)  # doctest: +SKIP
        tensor([1., 1., ...])
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    device = _device(model)
    total = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    count = 0
    iterator: Iterable[ProbeBatch] = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc="LRP", leave=False)

    def normalised(r: Tensor) -> Tensor:  # [..., n_layers, n_heads]
        return r / r.abs().sum(-1, keepdim=True).clamp_min(1e-30)

    with torch.enable_grad(), _rules(model) as rules:
        for batch in iterator:
            batch = batch.to(device)
            select = batch.attention_mask.bool() & ~batch.special
            if not bool(select.any()):
                continue
            taps = _Taps()
            with _tapped(model, taps, patterns=False):
                rules.reset()
                logits = model(batch.input_ids, attention_mask=batch.attention_mask)
                rules.check()
            picked, _ = _explained(logits, select, None)
            layers = sorted(taps.z)
            zs = [taps.z[i] for i in layers]
            if per_prediction:
                for t in range(select.shape[1]):
                    rows = select[:, t]
                    if not bool(rows.any()):
                        continue
                    grads = torch.autograd.grad(
                        picked[:, t].sum(), zs, retain_graph=True, allow_unused=True
                    )
                    rel = torch.stack(
                        [
                            _head_relevance(z, g, n_heads).sum(1)
                            for z, g in zip(zs, grads, strict=True)
                        ],
                        1,
                    )  # [batch, n_layers, n_heads]
                    rel = rel[rows.to(rel.device)].cpu()
                    total += (normalised(rel) if normalise else rel).sum(0)
                    count += int(rows.sum())
                continue
            grads = torch.autograd.grad(picked.sum(), zs, allow_unused=True)
            rel = torch.stack(
                [_head_relevance(z, g, n_heads).sum(1) for z, g in zip(zs, grads, strict=True)], 1
            ).cpu()  # [batch, n_layers, n_heads], summed over each sequence's predictions
            has = select.any(1).cpu()
            if normalise:
                total += normalised(rel[has]).sum(0)
                count += int(has.sum())
            else:
                total += rel.sum(0)
                count += int(select.sum())
    if count == 0:
        raise InputError("no position to explain: every token is special or padding")
    return (total / count).float()
