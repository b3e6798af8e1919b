"""The architecture conformance matrix: every analysis on a tiny random model of each family.

Each family of :mod:`headmech.models.families` (GPT-2, GPT-NeoX, LLaMA, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3, Phi-3, OLMo 2, gpt-oss, BERT) is built once with random weights (2
layers, 4 heads, ``d_model`` 64, a 512-token byte-level BPE) and loaded through
:func:`headmech.load_model`. Wherever an independent reference exists the check is on
numbers: headmech's per-head attention statistics against the attention weights that
the Hugging Face model itself returns (eager attention, ``output_attentions=True``, on a
separately loaded copy that the bridge never touched), the exact importance methods,
a pruning step, path patching and the KV-plan masks against hand-written forward passes
of that copy (a pre-hook on the attention's output projection that changes one head's
slice), LRP against its conservation law.

Each family is expected to work in every check except those its ``Family.refuses`` lists,
where it must raise a one-line :class:`HeadmechError` naming the feature it lacks. Every
cell the module measures (``✓ ...`` or ``refused: <reason>``) must equal the cell of
``docs/families.md``'s table; with ``HEADMECH_FAMILIES_DOC=docs/families.md`` the module
instead writes the matrix it measured and its wall time there (:data:`REGENERATE`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F

import headmech
from headmech.attribution import importance
from headmech.core.errors import HeadmechError
from headmech.models import model_info
from headmech.models.families import (
    CHECKS,
    FAMILIES,
    PARTS,
    REGENERATE,
    WINDOW,
    read_matrix_table,
    unsupported,
    write_matrix_page,
)
from headmech.models.tiny import build_tiny
from headmech.probes import ProbeOptions, build_probe
from headmech.stream import engine
from headmech.stream.engine import ProbeBatch, stream_statistics, target_reducer
from headmech.tasks import get_task

PROBE_KW = {"n_sentences": 6, "n_sequences": 3, "half_len": 8, "batch_size": 3}
SMALL = ProbeOptions(**PROBE_KW)  # type: ignore[arg-type]
STAT_TOL = 1e-5  # attention statistics vs the eager weights
METRIC_TOL = 1e-5  # a task metric vs a hand-written forward, relative (fp32: ~2e-7 seen)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "families.md"
MATRIX: dict[str, dict[str, str]] = {f: {} for f in FAMILIES}  # what this run measured
T = TypeVar("T")


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg.strip(), f"not a one-line reason: {msg!r}"
    return msg.strip()


def _regenerating() -> str | None:
    return os.environ.get("HEADMECH_FAMILIES_DOC") or None


@pytest.fixture(scope="module", autouse=True)
def _write_matrix() -> Iterator[None]:
    """Time the module; with ``HEADMECH_FAMILIES_DOC`` write the measured matrix there."""
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    out = _regenerating()
    if out:
        write_matrix_page(out, MATRIX, seconds)


def _record(fam: Built, check: str, cell: str) -> None:
    """Note a measured cell; it must be the page's (unless the page is being rewritten)."""
    MATRIX[fam.name][check] = cell
    if _regenerating():
        return
    page = read_matrix_table(PAGE.read_text()).get(fam.name, {}).get(check)
    assert cell == page, (
        f"{fam.name}, {check}: measured {cell!r}, docs/families.md says {page!r}; if the "
        f"change is intended, regenerate the page: {REGENERATE}"
    )


def _attempt(fam: Built, check: str, run: Callable[[], T]) -> tuple[T | None, str | None]:
    """Run a check's call: a family expected to do ``check`` must not raise; one whose
    ``refuses`` lists it must raise a one-line HeadmechError naming the listed feature.

    Returns:
        ``(result, None)`` where it worked, ``(None, reason)`` where it was refused.
    """
    phrases = FAMILIES[fam.name].refuses.get(check)
    fix = f"if intended, update {fam.name}'s refuses in headmech/models/families.py, then {REGENERATE}"
    try:
        result = run()
    except HeadmechError as e:
        if phrases is None:
            raise AssertionError(
                f"{fam.name} refused {check}, expected to work ({fix}): {e}"
            ) from e
        reason = _one_line(e)
        missing = [p for p in phrases if p not in reason]
        assert not missing, f"{fam.name}'s refusal of {check} does not name {missing}: {reason!r}"
        return None, reason
    assert phrases is None, (
        f"{fam.name} ran {check}, expected refused ({'; '.join(phrases)}; {fix})"
    )
    return result, None


# --- the models --------------------------------------------------------------------------


