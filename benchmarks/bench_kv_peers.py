"""KV plans against kvpress's presses on the same model and held-out data (issue 48).

Three steps (``--step``; ``all`` runs them in order):

1. ``prepare`` (headmech's environment): the held-out needle trials and prose sequences
   of ``bench_kv_plans.py`` (its ``batches(..., part=1)``: needle seeds x depths, prose
   sequences from the odd-numbered corpus sentences) as token ids with the answer
   positions and where each trial's question starts, into ``--data`` (JSON); the model's
   Hugging Face folder (the cached dequantised safetensors of a bundled model); headmech's
   ``importance`` / ``union`` / ``catalog`` plans at each compression ratio (budget
   ``1 - ratio`` of the cache, the importance ranking stored by ``bench_kv_plans.py``),
   and where that store has them ``restored`` (``kv_importance(mode="restored")``) and the
   per-task orders ``importance-task`` / ``restored-task`` (``ranking(by="task")``),
   written as DuoAttention pattern folders (:func:`headmech.kv.duo.write_pattern`);
   and the masked evaluations ``bench_kv_plans.py`` stored for those plans where its store
   has the budget (whole-sequence perplexity: shown beside, not ranked).
2. ``peer`` (run by ``.venv-kvpress/bin/python``, ``make kv-peers-env``: kvpress 0.5.5
   needs transformers < 5.3): per press and ratio, kvpress's own protocol (its pipeline's
   ``_forward``): the **context** is prefilled under the press (``with press(model):
   model.model(context, past_key_values=cache)``), then the rest runs after the compressed
   cache with positions continuing from the context's length. Needle: the context is
   everything before the question; the question and the answer follow, teacher-forced,
   and a trial is recalled when every answer token is the argmax (what greedy decoding
   answers: ``bench_kv_plans.py``'s ``exact``). Prose: the last ``--continuation`` tokens
   follow the compressed rest; perplexity over them. headmech's plans run as kvpress's
   ``DuoAttentionPress`` with the patterns of step 1 (``headmech-<plan>`` rows), and
   combined with a token-level press (``headmech-<plan>+<press>`` rows, ``--combine``):
   the plan's full heads keep everything, the others keep as many entries as the plan's
   window gives them, chosen by the press's scores (checked once per run: with a recency
   scorer it masks exactly what the plan's row masks). ``kept``:
   the measured share of the context's cache entries left (removed entries and, for the
   presses that mask per head, masked ones subtracted). A model with sliding-window layers
   of its own (Gemma 3: 15 of 18 layers keep 512 tokens) is run as kvpress runs Gemma 3:
   presses compress only the global layers, so a ratio is the share of *their* cache
   removed; headmech's plans get the same bytes (:func:`own_budget`) and ``kept`` is a
   share of the model's own cache (the windows included).
3. ``report`` (headmech's environment): per model and context a table (recall / perplexity
   change against the full cache, per method and ratio) and the largest ratio at which a
   method holds both criteria (recall >= 95% of the full cache's, perplexity within 1%),
   printed and recorded in results.json (``python benchmarks/report.py`` writes
   RESULTS.md).

The store (``--store``, default ``benchmarks/kv_peers_<model>.json``) is written after
every cell; a rerun skips finished cells, and cells measured on other data (a hash of the
token ids) move to ``stale``.

Usage:
    make kv-peers-env
    python benchmarks/bench_kv_peers.py --context 4096 --threads 1      # all three steps
    python benchmarks/bench_kv_peers.py --step prepare --context 4096
    .venv-kvpress/bin/python benchmarks/bench_kv_peers.py --step peer --context 4096 \
        --threads 1 --presses SnapKVPress,KnormPress --ratios 0.5
    python benchmarks/bench_kv_peers.py --step report
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from common import add_arguments, machine, start

HERE = Path(__file__).parent
PEER_PY = HERE.parent / ".venv-kvpress" / "bin" / "python"
RATIOS = "0.25,0.5,0.67,0.75"
# restored and the per-task orders (-task): where bench_kv_plans has the measurement
PLANS = ("importance", "union", "catalog", "restored", "importance-task", "restored-task")
# query-agnostic presses tried on the CPU; the DuoAttention rows are headmech's patterns
PRESSES = (
    "StreamingLLMPress", "SnapKVPress", "PyramidKVPress", "AdaKVPress(SnapKVPress)",
    "ExpectedAttentionPress", "TOVAPress", "KnormPress", "KVzipPress", "RandomPress",
)  # fmt: skip
# combined rows (plan+scorer press): ExpectedAttention lost the least perplexity of the
# presses on SmolLM2; SnapKV is the example
COMBINE = (
    "importance+ExpectedAttentionPress,union+ExpectedAttentionPress,"
    "catalog+ExpectedAttentionPress,importance+SnapKVPress,catalog+SnapKVPress"
)
CRITERIA = "recall >= 95% of the full cache's and perplexity within 1%"


def _floats(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s]


def default_data(model: str, context: int) -> Path:
    root = Path(os.environ.get("HEADMECH_CACHE", Path.home() / ".cache" / "headmech"))
    return root / "kv-peers" / f"{model}-{context}.json"


# --- 1. prepare (headmech's environment) ----------------------------------------------
def model_folder(model: str, hf: Any, tok: Any) -> Path:
    """The Hugging Face folder plain transformers loads: the cached dequantised weights of
    a bundled GGUF model, or (another model) a copy saved once into the cache."""
    from headmech.models.files import cache_dir

    try:
        from headmech.models.bundled import _gguf_dir

        return _gguf_dir(model)
    except KeyError:
        out = cache_dir() / "kv-peers" / "models" / model
        if not (out / "config.json").exists():
            hf.save_pretrained(out)
            tok.save_pretrained(out)
        return out


def question_start(ids: list[int], first_answer: int, tok: Any) -> int:
    """Where the trial's question (``"\\n\\nQuestion: ..."``) starts: the context ends there."""
    marker = list(tok("\n\nQuestion:", add_special_tokens=False)["input_ids"])
    for i in range(first_answer - len(marker), -1, -1):
        if ids[i : i + len(marker)] == marker:
            return i
    raise ValueError("no question marker in a needle trial")


