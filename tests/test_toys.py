"""The toy induction model: trained locally, checked by mechanism, not only by loss."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

import headmech
from headmech.models import ensure_toy
from headmech.models.toys import (
    ToyInductionConfig,
    make_toy_tokenizer,
    repeated_random_tokens,
    train_toy_induction,
)


def test_tokenizer_round_trip_and_probe_structure(tmp_path):
    tok = make_toy_tokenizer(50)
    assert tok("t5 t7 t9")["input_ids"] == [5, 7, 9]
    assert tok.bos_token_id == 50 and tok.pad_token_id == 51
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2("t5 t7 t9")["input_ids"] == [5, 7, 9] and tok2.bos_token_id == 50
    ids = repeated_random_tokens(8, 12, 50, generator=torch.Generator().manual_seed(0), bos_id=50)
    assert ids.shape == (8, 25) and (ids[:, 0] == 50).all()
    assert torch.equal(ids[:, 1:13], ids[:, 13:]) and ids[:, 1:].max() < 50


def test_training_is_deterministic_under_the_seed():
    cfg = ToyInductionConfig(steps=3, batch_size=4)
    a, _, _ = train_toy_induction(cfg)
    b, _, _ = train_toy_induction(cfg)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    c, _, _ = train_toy_induction(ToyInductionConfig(steps=3, batch_size=4, seed=1))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_training_does_not_depend_on_the_callers_threads():
    """The cached toy is the same on machines with other core counts (with 2 threads
    instead of 1, the whole recipe trains other weights), and the caller's count stays."""
    cfg = ToyInductionConfig(steps=30, batch_size=32, d_model=128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a, _, _ = train_toy_induction(cfg)
        torch.set_num_threads(2)
        b, _, _ = train_toy_induction(cfg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_checkpoints_are_taken_on_schedule_and_do_not_change_training():
    cfg = ToyInductionConfig(steps=5, batch_size=4)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def keep(step, model):
        assert not model.training
        seen[step] = {k: v.clone() for k, v in model.state_dict().items()}

    a, _, _ = train_toy_induction(cfg, checkpoint_every=2, on_checkpoint=keep)
    b, _, _ = train_toy_induction(cfg)
    assert sorted(seen) == [0, 2, 4, 5]  # before training, every 2 steps, and the end
    for name, p in b.state_dict().items():
        assert torch.equal(a.state_dict()[name], p), name
        assert torch.equal(seen[5][name], p), name
    assert not torch.equal(
        seen[0]["model.embed_tokens.weight"], seen[5]["model.embed_tokens.weight"]
    )


@pytest.mark.slow
def test_cached_toy_has_loadable_checkpoints():
    """The checkpoints are a replay of the recipe on this machine: every step, loadable, and
    the same circuit as the shipped toy (a previous-token head in layer 0, an induction
    head in layer 1: which of the four is best may differ on another CPU kind);
    replay.json says truly whether it ended at the shipped weights."""
    from headmech.models.toy_cache import TOY_CHECKPOINT_EVERY, toy_checkpoints

    ckpts = toy_checkpoints("toy-induction")
    steps = ToyInductionConfig().steps
    assert sorted(ckpts) == list(range(0, steps + 1, TOY_CHECKPOINT_EVERY))
    final, _ = headmech.load_hf(ckpts[steps])
    cached, _ = headmech.load_hf("toy-induction")
    same = all(
        torch.equal(p, q)
        for p, q in zip(final.state_dict().values(), cached.state_dict().values(), strict=True)
    )
    replay = json.loads((ckpts[steps].parent.parent / "replay.json").read_text())
    shipped = json.loads((ensure_toy("toy-induction") / "training.json").read_text())
    assert replay["same_weights_as_the_toy"] == same
    for run in (replay, shipped):
        assert run["previous_token_head"][0] == 0 and run["previous_token_score"] > 0.8, run
        assert run["induction_head"][0] == 1 and run["induction_score"] > 0.8, run
    with pytest.raises(headmech.HeadmechError, match="unknown toy model"):
        toy_checkpoints("toy-nothing")


def test_the_toy_is_shipped_for_its_recipe_and_copied_to_the_cache(monkeypatch, tmp_path):
    """A changed recipe (config, checkpoint stride, threads, ISA pins) needs newly shipped
    weights: this fails until they are. The cache gets the shipped files byte for byte;
    without shipped weights the toy is trained and its checkpoints kept as the replay."""
    from headmech.models import toy_cache

    source = toy_cache.shipped("toy-induction")
    assert source is not None, "train the toy (python -m headmech.models.toy_cache DIR) and ship it"
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path))
    folder = ensure_toy("toy-induction")
    assert folder == toy_cache.toy_path("toy-induction")
    for f in source.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name

    def train(out):  # a stand-in for the minutes of training
        for step in (0, 50):
            (out / "checkpoints" / f"step-{step:05d}").mkdir(parents=True)
        for f in source.iterdir():
            (out / f.name).write_bytes(f.read_bytes())

    monkeypatch.setattr(toy_cache, "shipped", lambda name: None)
    monkeypatch.setattr(toy_cache, "_train_pinned", train)
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path / "other"))
    assert sorted(toy_cache.toy_checkpoints("toy-induction")) == [0, 50]
    replay = json.loads(
        (toy_cache.toy_path("toy-induction") / "checkpoints/replay.json").read_text()
    )
    assert replay["same_weights_as_the_toy"] is True


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model("toy-induction")  # trained once (about a minute), then cached


