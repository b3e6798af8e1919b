"""Pattern-free statistics (inside the model's attention call, or patterns rebuilt from q
and k in blocks of query rows) equal the model's own pattern, on every bundled model and
on tiny GPT-2, LLaMA (grouped-query) and BERT models."""

from __future__ import annotations

import warnings

import pytest
import torch

import headmech
from headmech.core.errors import InputError
from headmech.interventions import Intervention, Set, applied
from headmech.probes import ProbeOptions, build_probe
from headmech.stream import blockwise, engine
from headmech.stream.engine import stream_statistics
from headmech.testing.planting import ideal_pattern

SMALL = ProbeOptions(
    n_sentences=12, n_sequences=4, half_len=12, needle_lengths=(120,), needle_depths=(0.5,)
)


def _types(model):
    causal = model.cfg.attention_dir == "causal"
    out = [headmech.get_head_type(t)() for t in headmech.head_types()]
    out = [t for t in out if (causal or not t.causal_only) and t.reducers()]  # attention types
    # the needle probe needs a few hundred tokens of context (tiny models have 64)
    out = [t for t in out if t.probe != "needle" or model.cfg.n_ctx >= 256]
    return [t for t in out if _fits(t.probe, model)]


def _fits(probe: str, model) -> bool:
    """Whether the probe can be built for the model's tokenizer (the toy's byte-level
    vocabulary has no single-token names for IOI prompts, no words for in-context tasks)."""
    try:
        build_probe(probe, model, SMALL)
    except InputError:
        return False
    return True


def assert_paths_agree(model, options=SMALL, budget=2**14, rtol=1e-5, probes=None):
    """Every statistic of every type (of the types measured on ``probes``, if given),
    pattern path vs blocks (a small block budget, so several blocks per layer), means and
    per-sequence sums (to ``1e-4 + rtol`` times the value)."""
    by_probe: dict[str, list] = {}
    for t in _types(model):
        if probes is None or t.probe in probes:
            by_probe.setdefault(t.probe, []).append(t)
    checked = 0
    for probe, types in by_probe.items():
        batches = build_probe(probe, model, options).batches
        reducers = [r for t in types for r in t.reducers()]
        a = stream_statistics(model, batches, reducers, attention="pattern")
        b = stream_statistics(model, batches, reducers, attention="blocks", block_memory=budget)
        assert sorted(a.sums) == sorted(b.sums)
        for k in a.sums:
            torch.testing.assert_close(b.counts[k], a.counts[k], atol=1e-9, rtol=0, msg=k)
            ua, ub = a.units(k), b.units(k)
            assert (ua is None) == (ub is None), k
            if k.endswith(".hit"):
                # an argmax: where a row's two largest weights tie to rounding, the two
                # paths' summation orders may pick different keys (seen on an AVX-512 CPU:
                # 1 of SmolLM2's 258 rows of one head; on another, one thread a worker, 2
                # of one 21-row sequence, L3H5 of the inactive probe, whose two largest
                # weights differ by 0 and 2.4e-6 relative); a wrong hit rule moves many rows
                _assert_few_flips(b.sums[k], a.sums[k], a.counts[k], k)
                if ua is not None and ub is not None:
                    _assert_few_flips(ub[0], ua[0], ua[1], k)
            else:
                torch.testing.assert_close(b.sums[k], a.sums[k], atol=1e-4, rtol=rtol, msg=k)
                if ua is not None and ub is not None:
                    torch.testing.assert_close(ub[0], ua[0], atol=1e-4, rtol=rtol, msg=k)
            checked += 1
    assert checked > 10


def _assert_few_flips(got, want, rows, what: str) -> None:
    """Hit counts equal up to rare argmax flips: every count differs by whole rows, and by
    at most 1 row in 100 (and at least 2) of the rows counted."""
    diff = (got - want).abs()
    assert torch.allclose(diff, diff.round(), atol=1e-6), what
    allowed = torch.clamp(0.01 * torch.as_tensor(rows, dtype=diff.dtype), min=2.0)
    assert bool((diff <= allowed).all()), (what, float(diff.max()))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_tiny_models_blocks_equal_pattern(tiny_models, name):
    assert_paths_agree(tiny_models[name])


