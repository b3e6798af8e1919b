"""Survival report: which catalogued heads pruning keeps, and three pruning orders."""

from __future__ import annotations

import pytest
import torch

from headmech.classification.classify import HeadCatalog, TypeResult
from headmech.core.head_index import HeadIndex
from headmech.models import ModelInfo
from headmech.pruning.survival import compare_orders, enrichment, removal_order, survival


def _catalog() -> HeadCatalog:
    info = ModelInfo("m", 2, 4, 4, 8, 64, True)
    z = torch.zeros(2, 4)
    return HeadCatalog(
        info,
        {
            "a": TypeResult("a", "X 2020", 0.5, z, [HeadIndex(0, 1), HeadIndex(1, 2)]),
            "b": TypeResult("b", "Y 2021", 0.5, z, [HeadIndex(1, 0)]),
            "none": TypeResult("none", "Z 2022", 0.5, z, []),
        },
    )


def test_survival_enrichment_and_order():
    cat = _catalog()
    steps = [
        [HeadIndex(la, h) for la in range(2) for h in range(4)],
        [HeadIndex(0, 1), HeadIndex(1, 2), HeadIndex(1, 0), HeadIndex(0, 0)],
        [HeadIndex(0, 1), HeadIndex(0, 0)],
    ]
    s = survival(steps, cat)
    assert s == {"a": [1.0, 1.0, 0.5], "b": [1.0, 1.0, 0.0]}  # types without heads are left out
    # 3 of 8 heads are catalogued; among the 4 kept at step 1, 3 are: enrichment 0.75 / 0.375
    assert enrichment(steps[1], cat) == 2.0
    assert enrichment(steps[0], cat) == 1.0
    order = removal_order(s, [8, 4, 2])
    assert [r["half_removed_at_n_kept"] for r in order] == [2, 2]
    # distinct times: b loses its head first (at 4 kept), a half of its heads later (at 2)
    later = [steps[0], [HeadIndex(0, 1), HeadIndex(1, 2), HeadIndex(0, 0), HeadIndex(1, 3)]]
    later.append([HeadIndex(0, 1), HeadIndex(0, 0)])
    s2 = survival(later, cat)
    assert s2 == {"a": [1.0, 1.0, 0.5], "b": [1.0, 0.0, 0.0]}
    order = removal_order(s2, [8, 4, 2])
    assert [(r["type"], r["half_removed_at_n_kept"]) for r in order] == [("b", 4), ("a", 2)]
    # a type that keeps more than half to the end comes last, with None
    s3 = {"a": [1.0, 1.0, 0.5], "c": [1.0, 1.0, 1.0], "b": [1.0, 0.0, 0.0]}
    assert [r["type"] for r in removal_order(s3, [8, 4, 2])] == ["b", "a", "c"]


def test_compare_orders_on_a_tiny_model(tiny_models):
    from headmech.probes import ProbeOptions
    from headmech.tasks import get_task

    model = tiny_models["gpt2"]
    cat = _catalog()
    batches = get_task("lm", model).batches(model, ProbeOptions(n_sentences=8, batch_size=8))
    imp = torch.arange(8.0).view(2, 4)
    res = compare_orders(model, cat, imp, batches, "lm", fractions=(0.0, 0.5), n_random=2)
    assert set(res) == {"catalog", "importance", "random"}
    clean = {v[0]["metric"] for v in res.values()}
    assert len(clean) == 1  # nothing removed: the same metric for every order
    assert all(v[1]["n_kept"] == 4 for v in res.values())
    assert res["importance"][1]["metric"] != res["importance"][0]["metric"]
    # which heads each order removes first, and the metric with exactly those zeroed
    from headmech.interventions import evaluate
    from headmech.interventions.ablation import ablation

    task = get_task("lm", model)
    least = [HeadIndex(0, h) for h in range(4)]  # importance 0..3: layer 0 goes first
    unlabelled = [HeadIndex(0, 0), HeadIndex(0, 2), HeadIndex(0, 3), HeadIndex(1, 1)]
    for kind, heads in (("importance", least), ("catalog", unlabelled)):
        want = evaluate(model, task, batches, [ablation(heads)])
        assert res[kind][1]["metric"] == pytest.approx(want, abs=1e-6), kind
    assert res["catalog"][1]["metric"] != res["importance"][1]["metric"]
