"""Every probe's sequences start as the model's own tokenizer starts a text: ``[CLS]`` on
an encoder (not the ``[UNK]`` that MiniLM's borrowed BOS token reads as), ``<bos>`` on a
decoder with one, no special token on Qwen2.5 (no BOS); and none holds the unknown token."""

from __future__ import annotations

import pytest

from headmech.core.errors import InputError
from headmech.core.registry import PROBES
from headmech.probes import ProbeOptions, build_probe, start_ids

# small: the whole test, four real models loaded, stays within about a minute
SMALL = ProbeOptions(
    n_sentences=8, n_sequences=4, half_len=8, batch_size=4,
    needle_lengths=(300,), needle_depths=(0.5,),
)  # fmt: skip
BUNDLED = {  # conftest's session fixtures
    "minilm-l6": "minilm",
    "smollm2-135m": "smollm2",
    "gemma3-270m": "gemma3",
    "qwen2.5-coder-0.5b": "qwen25",
}
# (model, probe) that cannot be built, and why: WordPiece reads "\n" as whitespace; the
# refusal probe needs an instruct model's chat template (the request is a chat turn)
CANNOT = {
    ("minilm-l6", "icl"): "no single token for '\\n'",
    ("minilm-l6", "refusal"): "no chat template (an encoder)",
    ("gemma3-270m", "refusal"): "no chat template (a base model)",
}


def own_start(tokenizer) -> int | None:
    """The id the tokenizer itself puts first when it encodes a text, if it puts one."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    return with_special[0] if len(with_special) > len(bare) else None


def check_starts(model, name: str, probes) -> dict[str, int]:
    """Each probe built small on ``model``: its sequences' first token is the tokenizer's
    own start token (or, where it puts none, no special token), and no token is the unknown
    token. Returns the sequences checked per probe."""
    tok = model.tokenizer
    want, unknown = own_start(tok), tok.unk_token_id
    special = set(tok.all_special_ids)
    checked = {}
    for probe in probes:
        try:
            built = build_probe(probe, model, SMALL)
        except InputError:
            assert (name, probe) in CANNOT, f"{probe} cannot be built on {name}"
            continue
        n = 0
        for b in built.batches:
            real = b.attention_mask.bool()
            for row, mask in zip(b.input_ids, real, strict=True):
                ids = row[mask].tolist()
                first = tok.convert_ids_to_tokens(ids[0])
                if want is not None:
                    assert ids[0] == want, f"{name} {probe} starts with {first!r}"
                else:
                    assert ids[0] not in special, f"{name} {probe} starts with {first!r}"
                # at these sizes the tokenizers read every probe text without an [UNK]
                assert unknown is None or unknown not in ids, (
                    f"{name} {probe} holds {tok.unk_token!r}"
                )
                n += 1
        checked[probe] = n
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUNDLED))
def test_every_probe_starts_with_the_models_own_start_token(name, request):
    model = request.getfixturevalue(BUNDLED[name])
    probes = sorted(PROBES.names())
    assert {"repeated_random", "prose", "repeated_words", "ioi", "needle"} <= set(probes)
    checked = check_starts(model, name, probes)
    assert set(checked) == set(probes) - {p for m, p in CANNOT if m == name}
    assert all(checked.values())
    first = {
        "minilm-l6": "[CLS]",
        "smollm2-135m": "<|im_start|>",
        "gemma3-270m": "<bos>",
        "qwen2.5-coder-0.5b": None,
    }[name]
    start = start_ids(model)
    assert model.tokenizer.convert_ids_to_tokens(start) == ([first] if first else [])


def test_an_encoder_starts_with_cls_not_its_borrowed_bos(tiny_models):
    """A BERT tokenizer has no BOS; TransformerLens lends it ``<|endoftext|>``, which its
    vocabulary reads as ``[UNK]``: the probes start with ``[CLS]``, as BERT's text does."""
    bert = tiny_models["bert"]
    tok = bert.tokenizer
    assert tok.bos_token_id == tok.unk_token_id  # the borrowed BOS (why the probe went wrong)
    assert start_ids(bert) == [tok.cls_token_id]
    options = ProbeOptions(n_sentences=8, n_sequences=4, half_len=8, batch_size=4)
    checked = check_starts(bert, "tiny-bert", ["repeated_random", "repeated_words", "ordinal"])
    assert checked == {"repeated_random": 4, "repeated_words": 4, "ordinal": 4}
    batch = build_probe("repeated_random", bert, options).batches[0]
    assert batch.input_ids[0, 0] == tok.cls_token_id and batch.input_ids[0, -1] == tok.sep_token_id
    assert batch.extras["offset"] == 1


def test_a_decoder_keeps_its_bos(tiny_models):
    """SmolLM2's tokenizer on the tiny decoders: its own ``<|im_start|>`` first, as before."""
    for name in ("gpt2", "llama"):
        model = tiny_models[name]
        assert start_ids(model) == [own_start(model.tokenizer)] == [model.tokenizer.bos_token_id]