def test_toy_induction_blocks_equal_pattern():
    assert_paths_agree(headmech.load_model("toy-induction"))


@pytest.mark.slow
def test_smollm2_blocks_equal_pattern(smollm2):
    assert engine._pattern_free(smollm2) == ("call", None)
    assert_paths_agree(smollm2, budget=2**20)


@pytest.mark.slow
def test_gemma3_blocks_equal_pattern(gemma3):
    """Sliding windows in 15 of 18 layers, q/k norms, one KV head: inside the attention
    call, every statistic of every type equals the eager pattern's."""
    assert engine._pattern_free(gemma3) == ("call", None)
    assert_paths_agree(gemma3, budget=2**20)


@pytest.mark.slow
def test_minilm_blocks_equal_pattern(minilm):
    assert_paths_agree(minilm, budget=2**18)


def test_rows_equal_run_with_cache_pattern(tiny_models):
    """A block of rebuilt rows is the cached ``hook_pattern`` (grouped-query LLaMA, a
    padded sequence)."""
    model = tiny_models["llama"]
    geom = blockwise.geometry(model)
    assert isinstance(geom, blockwise.Geometry) and geom.n_kv_heads == 2 < geom.n_heads
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    _, cache = model.run_with_cache(ids, attention_mask=mask)
    store: dict[int, object] = {}
    with blockwise.capture_rotary(model, [1], store):
        model(ids, attention_mask=mask, return_type=None)
    q, k = blockwise.rotate(
        cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_k"], store[1], geom
    )
    rows = slice(5, 12)
    got = blockwise.pattern_rows(q, k, mask.bool(), geom, 1, rows)
    want = cache["blocks.1.attn.hook_pattern"][:, :, rows]
    assert got.shape[-1] == 12  # causal: keys after the last query (11) are left out
    assert float(want[..., 12:].abs().max()) == 0.0
    torch.testing.assert_close(got[0], want[0, ..., :12], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1, ..., :12], atol=1e-6, rtol=1e-5)


def test_rows_per_block_follows_the_budget():
    per_row = 2 * 9 * 8192 * 16  # two sequences, 9 heads, 8k keys, 16 bytes per entry
    assert blockwise.rows_per_block(2, 9, 8192, 256 * 2**20) == 256 * 2**20 // per_row
    assert blockwise.rows_per_block(2, 9, 8192, 1) == 1
    assert blockwise.rows_per_block(1, 1, 10, 2**30) == 10


def test_pattern_interventions_keep_the_real_pattern(tiny_models):
    """A hook on the pattern (a planted head) must be seen: auto uses the model's pattern,
    and asking for blocks is refused."""
    model = tiny_models["llama"]
    t = headmech.get_head_type("previous_token")()
    (batch,) = build_probe(t.probe, model, ProbeOptions(n_sentences=4, batch_size=4)).batches
    planted = Intervention.on(
        [headmech.HeadIndex(1, 2)], Set(ideal_pattern(t, batch)[:, None]), site="pattern"
    )
    with applied(model, [planted], strict=False):
        s = stream_statistics(model, [batch], t.reducers())
        assert float(s.mean("previous_token.mass")[1, 2]) == pytest.approx(1.0, abs=1e-6)
        with pytest.raises(ValueError, match="hook reads or edits the pattern"):
            stream_statistics(model, [batch], t.reducers(), attention="blocks")


def test_a_wrong_geometry_is_caught_and_falls_back(tiny_models, monkeypatch):
    """The check on a short input notices a geometry that does not reproduce the model's
    pattern (here a wrong scale): auto warns and uses the pattern path."""
    model = tiny_models["gpt2"]
    right = blockwise.geometry(model)
    assert isinstance(right, blockwise.Geometry)
    wrong = blockwise.Geometry(
        right.n_heads, right.n_kv_heads, right.causal, tuple(2 * s for s in right.scales), None
    )
    monkeypatch.setattr(blockwise, "geometry", lambda m: wrong)
    monkeypatch.setattr(engine, "_CHECKED", type(engine._CHECKED)())
    with pytest.warns(UserWarning, match="differs from the model's"):
        mode, _ = engine._choose(model, headmech.get_head_type("induction")().reducers(), "auto")
    assert mode == "pattern"


