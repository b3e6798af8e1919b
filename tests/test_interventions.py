"""The intervention layer's runner: prefix reuse, fused attention and chunking change the
cost, not the numbers (against whole eager forward passes, one variant at a time)."""

from __future__ import annotations

import pytest
import torch

import headmech
from headmech.core.errors import HeadIndexError
from headmech.core.head_index import HeadIndex
from headmech.core.stats import ProbeBatch
from headmech.interventions import (
    Cost,
    Intervention,
    Patch,
    Zero,
    applied,
    capture_z,
    run_variants,
)
from headmech.interventions.ablation import ablation, ablation_hooks, ablation_variants
from headmech.interventions.runner import CPU_ACTIVATION_BYTES, MAX_CHUNK, chunk_size
from headmech.probes import ProbeOptions
from headmech.stream.forward import block_inputs, fast_attention, run_blocks, starting_at
from headmech.tasks import get_task

SMALL = ProbeOptions(n_sentences=8, n_sequences=4, half_len=8, batch_size=4)
SETS = [[(la, h)] for la in range(2) for h in range(4)] + [[(0, 1), (1, 2)], [(1, 3), (0, 0)], []]


# model -> (attention output projections' scale, final norm's scale): head interventions
# move the metrics well above float error (the final norm's scale sharpens the logits)
LOUD = {"llama": (10.0, 100.0), "gpt2": (10.0, 100.0), "bert": (100.0, 1.0)}


@pytest.fixture(scope="module")
def loud_models(tiny_dirs):
    """Fresh copies of the tiny models with every attention block's output projection
    (LLaMA ``o_proj``, GPT-2 ``c_proj``, BERT ``output.dense``) and the decoders' final
    norm scaled up (:data:`LOUD`): in the random models a head moves the metric by 1e-6 to
    1e-4, near float error; here every intervention set moves it by more than 1e-3."""
    out = {}
    for kind, (attn, final) in LOUD.items():
        model = headmech.load_model(str(tiny_dirs[kind]))
        with torch.no_grad():
            for block in model.blocks:
                hf = block.attn.original_component
                proj = getattr(hf, "o_proj", None) or getattr(hf, "c_proj", None)
                proj = proj if proj is not None else hf.output.dense
                proj.weight.mul_(attn)
            if final != 1.0:
                model.ln_final.original_component.weight.mul_(final)
        out[kind] = model
    return out


@pytest.mark.parametrize(
    ("kind", "task_name", "mode"),
    [
        ("llama", "induction", "zero"),
        ("llama", "induction", "mean"),
        ("llama", "lm", "resample"),
        ("llama", "induction", "uniform"),
        ("gpt2", "induction", "zero"),
        ("gpt2", "lm", "mean"),
        ("bert", "lm", "zero"),
        ("bert", "lm", "resample"),
    ],
)
def test_fast_runner_equals_whole_eager_passes(loud_models, kind, task_name, mode):
    """Each variant's metric from the fast runner (stacked copies, prefix reuse, fused
    attention, chunks of 3) is the metric of a whole eager forward with that set alone, to
    1% of the set's effect (a runner that dropped or misplaced interventions is off by up
    to 100%), on models where every set has an effect above 1e-3."""
    model = loud_models[kind]
    task = get_task(task_name, model)
    batches = task.batches(model, SMALL)
    fast, clean_fast = run_variants(
        model, task, batches, ablation_variants(model, batches, SETS, mode), chunk=3
    )
    # reference: every set on its own, a whole eager forward each (TransformerLens hooks)
    refs = [task.reference(model, b) for b in batches]

    def eager(variant) -> float:  # variant(batch_index, batch)[0]: the set's interventions
        total = n = 0.0
        for bi, b in enumerate(batches):
            with torch.no_grad(), applied(model, variant(bi, b)[0]):
                v, c = task.metric(model, b, reference=refs[bi])
            total, n = total + float(v.sum()), n + float(c.sum())
        return total / n

    clean = eager(lambda bi, b: [[]])
    slow = torch.tensor([eager(ablation_variants(model, batches, [s], mode)) for s in SETS])
    effect = (slow - clean).abs()
    assert float(effect[:-1].min()) > 1e-3, effect  # every set does something
    assert float(effect[-1]) == 0.0  # the empty set is the clean run
    bound = 0.01 * effect + 1e-5  # 1% of the effect; float error (metrics ~50) is 1e-5
    assert bool(((fast - slow).abs() <= bound).all()), (fast - slow, effect)
    assert clean_fast == pytest.approx(clean, abs=1e-5)
    assert fast[-1] == pytest.approx(clean_fast, abs=1e-6)