@dataclass
class Built:
    """One family: its folder, the bridge, and an untouched Hugging Face copy (eager)."""

    name: str
    path: Path | None
    model: Any = None
    hf: Any = None
    refused: str | None = None  # why the family cannot load (unsupported)

    @property
    def causal(self) -> bool:
        return FAMILIES[self.name].causal


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory) -> Built:
    import transformers

    name = request.param
    reason = unsupported(name)
    if reason is not None:
        return Built(name, None, refused=reason)
    path = build_tiny(name, tmp_path_factory.mktemp(name))
    model = headmech.load_model(path)
    auto: Any = transformers.AutoModelForCausalLM
    if not FAMILIES[name].causal:
        auto = transformers.AutoModelForMaskedLM
    hf = auto.from_pretrained(path, attn_implementation="eager").eval()
    return Built(name, path, model, hf)


def _needs(fam: Built) -> None:
    if fam.refused is not None:
        pytest.skip(f"{fam.name} is refused: {fam.refused}")


@pytest.fixture(scope="module")
def batches(fam) -> dict[str, list[ProbeBatch]]:
    """The prose probe (padded, sentences longer than the window) and repeated tokens."""
    _needs(fam)
    return {
        "prose": build_probe("prose", fam.model, SMALL).batches,
        "repeated_random": build_probe("repeated_random", fam.model, SMALL).batches,
    }


# --- hand-written Hugging Face references ------------------------------------------------


def _layers(hf: Any) -> Any:
    base = hf.base_model
    for path in ("layers", "h", "encoder.layer"):
        obj = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return obj
    raise AssertionError(f"no layer list in {type(hf).__name__}")


def _o_proj(hf: Any, layer: int) -> torch.nn.Module:
    """The attention's output projection: its input is the heads' outputs side by side."""
    block = _layers(hf)[layer]
    for path in ("self_attn.o_proj", "attn.c_proj", "attention.dense", "attention.output.dense"):
        obj = block
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.Module):
            return obj
    raise AssertionError(f"no output projection in {type(block).__name__}")


def _d_head(fam: Built) -> int:
    return int(fam.model.cfg.d_head)


def _head_edit(
    fam: Built, edits: dict[tuple[int, int], Callable[[torch.Tensor], torch.Tensor]]
) -> list[Any]:
    """Pre-hooks on the output projections replacing heads' slices ``(layer, head) ->
    fn(slice)``; returns the handles."""
    d = _d_head(fam)
    handles = []
    for layer in sorted({la for la, _ in edits}):

        def pre(mod, args, layer=layer):
            x = args[0].clone()
            for (la, h), fn in edits.items():
                if la == layer:
                    x[..., h * d : (h + 1) * d] = fn(x[..., h * d : (h + 1) * d])
            return (x, *args[1:])

        handles.append(_o_proj(fam.hf, layer).register_forward_pre_hook(pre))
    return handles


Edit = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def _hf_metric(
    fam: Built,
    batches: list[ProbeBatch],
    edits: dict[tuple[int, int], Edit] | Callable[[int], dict[tuple[int, int], Edit]] | None = None,
    reference: list[torch.Tensor] | None = None,
) -> float:
    """The ``lm`` task on the Hugging Face copy: mean next-token cross-entropy over every
    real next token (decoders) or the mean over sentences of ``1 - cos(e, e0)`` of the
    mean-pooled final hidden state (encoders, ``reference``: the clean e0 per batch).
    ``edits``: head slices to replace, or per batch index a function giving them."""
    total, count = 0.0, 0
    for i, b in enumerate(batches):
        handles = _head_edit(fam, (edits(i) if callable(edits) else edits) or {})
        try:
            mask = b.attention_mask
            if fam.causal:
                logits = fam.hf(input_ids=b.input_ids, attention_mask=mask).logits.float()
                nll = F.cross_entropy(
                    logits[:, :-1].transpose(1, 2), b.input_ids[:, 1:], reduction="none"
                )
                keep = mask[:, 1:].bool()
                total += float(nll[keep].double().sum())
                count += int(keep.sum())
            else:
                e = _pooled(fam, b)
                e0 = e if reference is None else reference[i]
                total += float((1 - F.cosine_similarity(e, e0, dim=-1)).double().sum())
                count += e.shape[0]
        finally:
            for h in handles:
                h.remove()
    return total / count


@torch.no_grad()
def _hf_z(fam: Built, b: ProbeBatch) -> list[torch.Tensor]:
    """Per layer, the heads' outputs side by side (the output projection's input)."""
    seen: list[torch.Tensor] = []
    n_layers = int(fam.model.cfg.n_layers)
    handles = [
        _o_proj(fam.hf, la).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        for la in range(n_layers)
    ]
    try:
        fam.hf.base_model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    finally:
        for h in handles:
            h.remove()
    return seen