def prepare(args: argparse.Namespace) -> dict:
    import bench_kv_plans as kvp

    from headmech.classification.results import HeadCatalog
    from headmech.kv.duo import write_pattern
    from headmech.probes.needle import needle_spans

    opts = SimpleNamespace(
        hf=None, model=args.model, device=None, seeds=args.seeds, calib_seeds="100",
        depths=args.depths, prose=args.prose, sinks=4, window=256,
    )  # fmt: skip
    hf, shim = kvp.load(opts)
    tok = shim.tokenizer
    needle, prose, copies = kvp.batches(opts, shim, args.context, 1)
    data: dict[str, Any] = {
        "model": args.model, "context": args.context, "continuation": args.continuation,
        "folder": str(model_folder(args.model, hf, tok)), "data": kvp.data_hash(needle + prose),
        "corpus_repeats": copies, "needle": [], "prose": [], "plans": {},
        "ratio_of": ratio_of(hf),
    }  # fmt: skip
    for b in needle:
        answer_pos, _, valid, _ = needle_spans(b)
        for row in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[row].sum())
            ids = b.input_ids[row, :n].tolist()
            answer = answer_pos[row][valid[row]].tolist()
            q0 = question_start(ids, answer[0], tok)
            depth = round(int(b.extras["needle_start"][row]) / n, 2)
            data["needle"].append({"ids": ids, "question": q0, "answer": answer, "depth": depth})
    for b in prose:
        ids = b.input_ids[0, : int(b.attention_mask[0].sum())].tolist()
        data["prose"].append({"ids": ids, "split": len(ids) - args.continuation})
    # headmech's plans at budget 1 - ratio, from the importance ranking bench_kv_plans stored
    store_path = HERE / f"kv_plans_{args.model}.json"
    stored = json.loads(store_path.read_text()) if store_path.exists() else {}
    ctx = stored.get(str(args.context), {})
    if "importance" in ctx:
        catalog = HeadCatalog.load(HERE.parent / "catalog" / args.model)
        measured = kvp.measured_rankings(stored, ctx)
        rankings = kvp.rankings_for(hf, catalog, measured["importance"]) | measured
        duo_root = Path(args.data).with_suffix("") / "duo"
        for ratio in _floats(args.ratios):
            budget = own_budget(hf, ratio, args.context)
            for kind in (k for k in PLANS if k in rankings):
                plan = kvp.plan_of(hf, kind, budget, args.context, rankings, 0, opts)
                folder = write_pattern(plan, duo_root / f"{kind}-{ratio:g}")
                data["plans"][f"{kind}/{ratio:g}"] = {
                    "folder": str(folder), "n_full": plan.n_full, "window": plan.window,
                    "sinks": plan.sinks, "n_kv_heads_total": plan.full.numel(),
                    "kv_fraction": plan.kv_fraction(args.context),
                }  # fmt: skip
    else:
        print(f"no importance ranking at {args.context} tokens in {store_path}: no headmech rows")
    data["masked"] = masked_cells(ctx, data)
    Path(args.data).parent.mkdir(parents=True, exist_ok=True)
    Path(args.data).write_text(json.dumps(data) + "\n")
    print(f"wrote {args.data}: {len(data['needle'])} needle trials, {len(data['prose'])} prose, "
          f"{len(data['plans'])} plans; model folder {data['folder']}")  # fmt: skip
    return data