@pytest.mark.slow
def test_toy_induction_forms_the_circuit(toy):
    metrics = json.loads((ensure_toy("toy-induction") / "training.json").read_text())
    # loss: the repeated half becomes predictable
    assert metrics["loss_repeated_half"] < 0.1 * metrics["loss_first_half"], metrics
    # mechanism, measured by the library's own catalog on a fresh probe
    # the toy vocabulary has no English: previous-token heads are measured on random tokens
    prev_type = headmech.get_head_type("previous_token")(probe="repeated_random")
    cat = headmech.classify(toy, [prev_type, "induction"], n_sequences=32, half_len=40)
    prev = [h for h in cat.heads("previous_token") if h.layer == 0]
    ind = [h for h in cat.heads("induction") if h.layer == 1]
    assert prev and float(cat["previous_token"].score[prev[0]]) > 0.6, cat.table()
    assert ind and float(cat["induction"].score[ind[0]]) > 0.8, cat.table()
    # no induction head in layer 0: it needs the previous-token head's output
    assert all(h.layer == 1 for h in cat.heads("induction"))
    # ablating the induction heads destroys in-context copying ...
    from headmech.classification.classify import validate_heads
    from headmech.probes import ProbeOptions

    opts = ProbeOptions(n_sequences=32, half_len=40)
    T = headmech.get_head_type("induction")()
    v = validate_heads(toy, T, cat.heads("induction"), opts, n_random=0).to_json()
    assert v["clean"] < 0.1 and v["effect"] > 2.0, v
    # ... and so does ablating the previous-token head that feeds them (K-composition),
    # far more than ablating the layer-0 head least like a previous-token head
    prev_score = cat["previous_token"].score[0]
    best, worst = int(prev_score.argmax()), int(prev_score.argmin())
    e_best = validate_heads(toy, T, [headmech.HeadIndex(0, best)], opts, n_random=0).primary.effect
    e_worst = validate_heads(
        toy, T, [headmech.HeadIndex(0, worst)], opts, n_random=0
    ).primary.effect
    assert e_best > 1.0 and e_best > 3 * max(e_worst, 0.05), (e_best, e_worst)


@pytest.mark.slow
def test_toy_bridge_logits_equal_hf(toy):
    from headmech.models import load_hf

    hf, tok = load_hf("toy-induction")
    ids = repeated_random_tokens(
        2, 10, 256, generator=torch.Generator().manual_seed(1), bos_id=tok.bos_token_id
    )
    with torch.no_grad():
        torch.testing.assert_close(toy(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)
    # attention-only: every MLP outputs exactly zero
    _, cache = toy.run_with_cache(ids)
    assert all(
        float(cache[f"blocks.{layer}.hook_mlp_out"].abs().max()) == 0.0 for layer in range(2)
    )
