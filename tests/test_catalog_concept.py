"""Concept induction heads (Feucht et al. 2025): the repeated_words probe's targets, the
scores against loops over a tiny model's attention, and the word_copying task."""

from __future__ import annotations

import pytest
import torch

from headmech.core.head_index import HeadIndex
from headmech.headtypes.concept_induction import ConceptInductionHead
from headmech.headtypes.registry import collect_statistics
from headmech.probes import ProbeOptions, build_probe
from headmech.probes.words import word_pieces
from headmech.tasks.words import select_word_copying
from headmech.testing import tiny_model

OPTIONS = ProbeOptions(n_sequences=6, half_len=8, batch_size=3, seed=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("causal")


@pytest.fixture(scope="module")
def probe(model):
    return build_probe("repeated_words", model, OPTIONS)


def _words(batch, row):
    """Per copy, the words as (positions, token ids), read from the probe's tokens."""
    ids = batch.input_ids[row].tolist()
    pos, copy = batch.extras["word_pos"][row].tolist(), batch.extras["copy"][row].tolist()
    words: dict[int, dict[int, list[int]]] = {0: {}, 1: {}}
    for i in range(len(ids)):
        if pos[i] >= 0:
            words[copy[i]].setdefault(pos[i], []).append(i)
    return words, ids


def test_the_second_copy_repeats_the_first_and_the_targets_are_word_ends(model, probe):
    n_multi = 0
    for b in probe.batches:
        for row in range(b.input_ids.shape[0]):
            words, ids = _words(b, row)
            assert sorted(words[0]) == sorted(words[1]) == list(range(OPTIONS.half_len))
            concept = b.extras["concept_target"][row].tolist()
            token = b.extras["token_target"][row].tolist()
            for w, second in words[1].items():
                first = words[0][w]
                assert [ids[i] for i in first] == [ids[i] for i in second]
                q = second[0] - 1
                if len(first) >= 2:
                    n_multi += 1
                    assert (concept[q], token[q]) == (first[-1], first[0])
                    assert model.tokenizer.decode([ids[i] for i in first]).startswith(" ")
            expected = {words[1][w][0] - 1 for w in words[1] if len(words[1][w]) >= 2}
            assert {i for i, t in enumerate(concept) if t >= 0} == expected
    assert n_multi == OPTIONS.n_sequences * (OPTIONS.half_len // 2)


def test_word_pieces_split_by_token_count(model):
    single, multi = word_pieces(model.tokenizer, ("the", "windowpane", "abnormally"))
    assert all(len(w) == 1 for w in single) and all(len(w) >= 2 for w in multi)
    assert len(single) + len(multi) == 3


def _hand_masses(model, batches):
    """Mean attention, per head, from the token before each repeated multi-token word to
    the first occurrence's last token (concept) and first token (token), with loops over
    the patterns the bridge's cache returns."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    concept = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    token = torch.zeros_like(concept)
    n = 0
    for b in batches:
        _, cache = model.run_with_cache(b.input_ids, attention_mask=b.attention_mask)
        for row in range(b.input_ids.shape[0]):
            words, _ = _words(b, row)
            for w, second in words[1].items():
                first = words[0][w]
                if len(first) < 2:
                    continue
                n += 1
                q = second[0] - 1
                for la in range(n_layers):
                    p = cache[f"blocks.{la}.attn.hook_pattern"][row]
                    for h in range(n_heads):
                        concept[la, h] += float(p[h, q, first[-1]])
                        token[la, h] += float(p[h, q, first[0]])
    return concept / n, token / n


def test_scores_match_loops_over_the_attention(model, probe):
    t = ConceptInductionHead()
    stats = collect_statistics([t], model, probe.batches)
    concept, token = _hand_masses(model, probe.batches)
    torch.testing.assert_close(t.score(stats).double(), concept, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        stats.mean("concept_induction.token.mass").double(), token, atol=1e-5, rtol=1e-4
    )


def test_a_token_induction_head_is_not_a_concept_head():
    """The rule: concept mass at the threshold, and above the token-level mass."""
    t = ConceptInductionHead()

    class Stats:
        def mean(self, name):
            return torch.tensor([[0.5, 0.45, 0.1]]) if name.endswith("token.mass") else None

    score = torch.tensor([[0.45, 0.5, 0.3]])
    assert t.select(score, Stats()) == [HeadIndex(0, 1)]


def test_word_copying_selects_the_tokens_of_repeated_multi_token_words(probe):
    for b in probe.batches:
        query, target = select_word_copying(b)
        for row in range(b.input_ids.shape[0]):
            words, ids = _words(b, row)
            want = {i - 1 for w in words[1].values() if len(w) >= 2 for i in w}
            got = set(query[row].nonzero()[:, 0].tolist())
            assert got == want
            assert all(int(target[row, q]) == ids[q + 1] for q in got)
