"""AttnLRP's rules as a table, and the installer that puts them on a model.

LRP with the AttnLRP rules is *input × modified gradient* (see
:mod:`headmech.attribution.lrp`): each rule changes one local gradient of the backward
pass and leaves every forward value bit-identical. :data:`RULES` lists them, one row per
layer kind, in the order of Achtibat et al. 2024 (and LXT's "efficient" mode):

============================  ====================================  ===========================
layer kind                    rule, as a gradient change            function
============================  ====================================  ===========================
LayerNorm / RMSNorm           identity rule: the 1/std (1/rms)      :func:`norm_identity_rule`
                              factor is a constant
element-wise activation       identity rule: gradient ``f(x)/x``    :func:`activation_identity_rule`
                              (GELU, SiLU, ...)
gated MLP ``act(g) * up``     uniform rule: gradient ÷2 on both     :func:`gated_mlp_uniform_rule`
                              factors (``gate`` and ``in``)
attention ``softmax(qkᵀ)v``   uniform rule on both bilinear         :func:`attention_uniform_rule`
                              products: ÷4 on ``q`` and ``k``,
                              ÷2 on ``v``
softmax                       keeps its gradient (× input it is     :func:`keep_gradient`
                              the AttnLRP softmax rule)
linear layers, embeddings     plain gradient (LRP-0 / ε-rule        :func:`keep_gradient`
                              without ε)
============================  ====================================  ===========================

Dropout is off: the installer puts the model in eval mode. The attention softmax is
computed inside the attention bridge, so the softmax row matches only stand-alone
``nn.Softmax`` modules; either way its gradient is left alone.

:class:`RuleHooks` walks every module of the bridge and of the wrapped Hugging Face model
(each once), gives it the rule of the first row whose predicate matches, and records the
projections whose gradient a uniform rule scales, so that a forward pass that bypasses one
of them is an error rather than a silently wrong relevance. :func:`lrp_rules` is the
public context manager. The gradient surgery itself (autograd functions and the forward
hooks that apply them) is in :mod:`headmech.attribution.lrp_grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from headmech.attribution.lrp_grad import (
    GradScale,
    activation_identity_forward,
    norm_identity_forward,
)
from headmech.core.errors import UnsupportedModelError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "GATE_SCALE",
    "QKV_SCALE",
    "RULES",
    "LayerRule",
    "RuleHooks",
    "activation_identity_rule",
    "attention_uniform_rule",
    "gated_mlp_uniform_rule",
    "installed_rules",
    "keep_gradient",
    "lrp_rules",
    "norm_identity_rule",
    "unsupported_layers",
]

# Gradient factors of the uniform rule on softmax(q kᵀ) v (LXT, efficient mode).
QKV_SCALE = {"q": 0.25, "k": 0.25, "v": 0.5}
# Gradient factors of the uniform rule on act(gate) * in.
GATE_SCALE = {"gate": 0.5, "in": 0.5}
_ACTIVATIONS = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Mish, nn.ELU, nn.LeakyReLU, nn.Softplus)

# A rule installs itself on one module: rule(hooks, module, label).
Rule = Callable[["RuleHooks", nn.Module, str], None]


def norm_identity_rule(hooks: RuleHooks, module: nn.Module, label: str) -> None:
    """LayerNorm / RMSNorm, identity rule: the 1/std (1/rms) factor is a constant."""
    hooks.add(module.register_forward_hook(norm_identity_forward, with_kwargs=True))


def activation_identity_rule(hooks: RuleHooks, module: nn.Module, label: str) -> None:
    """Element-wise activation ``f``, identity rule: gradient ``f(x)/x``."""
    hooks.add(module.register_forward_hook(activation_identity_forward))


def gated_mlp_uniform_rule(hooks: RuleHooks, module: nn.Module, label: str) -> None:
    """Gated MLP ``act(gate) * in``, uniform rule: gradient ÷2 on both factors."""
    for name, factor in GATE_SCALE.items():
        hooks.scale(module, name, factor, f"{label}.{name}")


def attention_uniform_rule(hooks: RuleHooks, module: nn.Module, label: str) -> None:
    """Attention ``softmax(q kᵀ) v``, uniform rule on both bilinear products.

    ``A v`` gives ÷2 to ``v`` and to the pattern ``A``; ``q kᵀ`` gives ÷2 to ``q`` and to
    ``k``. The pattern's gradient reaches the input only through ``q`` and ``k``, so its
    ÷2 is applied there too: ``q`` and ``k`` get ÷4, ``v`` gets ÷2 (the factors are
    :attr:`RuleHooks.qkv_scale`). The softmax in between keeps its gradient.
    """
    for name, factor in hooks.qkv_scale.items():
        hooks.scale(module, name, factor, f"{label}.{name}")


def keep_gradient(hooks: RuleHooks, module: nn.Module, label: str) -> None:
    """Softmax and linear layers keep their plain gradient: nothing to install."""


def _is_norm(module: nn.Module) -> bool:
    from transformer_lens.model_bridge.generalized_components.normalization import (
        NormalizationBridge,
    )

    return isinstance(module, NormalizationBridge)


def _is_activation(module: nn.Module) -> bool:
    if isinstance(module, _ACTIVATIONS):
        return True
    return type(module).__module__.startswith("transformers.activations")


def _is_gated_mlp(module: nn.Module) -> bool:
    from transformer_lens.model_bridge.generalized_components.gated_mlp import GatedMLPBridge

    return isinstance(module, GatedMLPBridge)


def _is_attention(module: nn.Module) -> bool:
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    return isinstance(module, AttentionBridge)


def _is_softmax(module: nn.Module) -> bool:
    return isinstance(module, nn.Softmax)


def _is_linear(module: nn.Module) -> bool:
    from transformer_lens.model_bridge.generalized_components.embedding import EmbeddingBridge
    from transformer_lens.model_bridge.generalized_components.linear import LinearBridge
    from transformer_lens.model_bridge.generalized_components.unembedding import (
        UnembeddingBridge,
    )

    bridges = (LinearBridge, EmbeddingBridge, UnembeddingBridge)
    return isinstance(module, (nn.Linear, nn.Embedding, *bridges))


@dataclass(frozen=True)
class LayerRule:
    """One row of :data:`RULES`: a layer kind and the rule AttnLRP gives it.

    Attributes:
        kind: the layer kind, as the AttnLRP paper names it.
        matches: whether a module is of this kind.
        rule: installs the rule on a matching module, ``rule(hooks, module, label)``.
    """

    kind: str
    matches: Callable[[nn.Module], bool]
    rule: Rule


RULES: tuple[LayerRule, ...] = (
    LayerRule("LayerNorm / RMSNorm", _is_norm, norm_identity_rule),
    LayerRule("element-wise activation", _is_activation, activation_identity_rule),
    LayerRule("gated MLP act(gate) * in", _is_gated_mlp, gated_mlp_uniform_rule),
    LayerRule("attention softmax(q kᵀ) v", _is_attention, attention_uniform_rule),
    LayerRule("softmax", _is_softmax, keep_gradient),
    LayerRule("linear layer, embedding", _is_linear, keep_gradient),
)
"""The AttnLRP rules, one row per layer kind; a module gets the first row that matches."""


class RuleHooks:
    """The rule hooks on one model, with a record of which gradient rules fired.

    Attributes:
        qkv_scale: gradient factors of the attention uniform rule, by projection name.
        handles: the installed forward hooks.
        required: ``{"blocks.3.attn.q": fired}`` for every projection a uniform rule
            scales; ``fired`` says whether it ran in the last forward pass.
    """

    def __init__(self, qkv_scale: Mapping[str, float] | None = None) -> None:
        self.qkv_scale: Mapping[str, float] = QKV_SCALE if qkv_scale is None else qkv_scale
        self.handles: list[RemovableHandle] = []
        self.required: dict[str, bool] = {}

    def install(self, model: TransformerBridge) -> None:
        """Walk the model's modules and give each the rule of its row in :data:`RULES`.

        Raises:
            UnsupportedModelError: a block's attention gets no attention rule, or a
                projection a rule scales is missing.
        """
        missing = unsupported_layers(model)
        if missing:
            raise UnsupportedModelError(f"LRP has no rule for {', '.join(missing)}")
        labels = _block_labels(model)
        applied: dict[int, Rule] = {}
        for name, module in _named_modules(model):
            row = _row(module)
            if row is not None:
                row.rule(self, module, labels.get(id(module), name))
                applied[id(module)] = row.rule
        for layer, block in enumerate(model.blocks):
            attn = getattr(block, "attn", None)
            if attn is None or applied.get(id(attn)) is not attention_uniform_rule:
                raise UnsupportedModelError(
                    f"LRP has no attention rule for blocks.{layer}.attn "
                    f"({type(attn).__name__} is not an attention bridge)"
                )

    def add(self, handle: RemovableHandle) -> None:
        """Keep a hook handle, to remove it with the others."""
        self.handles.append(handle)

    def scale(self, parent: nn.Module, name: str, factor: float, key: str) -> None:
        """Multiply the gradient at ``parent.<name>``'s output by ``factor``.

        Raises:
            UnsupportedModelError: ``parent`` has no submodule ``name``.
        """
        sub = parent._modules.get(name)
        if sub is None:
            raise UnsupportedModelError(f"LRP needs {key}, which this bridge does not expose")
        self.required[key] = False

        def scale_gradient(module: nn.Module, args: tuple, output: Any) -> Any:
            self.required[key] = True
            if not isinstance(output, Tensor) or not torch.is_grad_enabled():
                return None
            return GradScale.apply(output, factor)

        self.add(sub.register_forward_hook(scale_gradient))

    def reset(self) -> None:
        """Mark every scaled projection as not yet run."""
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
        """Remove every installed hook."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def unsupported_layers(model: TransformerBridge) -> list[str]:
    """The layers of ``model`` that no row of :data:`RULES` covers and that break the
    conservation law (each as a short description; empty when every layer has a rule):
    soft-capping (``tanh`` of attention scores or logits, Gemma 2), attention sink logits
    (gpt-oss: a per-head logit in every softmax), mixtures of experts (router weights
    times expert outputs, gpt-oss)."""
    cfg = model.cfg
    out = []
    if float(getattr(cfg, "attn_scores_soft_cap", -1.0) or -1.0) > 0:
        out.append("attention soft-capping (tanh of the scores)")
    if float(getattr(cfg, "output_logits_soft_cap", -1.0) or -1.0) > 0:
        out.append("final logit soft-capping (tanh of the logits)")
    original = getattr(model, "original_model", model)
    modules = list(original.modules())
    if any(isinstance(getattr(m, "sinks", None), Tensor) for m in modules):
        out.append("attention sink logits")
    if any(getattr(m, "experts", None) is not None and hasattr(m, "router") for m in modules):
        out.append("a mixture-of-experts MLP (router weights times expert outputs)")
    return out