def test_unsupported_attention_is_named(tiny_models, monkeypatch):
    """A rotary decoder reduces inside its attention call whatever its config says (a
    sliding window is in the mask the call receives); where that call cannot be reached,
    the geometry rebuilt from q and k names what it does not reproduce, auto falls back
    to the pattern in silence and ``attention="blocks"`` refuses in one line naming both."""
    from headmech.stream import attention_call

    model = tiny_models["llama"]
    hf = model.blocks[0].attn.original_component
    monkeypatch.setattr(hf.config, "sliding_window", 16, raising=False)
    reducers = headmech.get_head_type("induction")().reducers()
    assert engine._pattern_free(model) == ("call", None)
    assert blockwise.geometry(model) == "sliding-window attention"
    monkeypatch.setattr(attention_call, "possible", lambda m: "no attention call here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mode, _ = engine._choose(model, reducers, "auto")
    assert mode == "pattern"
    with pytest.raises(ValueError, match="no attention call here, and sliding-window attention"):
        engine._choose(model, reducers, "blocks")


def _previous_token_mass_by_hand(model, batches, pattern_dtype=None, sum_dtype=torch.float64):
    """Mean attention on the previous token per head, from the model's own (bf16) q, k,
    cos and sin (TransformerLens hooks) upcast to fp32: rotary embeddings, grouped-query
    heads, causal and padding masks and softmax written out here. ``pattern_dtype`` rounds
    the pattern (bf16: the model's own pattern), ``sum_dtype`` accumulates the sums."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    sums, n = torch.zeros(n_layers, n_heads, dtype=sum_dtype), 0
    for b in batches:
        real = b.attention_mask.bool()
        has = real & ~b.special  # queries whose previous token is real and not special
        has[:, 0] = False
        has[:, 1:] &= real[:, :-1] & ~b.special[:, :-1]
        n += int(has.sum())
        with torch.no_grad():
            _, cache = model.run_with_cache(b.input_ids, attention_mask=b.attention_mask)
        for la in range(n_layers):
            hook = f"blocks.{la}.attn.hook_"
            q, k = cache[hook + "q"].float(), cache[hook + "k"].float()  # [batch, pos, head, d]
            cos, sin = (cache[hook + x].float()[:, :, None] for x in ("cos", "sin"))
            d = q.shape[-1]

            def rotate(x, cos=cos, sin=sin, d=d):
                return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

            q, k = rotate(q), rotate(k).repeat_interleave(n_heads // k.shape[2], dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d**0.5
            t = scores.shape[-1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            visible = causal[None, None] & real[:, None, None, :]
            pattern = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            if pattern_dtype is not None:
                pattern = pattern.to(pattern_dtype).float()
            prev = pattern.diagonal(offset=-1, dim1=-2, dim2=-1)  # [batch, head, pos - 1]
            for row, query in has[:, 1:].nonzero().tolist():  # one addition per query
                sums[la] += prev[row, :, query].to(sum_dtype)
    return sums.double() / n


def test_blocks_with_bf16_accumulate_in_fp32(tiny_dirs):
    """A bf16 model's rebuilt rows are fp32, and its statistic is the fp32 computation on
    its bf16 q and k (by hand) to 1e-5; the pattern rounded to bf16 lands at least 5 times
    further away than the engine, the sums accumulated in bf16 50 times the bound."""
    from headmech.stream.engine import Reducer

    m16 = headmech.load_model(str(tiny_dirs["llama"]), dtype="bfloat16")
    t = headmech.get_head_type("previous_token")()
    batches = build_probe(t.probe, m16, ProbeOptions(n_sentences=8, batch_size=4)).batches
    dtypes = set()

    def spy(block, batch, prepared, layer, rows):
        dtypes.add(block.dtype)
        return {}

    reducers = [*t.reducers(), Reducer("spy", spy, blockwise=True)]
    got = stream_statistics(m16, batches, reducers, attention="blocks")
    got = got.mean("previous_token.mass").double()
    assert dtypes == {torch.float32}
    want = _previous_token_mass_by_hand(m16, batches)
    # measured (the mass itself up to 0.12): 6.5e-7 on the CPU that set the first bound,
    # 3.0e-6 on an AVX2-only AMD EPYC (its bf16 kernels round differently)
    err = float((got - want).abs().max())
    assert err < 1e-5
    # measured: 2.6e-5 with the pattern rounded to bf16, 8e-4 with sums in bf16 (both CPUs)
    bf16_pattern = _previous_token_mass_by_hand(m16, batches, pattern_dtype=torch.bfloat16)
    bf16_sums = _previous_token_mass_by_hand(m16, batches, sum_dtype=torch.bfloat16)
    assert float((bf16_pattern - want).abs().max()) > 5 * err
    assert float((bf16_sums - want).abs().max()) > 50 * 1e-5


@pytest.mark.slow
def test_blocks_run_inside_the_attention_call(smollm2, monkeypatch):
    """In the pattern-free path SmolLM2 attends through headmech's attention function
    (the fused kernel, every layer), no hook reads the pattern, and hook_z reducers still
    run."""
    from headmech.stream import attention_call

    calls, fired = [], []
    real = attention_call.stats_attention

    def spy_call(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return real(module, *args, **kwargs)

    def spy(z, batch, prepared, layer):
        fired.append(layer)
        return {}

    monkeypatch.setattr(attention_call, "stats_attention", spy_call)
    t = headmech.get_head_type("induction")()
    batches = build_probe(t.probe, smollm2, ProbeOptions(n_sequences=2, half_len=8)).batches
    reducers = [*t.reducers(), engine.Reducer("spy", spy, hook="hook_z")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer runs eager
        stream_statistics(smollm2, batches, reducers, attention="blocks")
    assert sorted(set(calls)) == list(range(smollm2.cfg.n_layers))
    assert sorted(set(fired)) == list(range(smollm2.cfg.n_layers))
    assert not engine.pattern_hooked(smollm2)


def test_conformance_catches_a_reducer_that_ignores_its_rows(tiny_models):
    """check_blocks_add_up fails a blockwise reducer that reads its prepared data as if
    every block started at query 0."""
    from headmech.stream.engine import Reducer
    from headmech.testing import check_blocks_add_up

    base = headmech.get_head_type("previous_token")

    class Broken(base):  # type: ignore[misc, valid-type]
        def reducers(self):
            (r,) = super().reducers()

            def fn(pattern, batch, prepared, layer, rows):
                return r.fn(pattern, batch, prepared, layer, slice(0, pattern.shape[-2]))

            return [Reducer(r.name, fn, r.prepare, blockwise=True)]

    check_blocks_add_up(base(), tiny_models["llama"])
    with pytest.raises(AssertionError, match="summed over blocks differs"):
        check_blocks_add_up(Broken(), tiny_models["llama"])


def test_top1_equals_torch_max_with_ties_and_masks():
    """Row maxima read from views (a run of keys, then key 0) equal ``torch.max`` on the
    masked pattern, ties to the first index included."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.rand(3, 2, 5, 9, generator=g).round(decimals=1)  # many ties
    pattern[0, :, :, 0] = pattern[0].amax(-1)  # key 0 ties the row maximum
    runs = torch.zeros(3, 9, dtype=torch.bool)
    runs[0, 1:], runs[1, 1:6], runs[2, 2:9] = True, True, True
    scattered = runs.clone()
    scattered[2, 4] = False
    for keys in (None, runs, scattered):
        blockwise.forget()
        values, indices = blockwise.top1(pattern, keys)
        ref = pattern if keys is None else pattern.masked_fill(~keys[:, None, None], -1.0)
        want = ref.max(-1)
        assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
        assert blockwise.top1(pattern, keys)[1] is indices  # computed once per block
    blockwise.forget()