def _pooled(fam: Built, b: ProbeBatch) -> torch.Tensor:
    h = fam.hf.base_model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    m = b.attention_mask[..., None].float()
    return (h.last_hidden_state.float() * m).sum(1) / m.sum(1)


@torch.no_grad()
def _hf_mean_z(fam: Built, batches: list[ProbeBatch]) -> list[torch.Tensor]:
    """Per layer, each head's output averaged over the real tokens: ``[n_heads * d_head]``."""
    sums: list[torch.Tensor] = []
    count = 0
    for b in batches:
        real = b.attention_mask.bool()
        zs = [z[real].double().sum(0) for z in _hf_z(fam, b)]
        sums = zs if not sums else [a + z for a, z in zip(sums, zs, strict=True)]
        count += int(real.sum())
    return [(s / count).float() for s in sums]


# --- (a) load -----------------------------------------------------------------------------


def test_loads_with_the_right_shape(fam, tmp_path):
    if fam.refused is not None or "load" in FAMILIES[fam.name].refuses:
        # the installed libraries lack the family: expected, or a failure
        _, reason = _attempt(fam, "load", lambda: build_tiny(fam.name, tmp_path / fam.name))
        _record(fam, "load", f"refused: {reason}")
        return
    info = model_info(fam.model)
    spec = FAMILIES[fam.name].kwargs
    n_kv = spec.get("num_key_value_heads", 4)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head) == (2, 4, n_kv, 16)
    assert info.causal == fam.causal
    assert len(fam.model.tokenizer) <= int(fam.model.cfg.d_vocab)
    # the bridge computes what the Hugging Face model computes
    ids = fam.model.tokenizer(["The cat sat on the mat."], return_tensors="pt").input_ids
    with torch.no_grad():
        got = fam.model(ids).float()
        want = fam.hf(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _record(fam, "load", "✓")


# --- (b) classify -------------------------------------------------------------------------


def test_classify_every_applicable_type(fam):
    _needs(fam)
    catalog = headmech.classify(fam.model, n_boot=20, **PROBE_KW)
    ran, skipped = set(catalog.types), catalog.meta["skipped"]
    assert ran, f"no head type applies to {fam.name}"
    for name, result in catalog.types.items():
        assert result.score.shape == (2, 4), name
        assert torch.isfinite(result.score).all(), name
    for name, reason in skipped.items():
        assert reason and "\n" not in reason, name
        if not fam.causal:
            continue
        # on a decoder a type is skipped only where its probe needs English words the
        # 512-token vocabulary does not hold as single tokens, or where it reads direct
        # logit attribution and a norm follows each attention block (Gemma 2/3, OLMo 2)
        dla = name in ("subject", "relation") and "reads direct logit attribution" in reason
        assert "cannot be built" in reason or dla, (name, reason)
    from headmech.headtypes.registry import resolve_types

    assert ran | set(skipped) == {t.name for t in resolve_types(None)}
    if fam.causal:
        assert {"induction", "previous_token", "retrieval", "copy_suppression"} <= ran
    else:
        assert {"previous_token", "positional", "syntactic"} <= ran
    probes = sorted({r.split("'")[1] for r in skipped.values() if "cannot be built" in r})
    why = f"the {', '.join(probes)} probes need single-token words" if probes else "decoder-only"
    if dla_refused := sorted(
        n for n, r in skipped.items() if "reads direct logit attribution" in r
    ):
        why += (
            f"; {', '.join(dla_refused)}: no direct logit attribution after a post-attention norm"
        )
    _record(fam, "classify", f"✓ {len(ran)} types ({len(skipped)} skipped: {why})")


# --- (c) statistics = the eager attention weights -----------------------------------------


def _targets() -> dict[str, Callable[[ProbeBatch], torch.Tensor]]:
    def previous(b: ProbeBatch) -> torch.Tensor:
        pos = torch.arange(b.input_ids.shape[1]).expand_as(b.input_ids)
        return pos - 1  # -1 at position 0: no target

    def first(b: ProbeBatch) -> torch.Tensor:
        return torch.zeros_like(b.input_ids)

    def far(b: ProbeBatch) -> torch.Tensor:  # outside the sliding window
        pos = torch.arange(b.input_ids.shape[1]).expand_as(b.input_ids)
        return torch.where(pos >= WINDOW + 1, pos - WINDOW - 1, -1)

    def recent(b: ProbeBatch) -> torch.Tensor:  # a set: the two keys before each query,
        n = b.input_ids.shape[1]  # and the key just outside the sliding window
        pos = torch.arange(n)
        gap = pos[:, None] - pos[None, :]
        return ((gap == 1) | (gap == 2) | (gap == WINDOW)).expand(b.input_ids.shape[0], n, n)

    return {"previous": previous, "first": first, "far": far, "recent": recent}


# where each family's statistics come from without the eager pattern (engine._pattern_free)
PATTERN_FREE = {"gpt2": "blocks", "gpt_neox": "blocks", "phi3": "blocks", "bert": "blocks"}


def _windowed_layers(family: str) -> list[int]:
    kwargs = FAMILIES[family].kwargs
    if not kwargs.get("sliding_window"):
        return []
    types = kwargs.get("layer_types", ["sliding_attention"] * 2)
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def test_statistics_equal_the_eager_attention_weights(fam, batches):
    _needs(fam)
    targets = _targets()
    for probe, bs in batches.items():
        assert max(b.input_ids.shape[1] for b in bs) > 2 * WINDOW  # the window bites
        reducers = [target_reducer(name, fn) for name, fn in targets.items()]
        # blocks: pattern-free (inside the model's attention call, or rebuilt from the
        # hooked q and k): every family has it, so this raises for none; pattern: the hook
        stats = stream_statistics(fam.model, bs, reducers, attention="blocks")
        eager = stream_statistics(fam.model, bs, reducers, attention="pattern")
        auto = stream_statistics(fam.model, bs, reducers)
        assert engine._pattern_free(fam.model)[0] == PATTERN_FREE.get(fam.name, "call")
        sums = {n: torch.zeros(2, 4, dtype=torch.float64) for n in targets}
        counts = {n: 0 for n in targets}
        with torch.no_grad():
            for b in bs:
                out = fam.hf(
                    input_ids=b.input_ids, attention_mask=b.attention_mask, output_attentions=True
                )
                for name, fn in targets.items():
                    t = fn(b)
                    real = b.attention_mask.bool()
                    if t.dtype == torch.bool:  # a set of keys: the mass on its real keys
                        t = t & real[:, None, :]
                        has = t.any(-1) & real
                    else:
                        has = (t >= 0) & real  # real queries with a target
                    for la, att in enumerate(out.attentions):  # [batch, head, query, key]
                        if t.dtype == torch.bool:
                            mass = (att.double() * t[:, None]).sum(-1)
                        else:
                            mass = att.double().gather(-1, t.clamp(min=0)[:, None, :, None].expand(
                                -1, att.shape[1], -1, 1))[..., 0]  # fmt: skip
                        sums[name][la] += (mass * has[:, None]).sum((0, 2))
                    counts[name] += int(has.sum())
        for name in targets:
            ref = (sums[name] / counts[name]).float()
            for path, st in (("blocks", stats), ("pattern", eager), ("auto", auto)):
                got = st.mean(f"{name}.mass")
                msg = f"{probe} {name} {path}"
                torch.testing.assert_close(got, ref, atol=STAT_TOL, rtol=0, msg=msg)
            # the argmax: the same key wins in both paths (no near-ties in random models)
            torch.testing.assert_close(stats.mean(f"{name}.hit"), eager.mean(f"{name}.hit"))
        far = stats.mean("far.mass")
        for layer in range(2):  # nothing beyond a layer's window; something without one
            if layer in _windowed_layers(fam.name):
                assert float(far[layer].abs().max()) < 1e-7, (probe, layer)
            else:
                assert float(far[layer].min()) > 1e-4, (probe, layer)
    _record(fam, "statistics = eager", "✓")


# --- (d) exact importance -----------------------------------------------------------------


def test_exact_importance_equals_a_hand_written_forward(fam, batches):
    """Zero, mean and resample ablation and activation patching of every head."""
    _needs(fam)
    from headmech.attribution.patching import patching_pairs

    bs = batches["prose"]
    refs = None
    if not fam.causal:
        with torch.no_grad():
            refs = [_pooled(fam, b) for b in bs]
    clean = _hf_metric(fam, bs, reference=refs)
    means = _hf_mean_z(fam, bs)
    z_clean = [_hf_z(fam, b) for b in bs]
    corrupt = [c for _, c in patching_pairs(fam.model, get_task("lm", fam.model), bs, "noising", 0)]
    z_corrupt = [_hf_z(fam, c) for c in corrupt]
    d = _d_head(fam)

    def edit(mode: str, la: int, h: int) -> Callable[[int], dict[tuple[int, int], Edit]]:
        sl = slice(h * d, (h + 1) * d)

        def per_batch(i: int) -> dict[tuple[int, int], Edit]:
            if mode == "zero":
                return {(la, h): torch.zeros_like}
            if mode == "mean":
                return {(la, h): lambda x: means[la][sl].expand_as(x).to(x.dtype)}
            # resample: the previous sequence of the batch; patching: the corrupted run's
            src = z_clean[i][la].roll(1, dims=0) if mode == "resample" else z_corrupt[i][la]
            return {(la, h): lambda x: src[..., sl]}

        return per_batch

    for mode in ("zero", "mean", "resample", "patching"):
        r = importance(fam.model, mode, "lm", batches=bs, n_boot=0)
        assert r.score.shape == (2, 4)
        assert r.metric_clean == pytest.approx(clean, rel=METRIC_TOL, abs=1e-7)
        ref = torch.zeros(2, 4)
        for la in range(2):
            for h in range(4):
                ref[la, h] = _hf_metric(fam, bs, edit(mode, la, h), reference=refs) - clean
        tol = METRIC_TOL * max(abs(clean), float((ref + clean).abs().max()))  # of the metric
        torch.testing.assert_close(r.score, ref, atol=tol, rtol=0, msg=f"{mode} ablation")
        assert ref.abs().max() > 100 * tol, mode  # the heads matter: the check can fail
    # uniform attention: no hand-written reference, it runs (or is refused, as expected)
    u, reason = _attempt(
        fam,
        "uniform ablation",
        lambda: importance(fam.model, "uniform", "lm", batches=bs, n_boot=0),
    )
    if u is not None:
        assert torch.isfinite(u.score).all() and u.score.abs().max() > 0
    uniform = "runs" if reason is None else f"refused ({reason})"
    _record(fam, "exact importance", f"✓ zero, mean, resample, patching; uniform: {uniform}")


# --- (e) attribution patching and LRP -----------------------------------------------------


@pytest.mark.filterwarnings("ignore:attribution patching disagrees")  # random weights
def test_attribution_patching_runs_and_lrp_conserves(fam, batches):
    _needs(fam)
    bs = batches["prose"]
    r = importance(fam.model, "attribution_patching", "lm", batches=bs, n_boot=0)
    assert r.score.shape == (2, 4) and torch.isfinite(r.score).all()
    assert r.score.abs().max() > 0
    # direct logit attribution: runs, or refused where the readout is not linear
    dla, reason = _attempt(
        fam, "DLA", lambda: importance(fam.model, "dla", "lm", batches=bs, n_boot=0)
    )
    if dla is not None:
        assert torch.isfinite(dla.score).all()
    _record(fam, "attribution patching", "✓" if reason is None else f"✓ (DLA refused: {reason})")

    from headmech.attribution.lrp import lrp_relevance

    ids = fam.model.tokenizer("The cat sat on the mat because it was tired.").input_ids
    ids = torch.tensor(ids)
    rel, reason = _attempt(fam, "LRP", lambda: lrp_relevance(fam.model, ids))
    if rel is None:
        _record(fam, "LRP", f"refused: {reason}")
        return
    assert rel["heads"].shape == (2, 4) and torch.isfinite(rel["heads"]).all()
    scale = abs(rel["logit"]) + abs(rel["input"]) + abs(rel["bias"])
    scale += float(rel["softmax"].abs().sum())
    assert abs(rel["residual"]) / scale < 1e-5, rel  # logit = R(input) + R(bias) + R(softmax)
    with torch.no_grad():
        logit = fam.model(ids[None])[0, -1].float()
    assert rel["logit"] == pytest.approx(float(logit.max()), rel=1e-5)
    _record(fam, "LRP", "✓")


# --- (f) path patching, pruning, KV plans, discovery, provenance --------------------------


def _q_of_head(fam: Built, layer: int, head: int, x: torch.Tensor) -> torch.Tensor:
    """Head ``head``'s query projection of the (normed) residual ``x`` in the HF copy."""
    block = _layers(fam.hf)[layer]
    d, n = _d_head(fam), 4
    attn = getattr(block, "self_attn", None) or getattr(block, "attn", None)
    attn = attn if attn is not None else block.attention
    if hasattr(attn, "q_proj"):
        return attn.q_proj(x)[..., head * d : (head + 1) * d]
    if hasattr(attn, "qkv_proj"):  # Phi-3: [q | k | v]
        return attn.qkv_proj(x)[..., head * d : (head + 1) * d]
    if hasattr(attn, "c_attn"):  # GPT-2: [q | k | v]
        return attn.c_attn(x)[..., head * d : (head + 1) * d]
    qkv = attn.query_key_value(x)  # GPT-NeoX: per head [q | k | v]
    return qkv.view(*x.shape[:-1], n, 3 * d)[..., head, :d]


def _q_module(fam: Built, layer: int) -> torch.nn.Module:
    block = _layers(fam.hf)[layer]
    attn = getattr(block, "self_attn", None) or getattr(block, "attn", None) or block.attention
    for name in ("q_proj", "qkv_proj", "c_attn", "query_key_value"):
        if hasattr(attn, name):
            return getattr(attn, name)
    raise AssertionError(type(attn).__name__)


def _input_norm(fam: Built, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    block = _layers(fam.hf)[layer]
    for name in ("input_layernorm", "ln_1"):
        if hasattr(block, name):
            return getattr(block, name)
    return lambda x: x  # OLMo 2: attention reads the raw residual


def _post_norm(fam: Built, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A norm between the attention's output and the residual stream (Gemma, OLMo 2)."""
    block = _layers(fam.hf)[layer]
    cls = type(block).__name__
    if "Gemma" in cls:
        return block.post_attention_layernorm
    if "Olmo2" in cls:
        return block.post_attention_layernorm
    return None


@torch.no_grad()
def _hf_capture(fam: Built, batch: ProbeBatch, ls: int, lr: int) -> dict[str, torch.Tensor]:
    """One run of the HF copy: layer ``ls``'s heads' outputs ``z`` and its attention
    output ``a`` (the output projection's), and the residual entering layer ``lr``."""
    got: dict[str, torch.Tensor] = {}
    o = _o_proj(fam.hf, ls)

    def grab_resid(mod: Any, args: Any, kwargs: Any) -> None:
        got["resid"] = args[0] if args else kwargs["hidden_states"]

    handles = [
        o.register_forward_pre_hook(lambda m, a: got.__setitem__("z", a[0])),
        o.register_forward_hook(lambda m, a, out: got.__setitem__("a", out)),
        _layers(fam.hf)[lr].register_forward_pre_hook(grab_resid, with_kwargs=True),
    ]
    try:
        fam.hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for h in handles:
            h.remove()
    return got


@torch.no_grad()
def _hf_path_patch(fam, clean, corrupt, sender, receiver) -> float:
    """Noising path patching sender -> receiver's query by hand on the HF copy: the
    sender's output change between the corrupted and the clean run, through the output
    projection (and a norm after attention, where the block has one), is added to the
    residual the receiver's query alone reads."""
    (ls, hs), (lr, hr) = sender, receiver
    d = _d_head(fam)
    o = _o_proj(fam.hf, ls)
    joint = hasattr(_layers(fam.hf)[lr], "attention") and hasattr(
        _layers(fam.hf)[lr].attention, "query_key_value"
    )  # GPT-NeoX: per head [q | k | v]
    total, count = 0.0, 0
    for b, c in zip(clean, corrupt, strict=True):
        base, src = _hf_capture(fam, b, ls, lr), _hf_capture(fam, c, ls, lr)
        dz = torch.zeros_like(base["z"])
        sl = slice(hs * d, (hs + 1) * d)
        dz[..., sl] = src["z"][..., sl] - base["z"][..., sl]
        delta = o(dz) - o(torch.zeros_like(dz))  # the sender's direct write's change
        post = _post_norm(fam, ls)
        if post is not None:
            delta = post(base["a"] + delta) - post(base["a"])
        new_q = _q_of_head(fam, lr, hr, _input_norm(fam, lr)(base["resid"] + delta))

        def patch_q(mod: Any, args: Any, out: torch.Tensor, new_q=new_q) -> torch.Tensor:
            out = out.clone()
            if joint:
                out.view(*out.shape[:-1], 4, 3 * d)[..., hr, :d] = new_q
            else:
                out[..., hr * d : (hr + 1) * d] = new_q
            return out

        handle = _q_module(fam, lr).register_forward_hook(patch_q)
        try:
            logits = fam.hf(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        finally:
            handle.remove()
        nll = F.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), b.input_ids[:, 1:], reduction="none"
        )
        keep = b.attention_mask[:, 1:].bool()
        total += float(nll[keep].double().sum())
        count += int(keep.sum())
    return total / count


def test_path_patching_equals_a_hand_written_patch(fam, batches):
    _needs(fam)
    from headmech.attribution.patching import patching_pairs
    from headmech.circuits.path_patching import path_patch

    bs = batches["prose"]
    got, reason = _attempt(
        fam, "path patching", lambda: path_patch(fam.model, "lm", (0, 1), component="q", batches=bs)
    )
    if got is None:
        _record(fam, "path patching", f"refused: {reason}")
        return
    assert got.shape == (2, 4) and torch.isnan(got[0]).all() and torch.isfinite(got[1]).all()
    task = get_task("lm", fam.model)
    corrupt = [c for _, c in patching_pairs(fam.model, task, bs, "noising", 0)]
    clean = _hf_metric(fam, bs)
    ref = torch.tensor([_hf_path_patch(fam, bs, corrupt, (0, 1), (1, h)) - clean for h in range(4)])
    tol = METRIC_TOL * abs(clean)
    torch.testing.assert_close(got[1], ref, atol=tol, rtol=0)
    assert ref.abs().max() > 10 * tol  # the edges matter: the check can fail
    _record(fam, "path patching", "✓")


def test_one_michel_pruning_step(fam, batches):
    _needs(fam)
    from headmech.pruning import michel_prune

    bs = batches["prose"]
    result = michel_prune(fam.model, "lm", steps=1, batches=bs)
    steps = result.steps
    assert [s["n_kept"] for s in steps] == [8, 7]
    kept = {tuple(h) for h in steps[1]["heads_kept"]}
    (gone,) = {(la, h) for la in range(2) for h in range(4)} - kept
    refs = None
    if not fam.causal:
        with torch.no_grad():
            refs = [_pooled(fam, b) for b in bs]
    assert steps[0]["metric"] == pytest.approx(
        _hf_metric(fam, bs, reference=refs), rel=METRIC_TOL, abs=1e-7
    )
    ref = _hf_metric(fam, bs, {gone: torch.zeros_like}, reference=refs)
    assert steps[1]["metric"] == pytest.approx(ref, rel=METRIC_TOL, abs=1e-6)
    _record(fam, "pruning", "✓")


@torch.no_grad()
def _hf_windowed_nll(fam: Built, b: ProbeBatch, window: int) -> tuple[float, int]:
    """Prose NLL with every head seeing the keys ``t - window .. t`` (no sinks): one
    additive 4D mask, the same for every head and layer."""
    n = b.input_ids.shape[1]
    pos = torch.arange(n)
    gap = pos[:, None] - pos[None, :]
    allowed = (gap >= 0) & (gap <= window) & b.attention_mask.bool()[:, None, None, :]
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    logits = fam.hf(input_ids=b.input_ids, attention_mask=mask).logits.float()
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), b.input_ids[:, 1:], reduction="none")
    keep = b.attention_mask[:, 1:].bool()
    return float(nll[keep].double().sum()), int(keep.sum())


