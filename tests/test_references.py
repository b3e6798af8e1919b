"""Catalog scores on SmolLM2-135M against TransformerLens' head detector.

``transformer_lens.head_detector.detect_head`` (TransformerLens 4 runs it on a
``TransformerBridge``) scores a head by its "mul" measure: the attention mass on the
query-key pairs of a detection pattern, divided by the pattern's total mass — with rows
that sum to one, the mass on the targets summed over the queries divided by the number
of *all* queries. It tokenises strings; the shim below hands it the probe's token ids
instead, so both sides see the same sequences. It runs the model through its own
``run_with_cache`` and its own detection patterns; headmech streams the statistics from
hooks, rebuilding the patterns from q and k.

How the definitions relate, and what is compared:

* ``duplicate_token`` and ``induction`` on repeated random tokens: the detector's
  patterns and headmech's targets are the same query-key pairs (BOS never repeats, and
  the random halves hold no repeated token of their own). headmech's ``<name>.rows``
  statistic is the detector's score (mass over all queries); its score divides by the
  queries that have a target instead: ``Σ_s score_s · n_s / Σ_s n_target_s``.
* ``previous_token`` on prose: the detector's pattern also pairs position 1 with BOS;
  headmech treats special tokens as neither queries nor targets. The reference is the
  detector with that pattern's special-token rows and columns cleared (and the raw
  detector differs from it by exactly the attention from position 1 to BOS).

The catalog's bootstrap intervals are checked too: classify runs on resamples drawn here
with NumPy's Generator (handed to it in place of ``bootstrap_weights``), and a percentile
bootstrap written here over the detector's per-sequence numbers on the same draws must
give its limits. ``bootstrap_weights`` itself is checked against NumPy and SciPy in
``tests/test_uncertainty.py``.

The published attention examples (``catalog/smollm2-135m/examples.json``, which the
site's head pages draw) are checked against the pattern TransformerLens' own
``run_with_cache`` gives on the same token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformer_lens.head_detector import (
    detect_head,
    get_duplicate_token_head_detection_pattern,
    get_induction_head_detection_pattern,
    get_previous_token_head_detection_pattern,
)

import headmech
import headmech.stream.uncertainty
from headmech.headtypes.registry import get_head_type
from headmech.probes import ProbeOptions, build_probe
from headmech.publish.examples import example_texts, recording_plan
from headmech.stream.engine import ProbeBatch, stream_statistics, target_reducer
from headmech.stream.uncertainty import LEVEL, N_BOOT

pytestmark = pytest.mark.slow  # SmolLM2 (once per session)

CATALOG = Path(__file__).resolve().parent.parent / "catalog" / "smollm2-135m"

OPTIONS = ProbeOptions(n_sequences=8, half_len=16, n_sentences=8, batch_size=8, seed=0)


class _Tokens:
    """What ``detect_head`` needs of a model, with ``to_tokens`` returning the probe's
    token ids rather than tokenising a string."""

    def __init__(self, model, tokens: torch.Tensor) -> None:
        self.cfg, self.model, self.tokens = model.cfg, model, tokens

    def to_tokens(self, seq):
        return self.tokens

    def run_with_cache(self, *args, **kwargs):
        return self.model.run_with_cache(*args, **kwargs)


@dataclass
class Detected:
    """Per sequence (in the probe's order): the detector's scores ``[n_seq, n_layers,
    n_heads]``, the number of queries ``n`` and of queries with a target ``n_target``."""

    score: torch.Tensor
    n: torch.Tensor
    n_target: torch.Tensor
    bos: torch.Tensor  # attention from position 1 to position 0, [n_seq, n_layers, n_heads]

    def pooled_rows(self) -> torch.Tensor:  # mass on targets / every query, pooled
        return (self.score * self.n[:, None, None]).sum(0) / self.n.sum()

    def per_target_query(self) -> torch.Tensor:  # mass on targets / queries with one
        return (self.score * self.n[:, None, None]).sum(0) / self.n_target.sum()


def _detect(model, probe, patterns) -> dict[str, Detected]:
    """``detect_head`` on every sequence of the probe alone (no padding), for every
    ``name -> (tokens, special) -> detection pattern`` (one cache per sequence)."""
    out: dict[str, list] = {k: [] for k in patterns}
    bos: list[torch.Tensor] = []
    for b in probe.batches:
        for row in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[row].sum())
            tokens = b.input_ids[row : row + 1, :n]
            _, cache = model.run_with_cache(tokens, remove_batch_dim=True)
            layers = range(int(model.cfg.n_layers))
            bos.append(torch.stack([cache["pattern", la][:, 1, 0] for la in layers]).double())
            for name, make in patterns.items():
                det = make(tokens, b.special[row, :n])
                s = detect_head(_Tokens(model, tokens), "", det, cache=cache, error_measure="mul")
                out[name].append((s.double(), n, int((det.sum(-1) > 0).sum())))
    return {
        name: Detected(
            torch.stack([s for s, *_ in rows]),
            torch.tensor([n for _, n, *_ in rows], dtype=torch.float64),
            torch.tensor([k for _, _, k in rows], dtype=torch.float64),
            torch.stack(bos),
        )
        for name, rows in out.items()
    }


def _without_special(make):
    def det(tokens, special):
        p = make(tokens.cpu()).clone()
        p[special], p[:, special] = 0, 0
        return p

    return det


@pytest.fixture(scope="module")
def repeated(smollm2):
    probe = build_probe("repeated_random", smollm2, OPTIONS)
    for b in probe.batches:  # the detector's patterns equal headmech's targets only then
        first = b.input_ids[:, 1 : 1 + OPTIONS.half_len]
        assert all(len(set(r)) == OPTIONS.half_len for r in first.tolist())
    detected = _detect(
        smollm2,
        probe,
        {
            "duplicate_token": lambda t, sp: get_duplicate_token_head_detection_pattern(t.cpu()),
            "induction": lambda t, sp: get_induction_head_detection_pattern(t.cpu()),
        },
    )
    return probe, detected


@pytest.fixture(scope="module")
def prose(smollm2):
    probe = build_probe("prose", smollm2, OPTIONS)
    detected = _detect(
        smollm2,
        probe,
        {
            "raw": lambda t, sp: get_previous_token_head_detection_pattern(t.cpu()),
            "previous_token": _without_special(get_previous_token_head_detection_pattern),
        },
    )
    return probe, detected


def _resamples(n_units: int, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, n_units]`` sequence indices drawn with replacement by NumPy's Generator."""
    return np.random.default_rng(seed).integers(0, n_units, (n_boot, n_units))


def _numpy_weights(n_units: int, n_boot: int = N_BOOT, seed: int = 0) -> torch.Tensor:
    """:func:`_resamples` as the counts ``bootstrap_weights`` returns."""
    idx = _resamples(n_units, n_boot, seed)
    counts = np.stack([np.bincount(row, minlength=n_units) for row in idx])
    return torch.tensor(counts, dtype=torch.float64)


@pytest.fixture(scope="module")
def catalog(smollm2):
    with pytest.MonkeyPatch.context() as mp:  # classify on the resamples drawn here
        mp.setattr(headmech.stream.uncertainty, "bootstrap_weights", _numpy_weights)
        return headmech.classify(
            smollm2, ["induction", "duplicate_token", "previous_token"], **vars(OPTIONS)
        )


def _hand_interval(d: Detected, seed: int) -> np.ndarray:
    """Percentile bootstrap of Σ_s num_s / Σ_s n_target_s over the sequences, written
    out: each resample's sequences by index, drawn with NumPy's Generator."""
    num = (d.score * d.n[:, None, None]).numpy()
    den = d.n_target.numpy()
    samples = []
    for idx in _resamples(len(den), N_BOOT, seed):
        samples.append(num[idx].sum(0) / den[idx].sum())
    pct = [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2]
    return np.percentile(np.stack(samples), pct, axis=0)


@pytest.mark.parametrize("name", ["duplicate_token", "induction", "previous_token"])
def test_rows_statistic_is_the_detectors_mul_score(smollm2, repeated, prose, name):
    """headmech's ``<name>.rows`` is detect_head's score, pooled over the sequences
    (weighted by their lengths), head by head."""
    probe, detected = prose if name == "previous_token" else repeated
    t = get_head_type(name)()
    stats = stream_statistics(smollm2, probe.batches, t.reducers())
    want = detected[name].pooled_rows()
    torch.testing.assert_close(stats.mean(f"{name}.rows").double(), want, atol=1e-5, rtol=0)
    if name != "previous_token":
        # every query of the repeated half has its target (the induction pattern's first
        # repeated query too: the token after the copy of the first random token)
        assert detected[name].n_target.tolist() == [OPTIONS.half_len] * OPTIONS.n_sequences
        torch.testing.assert_close(want, detected[name].score.mean(0))  # detect_head's mean


@pytest.mark.parametrize("name", ["duplicate_token", "induction", "previous_token"])
def test_catalog_score_and_interval_from_the_detector(catalog, repeated, prose, name):
    """classify's score is the detector's mass on the targets per query that has one;
    its bootstrap interval is the hand percentile bootstrap of the detector's
    per-sequence numbers on the same (NumPy-drawn) resamples."""
    d = (prose if name == "previous_token" else repeated)[1][name]
    r = catalog[name]
    want = d.per_target_query()
    torch.testing.assert_close(r.score.double(), want, atol=1e-5, rtol=0)
    assert float(want.max()) > 0.5 and float(want.std()) > 0.05  # heads differ; some do it
    assert 0 < len(r.heads) < want.numel()
    lo, hi = _hand_interval(d, OPTIONS.seed)
    np.testing.assert_allclose(r.low.double().numpy(), lo, atol=1e-5)
    np.testing.assert_allclose(r.high.double().numpy(), hi, atol=1e-5)
    assert float((r.high - r.low).max()) > 0.01  # 8 sequences: the intervals have width


def _to_bos(batch: ProbeBatch) -> torch.Tensor:
    """Query 1's target is BOS (key 0); no other query has one."""
    t = torch.full_like(batch.input_ids, -1)  # [batch, query_pos]
    t[:, 1] = 0
    return t


def test_raw_previous_token_detector_adds_the_attention_to_bos(smollm2, prose):
    """The raw detector differs from headmech's previous_token statistics by exactly each
    sequence's attention from position 1 to BOS, which headmech leaves out: the one
    difference in definition. headmech's side is its own streamed per-sequence sums (and
    its own attention from 1 to BOS); TransformerLens' side its detector and cache."""
    probe, detected = prose
    raw, ref = detected["raw"], detected["previous_token"]
    reducers = [*get_head_type("previous_token")().reducers(), target_reducer("bos", _to_bos)]
    stats = stream_statistics(smollm2, probe.batches, reducers)
    mine, _ = stats.units("previous_token.rows")  # [n_seq, n_layers, n_heads]
    _, n_target = stats.units("previous_token.mass")
    bos, _ = stats.units("bos.rows")
    # the detector's pattern has one query more than headmech's targets: position 1
    torch.testing.assert_close(n_target[:, 0, 0], ref.n_target)
    torch.testing.assert_close(raw.n_target, ref.n_target + 1)
    # sums over a sequence's queries (up to ~20 in mass): float32 to a relative 1e-5
    torch.testing.assert_close(mine, ref.score * ref.n[:, None, None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bos, ref.bos, atol=1e-5, rtol=0)  # headmech's vs TL's cache
    raw_mass = raw.score * raw.n[:, None, None]
    torch.testing.assert_close(raw_mass, mine + bos, atol=1e-5, rtol=1e-5)
    assert float(bos.max()) > 0.5  # not negligible: sink heads put most of it on BOS


def test_published_examples_are_the_models_attention(smollm2):
    """Every head's rows in examples.json are the model's attention on the example texts
    (run_with_cache's ``hook_pattern``), to the file's 3 decimals: every head on the
    ordinary texts, a head on another probe's text where that is its own type's probe."""
    data = json.loads((CATALOG / "examples.json").read_text())
    catalog = json.loads((CATALOG / "catalog.json").read_text())
    assert data["weights_sha256"] == catalog["provenance"]["model"]["weights_sha256"]
    assert set(data["heads"]) == {f"L{la}H{h}" for la in range(30) for h in range(9)}
    assert data["causal"] is True
    texts = example_texts(smollm2, catalog["types"])
    assert [t["probe"] for t in data["texts"]] == [probe for probe, _ in texts]
    assert {"prose", "repeated_random", "ioi", "needle"} <= {p for p, _ in texts}
    plan = recording_plan(catalog, texts)
    for i, (text, (_, ids)) in enumerate(zip(data["texts"], texts, strict=True)):
        # the same tokens: each id decodes to the stored string
        assert text["tokens"] == [smollm2.tokenizer.decode([t]).replace("\n", "\\n") for t in ids]
        _, cache = smollm2.run_with_cache(torch.tensor([ids]))
        n = len(ids)
        for name, per_text in data["heads"].items():
            layer, head = (int(x) for x in name.removeprefix("L").split("H"))
            rows = per_text[i]
            assert (rows is not None) == (i in plan[(layer, head)]), (name, i)
            if rows is None:
                continue
            want = cache[f"blocks.{layer}.attn.hook_pattern"][0, head].double().numpy()
            assert [len(r) for r in rows] == list(range(1, n + 1)), name  # causal rows
            got = np.zeros((n, n))
            for q, row in enumerate(rows):
                got[q, : q + 1] = row
            # rounded to 3 decimals (5e-4), plus float32 noise
            np.testing.assert_allclose(got, np.tril(want), atol=6e-4, rtol=0, err_msg=name)