def ratio_of(hf: Any) -> str:
    """What a compression ratio is a share of, on this model (recorded beside its table)."""
    from headmech.kv.budget import model_windows

    windows = model_windows(hf)
    if not any(windows):
        return "the whole cache"
    return (f"the cache of the {sum(1 for w in windows if not w)} of {len(windows)} layers "
            f"without a sliding window of their own (kvpress's convention for Gemma 3; the "
            f"others keep their {max(windows)}-token windows; kept: a share of the model's "
            f"own cache)")  # fmt: skip


def own_budget(hf: Any, ratio: float, context: int) -> float:
    """The plan's budget (a fraction of the model's own cache) at a press's compression
    ``ratio``. kvpress compresses only the layers without a sliding window of their own
    (its convention for Gemma 3; the peer does the same, :func:`compressible`), so ``ratio``
    is the share of those layers' cache removed: the plan keeps ``1 - ratio`` of the global
    layers' cache and the windowed layers their windows, the same bytes. Without such
    layers: ``1 - ratio``."""
    from headmech.kv.budget import model_windows

    windows = model_windows(hf)
    glob = sum(context for w in windows if not w)
    fixed = sum(min(context, w) for w in windows if w)
    return ((1 - ratio) * glob + fixed) / (glob + fixed)


def masked_cells(ctx: dict, data: dict) -> dict:
    """``bench_kv_plans.py``'s stored masked evaluations of the same plans at the budgets
    ``1 - ratio`` it has, and whether its trials are these (lengths and depths)."""
    evals = ctx.get("evals", {})
    if "full/1/0" not in evals:
        return {}
    mine = sorted((len(t["ids"]), t["depth"]) for t in data["needle"])
    theirs = sorted((int(t["tokens"]), float(t["depth"])) for t in evals["full/1/0"]["trials"])
    out: dict[str, Any] = {
        "same_trials": mine == theirs and ctx.get("data", data["data"]) == data["data"],
        "full": {k: evals["full/1/0"][k] for k in ("recall", "perplexity")},
        "device": evals["full/1/0"].get("device") or "cuda",
    }
    for key, ev in evals.items():
        kind, budget, _ = key.split("/")
        if kind in PLANS and "error" not in ev:
            ratio = round(1 - float(budget), 2)
            out[f"{kind}/{ratio:g}"] = {
                "recall": ev["recall"], "perplexity": ev["perplexity"],
                "kv_fraction": ev["plan"]["kv_fraction"],
            }  # fmt: skip
    return out


# --- 2. the peer run (kvpress's environment) ------------------------------------------
def make_press(name: str, ratio: float, data: dict) -> Any:
    """A kvpress press by row name at ``ratio`` (the fraction of the context removed)."""
    import kvpress as kp

    if name.startswith("headmech-"):  # headmech-<plan> or headmech-<plan>+<scorer press>
        kind, _, inner = name.removeprefix("headmech-").partition("+")
        plan = data["plans"][f"{kind}/{ratio:g}"]
        windowed = 1 - plan["n_full"] / plan["n_kv_heads_total"]
        duo = pattern_duo_press()(head_compression_ratio=windowed, pattern_dir=plan["folder"])
        if not inner:
            return duo
        return plan_scorer_press()(plan=duo, press=getattr(kp, inner)(compression_ratio=ratio))
    if name.startswith("AdaKVPress("):
        inner = getattr(kp, name[len("AdaKVPress(") : -1])(compression_ratio=ratio)
        return kp.AdaKVPress(press=inner)
    if name == "RandomPress":
        return kp.RandomPress(compression_ratio=ratio, seed=0)
    return getattr(kp, name)(compression_ratio=ratio)


def global_rotary(model: Any) -> Any:
    """The rotary embedding a press's scorer calls as ``rotary_emb(x, position_ids)``.
    Gemma 3's takes the kind of layer as well (its global and local layers rotate with
    different bases) and kvpress 0.5.5 passes none; presses here compress only the global
    layers (:func:`compressible`), so theirs."""
    rotary = model.model.rotary_emb
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return rotary
    return functools.partial(rotary, layer_type="full_attention")


def pattern_duo_press() -> type:
    """kvpress's DuoAttentionPress reading its pattern from a folder instead of the web
    (its loader fetches DuoAttention's repository, keyed by model name): the same parsing
    (``np.loadtxt`` of ``full_attention_heads.tsv``, clipped to [0, 1], kept two-dimensional;
    ``sink_size`` and ``recent_size`` of ``config.json``)."""
    import numpy as np
    from kvpress import DuoAttentionPress

    @dataclass
    class PatternDuoAttentionPress(DuoAttentionPress):
        pattern_dir: str = ""

        def load_attention_pattern(self, model: Any) -> tuple[int, int, Any]:
            folder = Path(self.pattern_dir)
            config = json.loads((folder / "config.json").read_text())
            text = (folder / "full_attention_heads.tsv").read_text()
            # ndmin=2: a model with one KV head per layer (Gemma 3 270M) has one column,
            # which np.loadtxt would squeeze to a vector (and the layer's mask to a scalar)
            scores = np.loadtxt(StringIO(text), dtype=float, delimiter="\t", ndmin=2)
            scores = np.clip(scores, 0, 1)
            return config["sink_size"], config["recent_size"], scores

    return PatternDuoAttentionPress