def test_kv_plan_masks_equal_a_hand_written_mask(fam):
    _needs(fam)
    _, reason = _attempt(fam, "kv-plan", lambda: _kv_plan_checks(fam))
    _record(fam, "kv-plan", "✓" if reason is None else f"refused: {reason}")


def _kv_plan_checks(fam: Built) -> None:
    from headmech.kv import KVPlan, evaluate, evaluate_many
    from headmech.kv.masks import needle_batches, prose_batches

    prose = prose_batches(fam.model, 40, n=1)
    full = evaluate(fam.model, None, prose=prose)
    with torch.no_grad():
        logits = fam.hf(input_ids=prose[0].input_ids).logits.float()
    want = F.cross_entropy(logits[0, :-1], prose[0].input_ids[0, 1:], reduction="sum")
    assert full.nll_sum == pytest.approx(float(want), rel=METRIC_TOL)
    window = WINDOW // 2  # narrower than the model's own window: the plan's mask decides
    plan = KVPlan.windowed(fam.model, sinks=0, window=window)
    got = evaluate(fam.model, plan, prose=prose)
    nll, n = _hf_windowed_nll(fam, prose[0], window)
    assert (got.n_tokens, got.nll_sum) == (n, pytest.approx(nll, rel=METRIC_TOL))
    assert abs(got.nll_sum - full.nll_sum) > 1e-4  # the window bites
    mixed = KVPlan.from_heads(fam.model, [(0, 0), (1, 3)], sinks=1, window=window)
    needle = needle_batches(fam.model, 100, depths=(0.5,))
    result = evaluate(fam.model, mixed, needle=needle, prose=prose)
    assert math.isfinite(result.logprob) and math.isfinite(result.perplexity)
    # many plans at once, sharing layers, give each plan's own numbers in every family
    many = evaluate_many(fam.model, [None, plan, mixed], needle=needle, prose=prose)
    for ev, alone in zip(many, [full, got, result], strict=True):
        assert ev.nll_sum == pytest.approx(alone.nll_sum, rel=METRIC_TOL)
    assert many[2].logprob == pytest.approx(result.logprob, rel=METRIC_TOL)
    ids = prose[0].input_ids[:, :24]
    _compressed_cache_generates_the_masked_greedy(fam, mixed, ids)  # narrower than own
    wide = KVPlan.from_heads(fam.model, [(0, 0), (1, 3)], sinks=1, window=WINDOW)
    _compressed_cache_generates_the_masked_greedy(fam, wide, ids)  # own windows kept


