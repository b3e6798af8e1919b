"""Tiny random models of every architecture family headmech is checked on.

Each family is a Hugging Face config class with tiny sizes (2 layers, 4 query heads,
fewer KV heads where the family has grouped-query attention, ``d_model`` 64) and the
feature that makes the family different switched on, strongly enough to bite on short
probes: a sliding window of :data:`WINDOW` tokens (Mistral, Gemma 2, Gemma 3, gpt-oss),
attention and final-logit soft-capping at 2 and 3 (Gemma 2; the real models' 50 and 30
would never act on tiny random scores), q/k norms (Qwen3, Gemma 3, OLMo 2), a norm after
attention (Gemma 2/3, OLMo 2), per-head sink logits and a mixture of experts (gpt-oss).
Weights are drawn with a standard deviation of :data:`INIT` (transformers' 0.02 gives
nearly uniform attention and heads whose removal hardly shows).

:mod:`headmech.models.tiny` builds them (the one builder of tiny random models, for the
library, the tests and the benchmarks). Nothing is downloaded. ``tests/test_families.py`` runs every analysis on each family (the
conformance matrix): each :class:`Family` says which checks it is expected to refuse and which
feature the refusal must name (:attr:`Family.refuses`), the test holds every other check to
working, and :func:`write_matrix_page` writes what it measured into ``docs/families.md``,
whose table the test compares cell by cell (regenerate it with :data:`REGENERATE`).

Examples:
    >>> from headmech.models.tiny import build_tiny  # doctest: +SKIP
    >>> path = build_tiny("gemma2", tmp / "gemma2")  # doctest: +SKIP
    >>> headmech.load_model(path).cfg.n_heads  # doctest: +SKIP
    4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headmech.core.errors import UnsupportedModelError

__all__ = [
    "CHECKS",
    "FAMILIES",
    "INIT",
    "NOT_RUN",
    "PARTS",
    "REGENERATE",
    "VOCAB_SIZE",
    "WINDOW",
    "Family",
    "family_spec",
    "matrix_table",
    "read_matrix_table",
    "unsupported",
    "write_matrix_page",
]

VOCAB_SIZE = 512  # the tokenizer's whole vocabulary (bytes, merges, special tokens)
WINDOW = 6  # sliding-window width in tokens: shorter than every probe, so it bites
N_CTX = 512  # positions: the longest prose sentence of the default corpus fits
INIT = 0.15  # weight init scale: peaked attention and heads whose removal shows (HF: 0.02)

# the conformance matrix's columns, in the order of docs/families.md
CHECKS = (
    "load", "classify", "statistics = eager", "exact importance", "attribution patching",
    "LRP", "path patching", "pruning", "kv-plan", "discover", "provenance",
)  # fmt: skip
# checks reported inside another check's cell, which a family may refuse on their own
PARTS = {"uniform ablation": "exact importance", "DLA": "attribution patching"}
# rewrites docs/families.md from what tests/test_families.py measures
REGENERATE = (
    "HEADMECH_FAMILIES_DOC=docs/families.md OMP_NUM_THREADS=1 "
    "python -m pytest -n 0 tests/test_families.py"
)


# the config fields of the sizes tiny_hf takes (GPT-2 names its own; no grouped-query
# attention in GPT-2, GPT-NeoX and BERT)
_SIZES: dict[str, str] = {
    "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "d_mlp": "intermediate_size", "n_ctx": "max_position_embeddings",
}  # fmt: skip
_MHA_SIZES = {k: v for k, v in _SIZES.items() if k != "n_kv_heads"}
_GPT2_SIZES = {"d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
               "d_mlp": "n_inner", "n_ctx": "n_positions"}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture family: how to build its tiny model.

    Attributes:
        name: the family's short name (the test ids, ``docs/families.md``).
        config: the name of its ``transformers`` config class (looked up when used, so
            an older transformers without it refuses the family in one line).
        architecture: the Hugging Face architecture the saved folder declares (what
            TransformerLens' bridge selects its adapter by).
        kwargs: the config's tiny sizes and switched-on features.
        causal: a decoder (False: an encoder with a masked-LM head).
        feature: what is special about the family's attention, in a few words.
        refuses: the checks (:data:`CHECKS` or :data:`PARTS`) the family is expected to
            refuse, each with the phrases its one-line refusal must contain (the feature
            headmech does not support there); every other check must work.
        sizes: the config fields the sizes of :func:`tiny_hf` set (``d_model``,
            ``n_layers``, ``n_heads``, ``n_kv_heads``, ``d_mlp``, ``n_ctx``).
    """

    name: str
    config: str
    architecture: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    causal: bool = True
    feature: str = ""
    refuses: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: dict[str, str] = field(default_factory=lambda: dict(_SIZES))