def _row(module: nn.Module) -> LayerRule | None:
    return next((row for row in RULES if row.matches(module)), None)


def _named_modules(model: TransformerBridge) -> list[tuple[str, nn.Module]]:
    """Bridge components and the wrapped Hugging Face modules, each once, with a name."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    roots: list[tuple[str, nn.Module]] = [("", model)]
    original = getattr(model, "original_model", None)
    if isinstance(original, nn.Module):
        roots.append(("original_model", original))
    for prefix, root in roots:
        for name, m in root.named_modules(prefix=prefix):
            seen.setdefault(id(m), (name, m))
    return list(seen.values())


def _block_labels(model: TransformerBridge) -> dict[int, str]:
    """``blocks.<layer>.attn`` and ``blocks.<layer>.mlp``, by module id."""
    labels: dict[int, str] = {}
    for layer, block in enumerate(model.blocks):
        for name in ("attn", "mlp"):
            sub = getattr(block, name, None)
            if isinstance(sub, nn.Module):
                labels[id(sub)] = f"blocks.{layer}.{name}"
    return labels


@contextlib.contextmanager
def installed_rules(
    model: TransformerBridge, qkv_scale: Mapping[str, float] | None = None
) -> Iterator[RuleHooks]:
    """The rules of :data:`RULES` on ``model`` within the block, in eval mode.

    Args:
        model: a ``TransformerBridge``.
        qkv_scale: gradient factors of the attention rule (default: ÷4, ÷4, ÷2).

    Yields:
        The installed :class:`RuleHooks`; every hook is removed and the training mode
        restored on exit, also on error.
    """
    was_training = model.training
    hooks = RuleHooks(qkv_scale)
    try:
        model.eval()
        hooks.install(model)
        yield hooks
    finally:
        hooks.remove()
        model.train(was_training)


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
    with installed_rules(model):
        yield