def _compressed_cache_generates_the_masked_greedy(fam, plan, ids, n=4):
    """The compressed cache (with the model's own sliding windows) decodes what the masked
    model computes over the whole sequence at every step."""
    from headmech.kv import generate, planned

    gen = generate(fam.model, plan, ids, max_new_tokens=n)
    out, logits = ids, []
    with planned(fam.model, plan) as hf, torch.inference_mode():
        for _ in range(n):
            logits.append(hf(out).logits[:, -1].float())
            out = torch.cat([out, logits[-1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen.tokens, out[:, ids.shape[1] :])
    assert (gen.logits - torch.stack(logits, 1)).abs().max() < 1e-3


def test_discover(fam, batches):
    _needs(fam)
    from headmech.discover import discover

    result = discover(fam.model, n_clusters=2, n_examples=1, **PROBE_KW)
    assert result.assignment.shape == (2, 4)
    assert set(result.assignment.flatten().tolist()) <= {0, 1}
    for name, f in result.features.items():
        assert f.shape == (2, 4) and torch.isfinite(f).all(), name
    # its first-token mass is the eager weights' on the same prose
    bs = build_probe("prose", fam.model, ProbeOptions(**PROBE_KW)).batches
    total, count = torch.zeros(2, 4, dtype=torch.float64), 0
    with torch.no_grad():
        for b in bs:
            att = fam.hf(
                input_ids=b.input_ids, attention_mask=b.attention_mask, output_attentions=True
            ).attentions
            pos = torch.arange(b.input_ids.shape[1])
            q = b.attention_mask.bool() & ~b.special & (pos >= 1)
            for la, a in enumerate(att):
                total[la] += (a[..., 0].double() * q[:, None]).sum((0, 2))
            count += int(q.sum())
    ref = (total / count).float()
    torch.testing.assert_close(result.features["attention.first_mass"], ref, atol=STAT_TOL, rtol=0)
    _record(fam, "discover", "✓")


def test_provenance(fam, tmp_path):
    _needs(fam)
    from headmech.runs.provenance import provenance, weights_hash

    record = provenance(fam.model)
    assert record["model"]["n_heads"] == 4
    digest = record["model"]["weights_sha256"]
    assert len(digest) == 64
    # build_tiny is deterministic: the same seed, the same weights; another seed, others
    rebuilt = headmech.load_model(build_tiny(fam.name, tmp_path / "same"))
    assert weights_hash(rebuilt) == digest
    other = headmech.load_model(build_tiny(fam.name, tmp_path / "other", seed=1))
    assert weights_hash(other) != digest
    again = headmech.load_model(fam.path)
    assert weights_hash(again) == digest  # the same weights, loaded again
    with torch.no_grad():
        p = next(again.parameters())
        p.view(-1)[0] += 1.0
    assert weights_hash(again) != digest
    _record(fam, "provenance", "✓")


# --- the page and the expectations, without running a model ------------------------------


def test_page_has_a_cell_per_family_and_check():
    page = read_matrix_table(PAGE.read_text())
    assert list(page) == list(FAMILIES), f"docs/families.md's rows differ; {REGENERATE}"
    for name, cells in page.items():
        assert list(cells) == list(CHECKS), f"docs/families.md's {name} row differs; {REGENERATE}"


def test_page_agrees_with_the_expected_refusals():
    """A cell is refused exactly where its family's ``refuses`` says, naming the feature."""
    page = read_matrix_table(PAGE.read_text())
    for name, fam in FAMILIES.items():
        assert set(fam.refuses) <= set(CHECKS) | set(PARTS), name
        for check in CHECKS:
            cell = page.get(name, {}).get(check, "")
            parts = [p for p in fam.refuses if p == check or PARTS.get(p) == check]
            assert cell.startswith("refused: ") == (check in fam.refuses), (name, check, cell)
            assert ("refused" in cell) == bool(parts), (name, check, cell)
            for p in parts:
                missing = [w for w in fam.refuses[p] if w not in cell]
                assert not missing, f"{name}, {check}: {missing} not in {cell!r}; {REGENERATE}"