_ROPE = {"max_position_embeddings": N_CTX}
_GQA = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
_SWA = ["sliding_attention", "full_attention"]  # layer 0 windowed, layer 1 full
_POST_NORM = {"DLA": ("a norm follows each attention block",)}  # Gemma 2/3, OLMo 2

# fmt: off
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel",
           {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": N_CTX},
           feature="learned positions, LayerNorm, fused QKV", sizes=_GPT2_SIZES),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
            "intermediate_size": 128, **_ROPE},
           feature="Pythia: parallel attention and MLP, partial rotary", sizes=_MHA_SIZES),
    Family("llama", "LlamaConfig", "LlamaForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "intermediate_size": 128, **_ROPE},
           feature="rotary, RMSNorm, grouped-query attention"),
    Family("mistral", "MistralConfig", "MistralForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "intermediate_size": 128, "sliding_window": WINDOW,
            **_ROPE},
           feature=f"sliding window of {WINDOW} tokens in every layer"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "intermediate_size": 128, **_ROPE},
           feature="q/k/v biases"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "head_dim": 16, "intermediate_size": 128, **_ROPE},
           feature="per-head q/k RMSNorm"),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "head_dim": 16, "intermediate_size": 128,
            "sliding_window": WINDOW, "layer_types": _SWA, "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16, **_ROPE},
           feature="attention and final-logit soft-capping, alternating sliding window, sandwich norms",
           refuses={**_POST_NORM,
                    "LRP": ("attention soft-capping", "final logit soft-capping")}),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "head_dim": 16, "intermediate_size": 128,
            "sliding_window": WINDOW, "layer_types": _SWA, "query_pre_attn_scalar": 16,
            **_ROPE},
           feature="q/k norms, alternating sliding window, local rotary base",
           refuses={**_POST_NORM}),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "intermediate_size": 128,
            "original_max_position_embeddings": N_CTX, **_ROPE},
           feature="fused qkv_proj and gate_up_proj"),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "intermediate_size": 128, **_ROPE},
           feature="norms after attention and MLP (no input norm), q/k norms",
           refuses={**_POST_NORM}),
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
           {"num_hidden_layers": 2, **_GQA, "head_dim": 16, "intermediate_size": 64,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
            "layer_types": _SWA, **_ROPE,
            "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                "original_max_position_embeddings": N_CTX // 32}},
           feature="per-head sink logits, alternating sliding window, mixture of experts",
           refuses={"LRP": ("attention sink logits", "mixture-of-experts MLP")}),
    Family("bert", "BertConfig", "BertForMaskedLM",
           {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
            "intermediate_size": 128, "max_position_embeddings": N_CTX},
           causal=False, feature="bidirectional encoder, post-norm", sizes=_MHA_SIZES,
           refuses={"uniform ablation": ("ignores edits of hook_pattern",),
                    "path patching": ("post-norm",), "kv-plan": ("causal decoder",)}),
]}
# fmt: on