def test_chunks_start_at_their_first_layer(tiny_models):
    """A chunk of layer-1 ablations never runs block 0 again; without the prefix reuse it
    does, once per chunk."""
    model = tiny_models["llama"]
    task = get_task("induction", model)
    batches = task.batches(model, SMALL)[:1]
    seen: dict[int, list[int]] = {0: [], 1: []}
    handles = [
        model.blocks[la].register_forward_pre_hook(
            lambda m, a, la=la: seen[la].append(int(a[0].shape[0]))
        )
        for la in (0, 1)
    ]
    try:
        sets = [[(1, h)] for h in range(4)]
        cost = Cost(sequences=4)
        run_variants(
            model, task, batches, ablation_variants(model, batches, sets), chunk=4, cost=cost
        )
        assert seen == {0: [4], 1: [4, 16]}
        assert cost.forward_equivalents == pytest.approx(1 + 4 * 0.5)  # clean + 4 half-runs
        seen[0].clear(), seen[1].clear()
        run_variants(
            model,
            task,
            batches,
            ablation_variants(model, batches, sets),
            chunk=4,
            reuse_prefix=False,
        )
        assert seen == {0: [4, 16], 1: [4, 16]}
    finally:
        for h in handles:
            h.remove()


def test_last_position_edits_run_one_row_and_equal_the_full_replays(loud_models):
    """Edits of the last token's head outputs, read by a task that scores only the last
    token (the in-context answer), run the blocks above the edit at that row alone, on the
    clean run's keys and values: every block from the edit's layer up receives one row per
    sequence, and each variant's metric equals the full replay's to float error. An edit
    at every position, or a task that reads other positions, replays the whole sequence."""
    from unittest import mock

    import headmech.interventions.runner as runner
    from headmech.interventions import Set
    from headmech.probes import build_probe
    from headmech.tasks.data import icl_task

    model = loud_models["llama"]
    batch = build_probe("icl", model, ProbeOptions(n_sequences=4, batch_size=4)).batches[0]
    n_pos = int(batch.input_ids.shape[1])
    task = icl_task()  # the answer's loss (its probability is ~1e-18 in the random model)
    value = torch.randn(4, 1, 1, int(model.cfg.d_head))  # heads first: [batch, 1, pos, d_head]
    last = [[Intervention.on([(la, h)], Set(value), "z", pos=-1)] for la in (0, 1) for h in (0, 3)]
    everywhere = [[Intervention.on([(1, 2)], Set(value), "z")]]
    rows: list[int] = []
    hook = model.blocks[1].register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1]))
    try:
        cost = Cost(sequences=4)
        tail, clean = run_variants(model, task, [batch], last, chunk=2, cost=cost)
        assert rows == [
            n_pos,
            n_pos,
            1,
        ]  # clean run, layer-0 chunk (whole: from block 0), then one row
        # the layer-1 chunk ran half the model at one of n_pos rows
        assert cost.forward_equivalents == pytest.approx(1 + 2 + 2 * 0.5 / n_pos)
        rows.clear()
        with mock.patch.object(runner, "_last_position_only", lambda batch, variants: False):
            full, clean_full = run_variants(model, task, [batch], last, chunk=2)
        assert rows == [n_pos, n_pos, n_pos]
        torch.testing.assert_close(tail, full, atol=1e-5, rtol=1e-6)
        assert float((tail - clean).abs().min()) > 1e-3  # every edit moved the answer
        rows.clear()
        run_variants(model, task, [batch], everywhere)
        assert rows == [n_pos, n_pos]
        rows.clear()
        lm = get_task("induction", model)
        run_variants(model, lm, lm.batches(model, SMALL)[:1], last[2:])
        assert 1 not in rows
    finally:
        hook.remove()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_replayed_suffix_equals_the_whole_model(tiny_models, kind):
    """Blocks 1.. replayed from the recorded input, for the batch stacked 3 times, give the
    whole model's output (padding included)."""
    model = tiny_models[kind]
    ids = torch.randint(5, 300, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        with block_inputs(model, [1]) as record:
            whole = run_blocks(model, ids, mask)
        with starting_at(record, 1):
            replayed = run_blocks(model, ids.repeat(3, 1), mask.repeat(3, 1))
    real = mask.bool()
    for c in range(3):
        torch.testing.assert_close(
            replayed[2 * c : 2 * c + 2][real], whole[real], atol=1e-5, rtol=0
        )


def test_fast_attention_equals_eager_and_steps_aside_for_pattern_hooks(tiny_models):
    model = tiny_models["llama"]
    ids = torch.randint(5, 300, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    zero = [Intervention.on([(1, 2), (0, 3)], Zero())]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(1)
        return sdpa(*a, **k)

    with torch.no_grad():
        eager = run_blocks(model, ids, mask)
        with applied(model, zero):
            eager_z = run_blocks(model, ids, mask)
        torch.nn.functional.scaled_dot_product_attention = counting
        try:
            with fast_attention(model) as on:
                fused = run_blocks(model, ids, mask)
                with applied(model, zero):
                    fused_z = run_blocks(model, ids, mask)
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        assert on and len(calls) == 2 * int(model.cfg.n_layers)
        pattern_hook = [("blocks.0.attn.hook_pattern", lambda x, hook: None)]
        with model.hooks(fwd_hooks=pattern_hook), fast_attention(model) as on_with_pattern_hook:
            pass
    assert not on_with_pattern_hook
    real = mask.bool()
    torch.testing.assert_close(fused[real], eager[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused_z[real], eager_z[real], atol=1e-5, rtol=0)
    assert not torch.allclose(eager_z[real], eager[real])
    assert not fast_attention_possible_on(tiny_models["gpt2"])  # eager there: no HF delegation


def fast_attention_possible_on(model):
    from headmech.stream.forward import fast_attention_possible

    return fast_attention_possible(model)


def test_chunk_size_follows_the_memory_budget(tiny_models):
    model = tiny_models["llama"]
    batch = get_task("induction", model).batches(model, SMALL)[0]
    sizes = [chunk_size(model, batch, budget) for budget in (1, 1 << 16, 1 << 20, 1 << 40)]
    assert sizes[0] == 1 and sizes[-1] == MAX_CHUNK
    assert sizes == sorted(sizes) and len(set(sizes)) > 2


def test_cpu_chunks_keep_each_activation_small(tiny_models):
    """On the CPU no budget stacks copies past CPU_ACTIVATION_BYTES for the largest
    activation (the MLP's hidden layer or the scores): big batches run one copy at a time."""
    model = tiny_models["llama"]
    d_mlp = int(model.cfg.d_mlp)

    def batch(n_seq, n_pos):
        ids = torch.ones(n_seq, n_pos, dtype=torch.long)
        return ProbeBatch(ids, torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool))

    for n_seq, n_pos in ((16, 65), (64, 512), (2, 4096)):
        k = chunk_size(model, batch(n_seq, n_pos), budget=1 << 50)
        largest = n_seq * n_pos * max(d_mlp, int(model.cfg.n_heads) * n_pos) * 4
        assert k == max(1, min(MAX_CHUNK, CPU_ACTIVATION_BYTES // largest))
        # passes at the last position alone hold one query row per sequence
        last = chunk_size(model, batch(n_seq, n_pos), budget=1 << 50, last_row=True)
        largest = n_seq * max(d_mlp, int(model.cfg.n_heads) * n_pos) * 4
        assert last == max(1, min(MAX_CHUNK, CPU_ACTIVATION_BYTES // largest))
    assert chunk_size(model, batch(64, 512), budget=1 << 50) == 1
    assert chunk_size(model, batch(64, 512), budget=1 << 50, last_row=True) == 16  # not 1


def test_tiled_token_losses_equal_cross_entropy_of_the_full_logits(tiny_models, monkeypatch):
    """Loss tiles (rows x vocabulary slices, targets in every tile and at tile edges) give
    F.cross_entropy of the whole logits, and the same gradient."""
    import headmech.models.unembedding as unembedding

    model = tiny_models["llama"]
    monkeypatch.setattr(unembedding, "LOSS_ROWS", 7)  # several row chunks, one ragged
    monkeypatch.setattr(unembedding, "VOCAB_TILE", 5000)
    d_vocab, tile = int(model.cfg.d_vocab), unembedding.VOCAB_TILE
    assert d_vocab > 3 * tile and d_vocab % tile  # several vocabulary tiles, a ragged last
    edges = torch.tensor([0, tile - 1, tile, 2 * tile + 5, d_vocab - 1])
    target = torch.cat([edges, torch.randint(0, d_vocab, (13,))])  # [18]
    resid = (3 * torch.randn(len(target), int(model.cfg.d_model))).requires_grad_()
    tiled = unembedding.token_losses(model, resid, target)
    (g_tiled,) = torch.autograd.grad(tiled.sum(), resid)
    full = torch.nn.functional.cross_entropy(
        unembedding.unembed(model, resid).float(), target, reduction="none"
    )
    (g_full,) = torch.autograd.grad(full.sum(), resid)
    torch.testing.assert_close(tiled, full, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(g_tiled, g_full, atol=1e-6, rtol=1e-5)


def test_rows_run_the_last_mlp_only_where_read(tiny_models):
    """run_blocks(rows=...): the last block's MLP sees only those rows, the output there is
    the whole model's (values and gradients), and a hook on that MLP turns it off."""
    model = tiny_models["llama"]
    ids = torch.randint(5, 300, (3, 9))
    mask = torch.ones_like(ids)
    rows = torch.zeros_like(ids, dtype=torch.bool)
    rows[:, 4:7] = True
    hf_mlp = model.blocks[-1].mlp.original_component
    seen = []
    run = type(hf_mlp).forward
    hf_mlp.__dict__["forward"] = lambda x: (seen.append(x.shape[:-1].numel()), run(hf_mlp, x))[1]
    try:
        whole = run_blocks(model, ids, mask)
        assert seen == [27]
        seen.clear()
        part = run_blocks(model, ids, mask, rows=rows)
        assert seen == [9]
        torch.testing.assert_close(part[rows], whole[rows], atol=1e-6, rtol=0)
        (g_part,) = torch.autograd.grad(part[rows].square().sum(), model.W_E)
        (g_whole,) = torch.autograd.grad(whole[rows].square().sum(), model.W_E)
        torch.testing.assert_close(g_part, g_whole, atol=1e-6, rtol=1e-5)
        seen.clear()
        watch = [(f"blocks.{int(model.cfg.n_layers) - 1}.mlp.hook_out", lambda x, hook: None)]
        with model.hooks(fwd_hooks=watch):
            run_blocks(model, ids, mask, rows=rows)
        assert seen == [27]  # a hook on the MLP sees every row
    finally:
        hf_mlp.__dict__.pop("forward")


def test_position_patch_touches_one_position_only(tiny_models):
    model = tiny_models["gpt2"]
    task = get_task("induction", model)
    batch = task.batches(model, SMALL)[0]
    source = capture_z(model, batch) + 1.0  # [n_layers, batch, pos, n_heads, d_head]
    seen = {}

    def grab(z, hook):
        seen["z"] = z.detach().clone()

    patch = [Intervention.on([(1, 2)], Patch(source), pos=3)]
    with (
        torch.no_grad(),
        applied(model, patch),
        model.hooks(fwd_hooks=[("blocks.1.attn.hook_z", grab)]),
    ):
        run_blocks(model, batch.input_ids, batch.attention_mask)
    clean = capture_z(model, batch)[1]
    z = seen["z"]  # [batch, pos, n_heads, d_head]; the grab hook runs after the patch
    torch.testing.assert_close(z[:, 3, 2], source[1, :, 3, 2])
    other = torch.ones_like(z, dtype=torch.bool)
    other[:, 3, 2] = False
    torch.testing.assert_close(z[other], clean[other])


@pytest.mark.slow
def test_smollm2_fast_zero_ablation_equals_the_full_runs(smollm2):
    """On the real model (grouped-query attention, 30 layers): heads of the first, a middle
    (two induction heads) and the last layer, fast runner against whole eager forwards, to
    1e-4 (heads of every KV group of layers 0 and 29: the prefix reuse starts at each end)."""
    task = get_task("induction", smollm2)
    batches = task.batches(smollm2, ProbeOptions(n_sequences=4, half_len=16, batch_size=4))
    sets = [[(la, h)] for la in (0, 29) for h in (0, 4, 8)] + [[(17, 3)], [(17, 4)]]
    fast, clean = run_variants(smollm2, task, batches, ablation_variants(smollm2, batches, sets))
    slow, clean_slow = run_variants(
        smollm2,
        task,
        batches,
        ablation_variants(smollm2, batches, sets),
        reuse_prefix=False,
        fast=False,
        chunk=8,
    )
    assert clean == pytest.approx(clean_slow, abs=1e-4)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=0)
    assert float((fast - clean).max()) > 0.05  # some of these heads matter


def test_heads_are_named_as_on_the_command_line_everywhere(tiny_models):
    """A head is ``"L18H6"`` (as the command line and catalog.json write it), a
    ``(layer, head)`` pair or a HeadIndex wherever it enters the API; a malformed name is a
    one-line error naming the form."""
    want = (HeadIndex(1, 2), HeadIndex(0, 3))
    assert Intervention.on(["L1H2", (0, 3)], Zero()).heads == want
    assert Intervention.on([HeadIndex(1, 2), "l0h3"], Zero()).heads == want
    assert Intervention.on("L1H2,L0H3", Zero()).heads == want  # one comma-separated string
    assert ablation(["L1H2", "L0H3"], "uniform").heads == want
    model = tiny_models["gpt2"]
    ids = torch.randint(5, 200, (2, 7))
    with torch.no_grad():
        with model.hooks(fwd_hooks=ablation_hooks(model, ["L1H2", "L0H3"])):
            by_name = model(ids)
        with model.hooks(fwd_hooks=ablation_hooks(model, [(1, 2), (0, 3)])):
            by_pair = model(ids)
    assert torch.equal(by_name, by_pair)
    for bad in (["L18"], ["18:6"], [1.5], HeadIndex(1, 2)):
        with pytest.raises(HeadIndexError, match="L<layer>H<head>") as e:
            Intervention.on(bad, Zero())
        assert "\n" not in str(e.value)
    with pytest.raises(HeadIndexError, match="ablation_hooks: head \\(2, 0\\) is outside"):
        ablation_hooks(model, ["L2H0"])