def plan_scorer_press() -> type:
    """A headmech plan combined with a token-level press (issue 48, item 2): the plan's
    full KV heads keep the whole context, as in its DuoAttention row; every other KV head
    keeps as many entries as the plan's window gives it (``sink_size + recent_size``), but
    which ones the inner press's scores choose (the first ``sink_size`` always kept), not
    the most recent. The same bytes as the plan alone; masked per head as kvpress's
    ``AdaKVPress`` and ``DuoAttentionPress`` do (``masked_key_indices``)."""
    from kvpress.presses.base_press import BasePress

    @dataclass
    class PlanScorerPress(BasePress):
        plan: Any = None  # a PatternDuoAttentionPress: which heads keep everything
        press: Any = None  # a kvpress ScorerPress: which entries the other heads keep

        def post_init_from_model(self, model: Any) -> None:
            self.plan.post_init_from_model(model)
            self.press.post_init_from_model(model)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):  # noqa: ANN001, ANN201
            keep = self.plan.sink_size + self.plan.recent_size
            streaming = self.plan.streaming_mask[module.layer_idx]
            if keys.shape[2] <= keep or not bool(streaming.any()):
                return keys, values
            scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
            scores = scores.to(torch.float, copy=True)
            scores[..., : self.plan.sink_size] = float("inf")
            chosen = scores.topk(keep, dim=-1).indices
            masked = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, chosen, False)
            masked[:, ~streaming.to(masked.device)] = False
            module.masked_key_indices = torch.nonzero(masked, as_tuple=True)
            return keys, values

    return PlanScorerPress


def check_combined(model: Any, saved: dict[int, tuple], data: dict) -> None:
    """The combined press with a recency scorer (score = position) keeps exactly what the
    plan's DuoAttention row keeps (the sinks and the most recent entries of every
    windowed head): the head choice, the budget and the masking are the plan's."""
    from kvpress import ScorerPress

    class Recency(ScorerPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):  # noqa: ANN001, ANN201
            return torch.arange(keys.shape[2], dtype=torch.float).expand(*keys.shape[:3])

    plan = next(iter(sorted(data["plans"])), None)
    if plan is None:
        return
    kind, ratio = plan.split("/")
    masks = []
    for press in (make_press(f"headmech-{kind}", float(ratio), data),
                  plan_scorer_press()(plan=make_press(f"headmech-{kind}", float(ratio), data),
                                      press=Recency(compression_ratio=float(ratio)))):  # fmt: skip
        press.post_init_from_model(model)
        per_layer = []
        for i, layer in enumerate(model.model.layers):
            if not compressible(model, i):
                continue
            hidden, kwargs, keys, values = saved[i][:4]
            layer.self_attn.masked_key_indices = None
            press.compress(layer.self_attn, hidden, keys, values, None, kwargs)
            got = layer.self_attn.masked_key_indices
            per_layer.append([] if got is None else torch.stack(got).T.tolist())
            layer.self_attn.masked_key_indices = None
        masks.append(per_layer)
    if masks[0] != masks[1]:
        raise AssertionError(f"the combined press with a recency scorer is not {plan}'s row")
    print(f"checked: {plan} + a recency scorer masks what {plan} alone masks")


def compressible(model: Any, layer: int) -> bool:
    """Whether a press compresses layer ``layer``: not a layer with its own sliding window
    (Gemma 3's local layers keep their window; kvpress skips them for Gemma 3)."""
    kinds = getattr(model.config, "layer_types", None)
    return not kinds or kinds[layer] != "sliding_attention"