def unsupported(family: str) -> str | None:
    """Why the installed transformers or TransformerLens cannot build or wrap a family, or
    None: a config class transformers lacks, or an architecture with no bridge adapter."""
    from importlib.metadata import version

    import transformers
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    fam = family_spec(family)
    if not hasattr(transformers, fam.config):
        return f"transformers {transformers.__version__} has no {fam.config}"
    if fam.architecture not in SUPPORTED_ARCHITECTURES:
        tl = version("transformer-lens")
        return f"TransformerLens {tl} has no bridge adapter for {fam.architecture}"
    return None


def family_spec(name: str) -> Family:
    """The :class:`Family` named ``name``; an unknown name is one line naming the families."""
    if name not in FAMILIES:
        raise UnsupportedModelError(
            f"unknown architecture family '{name}' (have: {', '.join(FAMILIES)})"
        )
    return FAMILIES[name]


_BEGIN = "<!-- generated by headmech.models.families.write_matrix_page: do not edit by hand -->"
_END = "<!-- end of the generated matrix -->"
NOT_RUN = "✗ failed or not run"  # a cell that no test filled in


def matrix_table(matrix: dict[str, dict[str, str]]) -> str:
    """The conformance matrix as a markdown table: a row per family of :data:`FAMILIES`, a
    column per check of :data:`CHECKS`.

    Args:
        matrix: family -> check -> cell (``✓ ...`` or ``refused: <reason>``); a missing
            cell reads :data:`NOT_RUN`.

    Returns:
        The table, one line per row, no trailing newline.
    """
    lines = ["| family | " + " | ".join(CHECKS) + " |", "|" + "---|" * (len(CHECKS) + 1)]
    for name, fam in FAMILIES.items():
        cells = [matrix.get(name, {}).get(c, NOT_RUN).replace("|", "\\|") for c in CHECKS]
        lines.append(f"| {name} ({fam.config}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_matrix_table(text: str) -> dict[str, dict[str, str]]:
    """The cells of the table :func:`matrix_table` wrote into a page.

    Args:
        text: the page (markdown); its first table whose header starts ``| family |``.

    Returns:
        family -> column -> cell, with the columns the page has (empty: no table).
    """
    import re

    def split(line: str) -> list[str]:
        inner = line.strip()[1:-1]
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| family |")), None)
    if start is None:
        return {}
    columns = split(lines[start])[1:]
    out: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        label, *cells = split(line)
        out[label.split(" ")[0]] = dict(zip(columns, cells, strict=False))
    return out


def write_matrix_page(path: str | Path, matrix: dict[str, dict[str, str]], seconds: float) -> None:
    """Rewrite the generated part of the matrix's page (``docs/families.md``): the table,
    the list of families and the versions it was measured with. The prose before and after
    is kept; a page without the markers of a generated part is refused.

    Args:
        path: the page (created with a title if absent).
        matrix: family -> check -> cell, as :func:`matrix_table` takes it.
        seconds: how long the measurement took.

    Raises:
        ValueError: the page has no generated part to replace.
    """
    import os
    from importlib.metadata import version

    path = Path(path)
    text = (
        path.read_text()
        if path.exists()
        else f"# Architecture conformance matrix\n\n{_BEGIN}\n{_END}\n"
    )
    if _BEGIN not in text or _END not in text:
        raise ValueError(
            f"{path} has no generated part: put the lines {_BEGIN} and {_END} around it"
        )
    head, rest = text.split(_BEGIN, 1)
    tail = rest.split(_END, 1)[1]
    families = "\n".join(f"- **{n}** ({f.architecture}): {f.feature}" for n, f in FAMILIES.items())
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    measured = (
        f"Measured with transformers {version('transformers')}, TransformerLens "
        f"{version('transformer-lens')}, tokenizers {version('tokenizers')}, torch "
        f"{torch.__version__}; the test file took {seconds:.0f} s (`OMP_NUM_THREADS={threads}`)."
    )
    block = f"{matrix_table(matrix)}\n\nFamilies:\n\n{families}\n\n{measured}"
    path.write_text(f"{head}{_BEGIN}\n{block}\n{_END}{tail}")
