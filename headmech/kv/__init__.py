"""Catalog-guided KV-cache compression (DuoAttention / RazorAttention style).

Retrieval heads keep the whole KV cache; every other head keeps only attention sinks and
a recent window. Three parts:

* :mod:`~headmech.kv.plan`: :class:`KVPlan`, per layer and KV head full or windowed, from
  a catalog, any head set, or random heads matched per layer; ``plan.json`` with
  provenance (``headmech kv-plan``);
* :mod:`~headmech.kv.masks`: exact evaluation by per-head masks (needle recall and
  answer log-probability over contexts and depths, perplexity on long prose);
* :mod:`~headmech.kv.shared`: :func:`evaluate_many`, many plans at once, each layer run
  once per distinct prefix of plans (equal to :func:`evaluate` of each);
* :mod:`~headmech.kv.importance`: :func:`kv_importance`, each KV head's measured cost
  when it alone is windowed, the ranking of importance plans (:meth:`KVPlan.from_ranking`);
* :mod:`~headmech.kv.cache`: :class:`PlanCache`, a transformers ``Cache`` that stores
  only the kept entries, for generation; its outputs equal the masked model's.

References:
    Xiao et al. 2024, "DuoAttention", arXiv:2410.10819; Tang et al. 2024,
    "RazorAttention", arXiv:2407.15891.
"""

from headmech.kv.attention import allowed_keys, hf_model, planned
from headmech.kv.budget import model_windows
from headmech.kv.cache import Generation, PlanCache, cache_nbytes, generate
from headmech.kv.importance import KVImportance, kv_importance
from headmech.kv.masks import KVEval, evaluate, needle_batches, prose_batches
from headmech.kv.plan import KVPlan, kv_ranking, split_budget
from headmech.kv.shared import evaluate_many

__all__ = [
    "Generation",
    "KVEval",
    "KVImportance",
    "KVPlan",
    "PlanCache",
    "allowed_keys",
    "cache_nbytes",
    "evaluate",
    "evaluate_many",
    "generate",
    "hf_model",
    "kv_importance",
    "kv_ranking",
    "model_windows",
    "needle_batches",
    "planned",
    "prose_batches",
    "split_budget",
]