def new_cache(model: Any) -> Any:
    """An empty cache laid out as the model's own (its sliding-window layers keep only
    their window: ``DynamicSlidingWindowLayer``)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def kept_fraction(model: Any, cache: Any, n_context: int) -> float:
    """Cache entries left after the prefill as a share of the model's own cache for the
    context (a sliding-window layer's own: its window): stored keys less those a per-head
    press masks (``masked_key_indices``, kvpress's attention patch)."""
    window = getattr(model.config, "sliding_window", None) or n_context
    total = own = 0
    for i, layer in enumerate(model.model.layers):
        keys = cache.layers[i].keys
        n = keys.shape[1] * keys.shape[2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        total += n - (len(masked[0]) if masked is not None else 0)
        own += keys.shape[1] * (n_context if compressible(model, i) else min(n_context, window - 1))
    return total / own


# presses whose ``__call__`` runs more than the one prefill (KVzip reconstructs the context):
# run as kvpress runs them, a prefill of their own per trial
OWN_PREFILL = {"KVzipPress"}


def capture(model: Any, ids: list[int], split: int) -> dict[int, tuple]:
    """One prefill of ``ids[:split]`` with the whole cache; per layer what a press's
    ``compress`` receives (its hidden states, the attention's keyword arguments, the keys
    and values). The prefill's hidden states do not depend on the press (kvpress compresses
    each layer's cache after the layer ran), so every press and ratio replays this one
    prefill: ``compress`` per layer, as ``BasePress.forward_hook`` calls it."""
    from kvpress.utils import extract_keys_and_values

    saved: dict[int, tuple] = {}

    def hook(module: Any, _args: Any, kwargs: dict, output: Any) -> Any:
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        saved[module.layer_idx] = (kwargs["hidden_states"], kwargs, keys, values)
        return output

    layers = model.model.layers
    hooks = [la.self_attn.register_forward_hook(hook, with_kwargs=True) for la in layers]
    try:
        cache = new_cache(model)
        model.model(input_ids=torch.tensor([ids[:split]]), past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    for i in saved:  # a sliding-window layer's own cache, replayed as it is
        if not compressible(model, i):
            saved[i] = (*saved[i], cache.layers[i])
    return saved


def replay(model: Any, press: Any, saved: dict[int, tuple]) -> Any:
    """The cache ``press`` leaves after the captured prefill (``None``: the whole cache).
    A layer with its own sliding window keeps its window uncompressed (a copy of the
    captured layer: its count of tokens seen places the window)."""
    import copy

    if press is not None:
        press.post_init_from_model(model)
    cache = new_cache(model)
    for i, layer in enumerate(model.model.layers):
        hidden, kwargs, keys, values = saved[i][:4]
        layer.self_attn.masked_key_indices = None  # what the patched attention does at prefill
        if not compressible(model, i):
            cache.layers[i] = copy.copy(saved[i][4])
            continue
        if press is not None:
            keys, values = press.compress(layer.self_attn, hidden, keys, values, None, kwargs)
        cache.update(keys, values, i)
    return cache


def tail_logits(model: Any, cache: Any, ids: list[int], split: int) -> tuple[torch.Tensor, float]:
    """``ids[split:]`` after the (compressed) cache of ``ids[:split]``, positions continuing
    from ``split`` (kvpress's pipeline); its logits and the kept fraction."""
    kept = kept_fraction(model, cache, split)
    tail = torch.tensor([ids[split:]])
    pos = torch.arange(split, split + tail.shape[1]).unsqueeze(0)
    glob = {la.keys.shape[2] for i, la in enumerate(cache.layers) if compressible(model, i)}
    # transformers builds one causal mask per kind of layer, from the first layer of that
    # kind, indexing keys by where they are stored; with sliding-window layers the query
    # positions count every token seen, so the global layers' stored length must be too
    sliding = not all(compressible(model, i) for i in range(len(cache.layers)))
    if len(glob) == 1 and (not sliding or glob == {split}):
        logits = model(input_ids=tail, past_key_values=cache, position_ids=pos).logits[0].float()
    else:  # layers of other lengths (PyramidKV): transformers builds one causal mask from
        # layer 0's length, so the tail goes a token at a time, as greedy decoding would
        steps = [
            model(
                input_ids=tail[:, j : j + 1], past_key_values=cache, position_ids=pos[:, j : j + 1]
            )
            .logits[0]
            .float()
            for j in range(tail.shape[1])
        ]
        logits = torch.cat(steps)
    for layer in model.model.layers:  # a per-head mask never outlives its cache
        layer.self_attn.masked_key_indices = None
    return logits, kept


def own_prefill(model: Any, press: Any, ids: list[int], split: int) -> Any:
    """kvpress's own path: ``with press(model): model.model(context, past_key_values=cache)``."""

    cache = new_cache(model)
    with press(model):
        model.model(input_ids=torch.tensor([ids[:split]]), past_key_values=cache)
    return cache


def score_needle(logits: torch.Tensor, t: dict) -> dict:
    """A trial is recalled when every answer token is the argmax (teacher-forced after the
    question: what greedy decoding answers; ``bench_kv_plans.py``'s ``exact``)."""
    import torch.nn.functional as F

    rel = torch.tensor(t["answer"]) - t["question"]
    target = torch.tensor(t["ids"])[torch.tensor(t["answer"])]
    pick = logits[rel - 1]
    nll = F.cross_entropy(pick, target, reduction="none")
    hit = pick.argmax(-1) == target
    return {"exact": float(hit.all()), "logprob": -float(nll.sum())}


def score_prose(logits: torch.Tensor, p: dict) -> dict:
    """The continuation's next-token NLL (its first token's prediction belongs to the
    context, which no press changes)."""
    import torch.nn.functional as F

    target = torch.tensor(p["ids"][p["split"] + 1 :])
    return {"nll_sum": float(F.cross_entropy(logits[:-1], target, reduction="sum")),
            "n": len(target)}  # fmt: skip


def summarise(cell: dict, data: dict) -> None:
    """A finished cell's recall, log-probability, perplexity and kept share."""
    trials, prose = cell["trials"], cell["prose"]
    if len(trials) < len(data["needle"]) or len(prose) < len(data["prose"]):
        return
    kept = [t["kept"] for t in trials + prose]
    cell.update(
        recall=sum(t["exact"] for t in trials) / len(trials),
        logprob=sum(t["logprob"] for t in trials) / len(trials),
        perplexity=math.exp(sum(p["nll_sum"] for p in prose) / sum(p["n"] for p in prose)),
        n_prose_tokens=sum(p["n"] for p in prose), kept=sum(kept) / len(kept),
    )  # fmt: skip


def peer(args: argparse.Namespace) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    data = json.loads(Path(args.data).read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        data["folder"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.config.name_or_path = data["folder"]  # KVzip reads the tokenizer from here
    for layer in model.model.layers:  # what a press's __call__ sets (ExpectedAttention reads it)
        layer.self_attn.rotary_emb = global_rotary(model)
    store_path = Path(args.store or HERE / f"kv_peers_{data['model']}.json")
    store = json.loads(store_path.read_text()) if store_path.exists() else {}
    store["model"] = data["model"]
    store.setdefault("machines", {})["kvpress"] = machine(None) | {"kvpress": "0.5.5"}
    ctx = store.setdefault(str(data["context"]), {"cells": {}})
    if ctx.get("data", data["data"]) != data["data"] and ctx["cells"]:
        ctx.setdefault("stale", {})[ctx["data"]] = ctx["cells"]
        ctx["cells"] = {}
    ctx.update(data=data["data"], needle_trials=len(data["needle"]), prose=len(data["prose"]),
               continuation=data["continuation"], plans=data["plans"], masked=data["masked"],
               corpus_repeats=data["corpus_repeats"],
               ratio_of=data.get("ratio_of", "the whole cache"))  # fmt: skip

    def save() -> None:  # this context only: runs at other contexts may share the file
        now = json.loads(store_path.read_text()) if store_path.exists() else {}
        now.update({k: v for k, v in store.items() if not k.isdigit()})
        now[str(data["context"])] = ctx
        tmp = store_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        tmp.replace(store_path)

    names = [s for s in args.presses.split(",") if s]
    if args.headmech:
        names += [f"headmech-{k}" for k in args.plans.split(",")
                  if any(p.startswith(f"{k}/") for p in data["plans"])]  # fmt: skip
        names += [f"headmech-{c}" for c in args.combine.split(",")
                  if c and any(p.startswith(c.split("+")[0] + "/") for p in data["plans"])]  # fmt: skip
    keys = ["full/0"] + [f"{n}/{r:g}" for n in names for r in _floats(args.ratios)]
    for key in keys:
        cell = ctx["cells"].get(key)
        if cell is None or (args.retry_errors and "error" in cell):
            ctx["cells"][key] = {"trials": [], "prose": [], "seconds": 0.0}
    # trial-outer: one prefill per trial, replayed for every cell that lacks the trial
    items = [("trials", i, t) for i, t in enumerate(data["needle"])]
    items += [("prose", i, p) for i, p in enumerate(data["prose"])]
    t_start, checked = time.perf_counter(), False
    with torch.inference_mode():
        for part, i, item in items:
            todo = [k for k in keys if "error" not in ctx["cells"][k]
                    and len(ctx["cells"][k][part]) == i]  # fmt: skip
            if not todo:
                continue
            if time.perf_counter() - t_start > args.max_seconds:
                print(f"stopping after {args.max_seconds:.0f}s; run again to continue")
                break
            split = item["question"] if part == "trials" else item["split"]
            t0 = time.perf_counter()
            saved = capture(model, item["ids"], split)
            prefill_s = time.perf_counter() - t0
            if not checked and any("+" in k for k in todo):
                check_combined(model, saved, data)
                checked = True
            for key in todo:
                name, ratio = key.rsplit("/", 1)
                cell = ctx["cells"][key]
                t1 = time.perf_counter()
                try:
                    press = None if name == "full" else make_press(name, float(ratio), data)
                    if name in OWN_PREFILL:
                        cache = own_prefill(model, press, item["ids"], split)
                    else:
                        cache = replay(model, press, saved)
                    logits, kept = tail_logits(model, cache, item["ids"], split)
                except Exception as e:  # a press that does not run here: its one-line error
                    msg = str(e).splitlines()[0] if str(e) else ""
                    ctx["cells"][key] = {"error": f"{type(e).__name__}: {msg}"}
                    print(f"{data['context']} {key:>34}: {ctx['cells'][key]['error']}")
                    continue
                score = (
                    score_needle(logits, item) if part == "trials" else score_prose(logits, item)
                )
                extra = {"depth": item["depth"]} if part == "trials" else {}
                cell[part].append(score | extra | {"kept": kept})
                cell["seconds"] += time.perf_counter() - t1
                cell["prefill_seconds"] = cell.get("prefill_seconds", 0.0) + prefill_s
                summarise(cell, data)
            del saved
            save()
            print(f"{data['context']} {part} {i}: {len(todo)} cells, prefill {prefill_s:.0f}s, "
                  f"all {time.perf_counter() - t0:.0f}s")  # fmt: skip
    for key in keys:
        cell = ctx["cells"][key]
        if "recall" in cell:
            print(f"{data['context']} {key:>34}: recall {cell['recall']:.2f} ppl "
                  f"{cell['perplexity']:7.3f} kept {cell['kept']:.3f} "
                  f"({cell['seconds']:.0f}s + shared prefills)")  # fmt: skip
    save()


# --- 3. the report ---------------------------------------------------------------------
def done(cell: dict) -> bool:
    return "recall" in cell


def best(rows: dict[float, dict], full: dict) -> float | None:
    """The largest ratio meeting both criteria."""
    ok = [r for r, c in rows.items() if done(c) and c["recall"] >= 0.95 * full["recall"]
          and c["perplexity"] <= 1.01 * full["perplexity"]]  # fmt: skip
    return max(ok) if ok else None


def _cell(c: dict | None, full: dict) -> str:
    if c is None:
        return "-"
    if "error" in c:
        return "error"
    if not done(c):
        return "unfinished"
    return f"{c['recall']:.2f} / {c['perplexity'] / full['perplexity'] - 1:+.1%}"


def head_to_head(model: str, context: int, methods: dict, full: dict) -> list[dict]:
    """Per ratio, headmech's rows (plans alone and combined) against the field at its best
    on each criterion: the most recall any press keeps and the least perplexity any press
    loses (often two presses). Which headmech rows match both, or else the best headmech
    row and what it loses. Printed and recorded."""
    rows = []
    for ratio in sorted({r for m in methods.values() for r in m}):

        def cells(mine: bool, ratio: float = ratio) -> list[tuple[str, dict]]:
            return [(n, m[ratio]) for n, m in methods.items() if ratio in m and done(m[ratio])
                    and n.startswith("headmech-") == mine]  # fmt: skip

        presses, ours = cells(False), cells(True)
        if not presses or not ours:
            continue
        recall = max(presses, key=lambda nc: (nc[1]["recall"], -nc[1]["perplexity"]))
        ppl = min(presses, key=lambda nc: (nc[1]["perplexity"], -nc[1]["recall"]))
        beat = [n for n, c in ours if c["recall"] >= recall[1]["recall"]
                and c["perplexity"] <= ppl[1]["perplexity"]]  # fmt: skip
        mine = min(ours, key=lambda nc: (-nc[1]["recall"], nc[1]["perplexity"]))
        text = (f"most recall of a press {recall[0]} {_cell(recall[1], full)}, least perplexity "
                f"{ppl[0]} {_cell(ppl[1], full)}; "
                + (f"headmech rows at least as good on both: {', '.join(beat)}" if beat else
                   f"no headmech row as good on both (best {mine[0]} {_cell(mine[1], full)})"))  # fmt: skip
        print(f"  ratio {ratio:g}: {text}")
        rows.append({
            "figure": "kv_peers",
            "what": f"headmech against the presses' best recall and best perplexity, {model}, "
            f"{context} tokens, ratio {ratio:g} ({1 / (1 - ratio):.2f}x)",
            "result": text, "target": "a headmech row with at least the presses' best recall "
            "and at most their best perplexity", "met": bool(beat),
            "values": {"model": model, "context": context, "ratio": ratio,
                       "best_recall_press": recall[0], "best_perplexity_press": ppl[0],
                       "beat": beat},
        })  # fmt: skip
    return rows


def report(args: argparse.Namespace) -> list[dict]:
    store_path = Path(args.store or HERE / f"kv_peers_{args.model}.json")
    store = json.loads(store_path.read_text())
    model, out = store["model"], []
    for context, ctx in sorted(((k, v) for k, v in store.items() if k.isdigit()),
                               key=lambda kv: int(kv[0])):  # fmt: skip
        full = ctx["cells"].get("full/0")
        if not full or not done(full):
            continue
        methods: dict[str, dict[float, dict]] = {}
        for key, cell in ctx["cells"].items():
            name, ratio = key.rsplit("/", 1)
            if name != "full":
                methods.setdefault(name, {})[float(ratio)] = cell
        ratios = sorted({r for m in methods.values() for r in m})
        print(f"\n{model}, {context} tokens ({ctx['needle_trials']} needle trials, {ctx['prose']} "
              f"prose continuations of {ctx['continuation']} tokens after the compressed rest); "
              f"full cache: recall {full['recall']:.2f}, perplexity {full['perplexity']:.3f}. "
              f"Ratio: of {ctx.get('ratio_of', 'the whole cache')}. "
              "Cells: recall / perplexity change (the measured kept share in the JSON)")  # fmt: skip
        print(
            "| method | "
            + " | ".join(f"{r:g}" for r in ratios)
            + " | largest ratio, both | s/cell |"
        )
        print("|---" * (len(ratios) + 3) + "|")
        for name, rows in methods.items():
            got = best(rows, full)
            secs = [c["seconds"] for c in rows.values() if done(c)]
            print(f"| {name} | " + " | ".join(_cell(rows.get(r), full) for r in ratios)
                  + f" | {'none' if got is None else got} | "
                  + (f"{sum(secs) / len(secs):.0f}" if secs else "-") + " |")  # fmt: skip
            errors = sorted({c["error"] for c in rows.values() if "error" in c})
            measured = {r: c for r, c in rows.items() if done(c)}
            cells = "; ".join(f"{r:g}: {_cell(rows[r], full)}" for r in sorted(rows))
            result = f"error: {errors[0]}" if errors and not measured else (
                f"{'none' if got is None else f'{got:g} ({1 / (1 - got):.2f}x)'} "
                f"(recall / perplexity change by ratio: {cells})")  # fmt: skip
            out.append({
                "figure": "kv_peers",
                "what": f"largest compression ratio with {CRITERIA}, {model}, {context} tokens, "
                f"{name} (kvpress protocol: context compressed, question after it; full cache "
                f"recall {full['recall']:.2f}, perplexity {full['perplexity']:.2f}"
                + (f"; ratio of {ctx['ratio_of']}" if "ratio_of" in ctx and ctx["ratio_of"]
                   != "the whole cache" else "") + ")",
                "result": result, "target": "", "met": None,
                "values": {"model": model, "context": int(context), "method": name, "best": got,
                           "full": {k: full[k] for k in ("recall", "perplexity")},
                           "cells": {f"{r:g}": {k: c[k] for k in ("recall", "perplexity", "kept",
                                                                 "logprob", "seconds")}
                                     for r, c in measured.items()}},
            })  # fmt: skip
        out += head_to_head(model, int(context), methods, full)
        masked = ctx.get("masked", {})
        shown = {f"{p}/{r:g}" for p in PLANS for r in ratios}
        if masked:
            print(f"  bench_kv_plans' masked evaluations ({masked['device']}; whole-sequence "
                  f"perplexity; the same trials: {masked['same_trials']}): " + ", ".join(
                      f"{k} {v['recall']:.2f} / {v['perplexity'] / masked['full']['perplexity'] - 1:+.1%}"
                      for k, v in sorted(masked.items()) if k in shown))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    ap.add_argument("--step", default="all", choices=("all", "prepare", "peer", "report"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--ratios", default=RATIOS)
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--no-headmech", dest="headmech", action="store_false",
                    help="no DuoAttention rows from headmech's plans")  # fmt: skip
    ap.add_argument("--plans", default=",".join(PLANS), help="headmech's plans (DuoAttention rows)")
    ap.add_argument("--combine", default=COMBINE,
                    help="plan+press rows: the plan's full heads, the press inside the others' "
                    "budget (issue 48, item 2)")  # fmt: skip
    ap.add_argument("--continuation", type=int, default=512, help="prose tokens scored")
    ap.add_argument("--seeds", default="0,1,2", help="held-out needle seeds (bench_kv_plans)")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--prose", type=int, default=2)
    ap.add_argument("--data", default=None, help="the prepared trials (JSON)")
    ap.add_argument("--store", default=None, help="default benchmarks/kv_peers_<model>.json")
    ap.add_argument("--max-seconds", type=float, default=float("inf"))
    ap.add_argument("--retry-errors", action="store_true")
    args = ap.parse_args()
    start(args)
    args.data = args.data or str(default_data(args.model, args.context))
    if args.step == "peer":
        peer(args)
        return
    if args.step in ("all", "prepare"):
        prepare(args)
    if args.step == "all":
        if not PEER_PY.exists():
            print(f"{PEER_PY} is missing (make kv-peers-env): the kvpress peer is skipped")
            return
        cmd = [str(PEER_PY), __file__, "--step", "peer", "--model", args.model,
               "--context", str(args.context), "--ratios", args.ratios, "--presses",
               args.presses, "--data", args.data, "--max-seconds", str(args.max_seconds)]  # fmt: skip
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--store", args.store] if args.store else []
        cmd += (
            ["--plans", args.plans, "--combine", args.combine]
            if args.headmech
            else ["--no-headmech"]
        )
        subprocess.run(cmd, check=True)
    if args.step in ("all", "report"):
        from common import record

        rows = report(args)
        store = json.loads(Path(args.store or HERE / f"kv_peers_{args.model}.json").read_text())
        name = f"bench_kv_peers {store['model']}"
        record(name, None, rows, store.get("machines", {}).get("kvpress"))


if __name__ == "__main__":
    main()
