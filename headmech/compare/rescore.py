"""One definition of a published agreement matrix measured again (:func:`rescore_definition`).

When a definition's score changes (QRHead calibrated as its authors do, CRI patched as
LOCOS's code patches), the matrix need not be measured again whole: the definition's score
and the ablation of its new set on every task are, and Benjamini-Hochberg is taken again
over every claim of the matrix, the other definitions' records as published (their effects,
controls and p unchanged; their q and verdict follow the new family).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from headmech.core.errors import InputError
from headmech.core.head_index import top_k

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.compare.matrix import AgreementMatrix

__all__ = ["rescore_definition"]


def rescore_definition(
    model: TransformerBridge, matrix: AgreementMatrix, name: str, *, progress: bool = True
) -> AgreementMatrix:
    """``matrix`` with definition ``name``'s score measured again on ``model`` (the weights
    it was published on) and its new top ``k`` ablated on each of its tasks as
    :func:`~headmech.compare.agreement_matrix` ablates it; q and verdicts of every claim
    decided again (module docstring). The provenance records the rescoring.

    Raises:
        InputError: a definition the matrix does not hold, other weights than its own, or
            a published family Benjamini-Hochberg did not take over its claims alone.
    """
    from headmech.classification.montecarlo import TestOptions, benjamini_hochberg
    from headmech.classification.records import ClaimRecord
    from headmech.classification.validation import validate_heads
    from headmech.compare.definitions import DEFINITIONS
    from headmech.compare.matrix import AgreementMatrix
    from headmech.headtypes.registry import get_head_type
    from headmech.runs.provenance import git_commit, weights_hash

    o = matrix.options
    if name not in matrix.scores:
        raise InputError(f"the matrix has no definition {name} (has: {', '.join(matrix.scores)})")
    if matrix.provenance.get("model", {}).get("weights_sha256") != weights_hash(model):
        raise InputError(f"the {matrix.model} matrix was measured on other weights")
    records = {
        (d, t): ClaimRecord.from_json(e) for d, tasks in matrix.effects.items() for t, e in tasks.items()
    }  # fmt: skip
    families = {r.test.family for r in records.values() if r.test is not None}
    if families != {len(records)}:
        raise InputError(f"the matrix's q values are not over its {len(records)} claims alone")
    t0 = time.perf_counter()
    score, note = DEFINITIONS[name].measure(model, o, progress)
    seconds = round(time.perf_counter() - t0, 1)
    out = AgreementMatrix(
        matrix.model, matrix.n_layers, o, {**matrix.scores, name: score},
        {**matrix.notes, name: note}, {name: seconds}, {}, dict(matrix.provenance),
    )  # fmt: skip
    heads = out.top(name)
    near = [h for h in top_k(score, 2 * o.k) if h not in heads]
    test = TestOptions(n_max=o.n_random, control_tokens=o.control_tokens)
    for task in matrix.effects.get(name, {}):
        v = validate_heads(
            model, get_head_type("retrieval")(), heads, o.probe_options(), mode=o.mode,
            task=task, excluded=near, one_by_one=[], test=test,
        )  # fmt: skip
        records[(name, task)] = v.parts()[0][1]
    tested = [r for r in records.values() if r.test is not None]
    for r, q in zip(tested, benjamini_hochberg([r.test.p for r in tested]), strict=True):
        assert r.test is not None
        r.test.q, r.test.family = q, len(tested)
        r.decide(0.05)
    for (d, t), r in records.items():
        out.effects.setdefault(d, {})[t] = r.to_json()
    rescored = {"definition": name, "seconds": seconds, "headmech_git": git_commit()}
    out.provenance["rescored"] = [*matrix.provenance.get("rescored", []), rescored]
    return out
