"""What headmech knows of a model it loaded, kept by headmech rather than on the model.

:func:`headmech.models.load_model` records a :class:`Loaded` for each model it returns
(its short name, where its weights came from); other parts keep their per-model caches in
the same record (the weights' hash, whether pattern edits reach the output) and the
pruned copies of :mod:`headmech.pruning.mask` their head count. The records sit in a weak
map keyed by the model (:func:`loaded`): nothing is set on the third-party bridge or the
Hugging Face model, and a record goes when its model does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["Loaded", "loaded", "model_name"]


@dataclass
class Loaded:
    """One model's record.

    Attributes:
        name: the short name a catalog reports (a bundled model's, or a folder's).
        source: where the weights came from (a bundled GGUF's packages, the file's SHA-256,
            the licence, the token the tokenizer prepends), which provenance reports.
        weights_hash: the weights' hash with the tensors' versions it was computed at
            (:func:`headmech.runs.provenance.weights_hash`).
        pattern_edits_apply: whether an edited attention pattern changes the output
            (:func:`headmech.interventions.intervention.pattern_edits_apply`).
        pruned_n_head: heads per layer left in a pruned copy.
    """

    name: str | None = None
    source: dict[str, Any] | None = None
    weights_hash: tuple[Any, str] | None = None
    pattern_edits_apply: bool | None = None
    pruned_n_head: int | None = None


_RECORDS: weakref.WeakKeyDictionary[Any, Loaded] = weakref.WeakKeyDictionary()


def loaded(model: Any) -> Loaded:
    """``model``'s record (an empty one, kept from now on, for a model headmech did not
    load)."""
    record = _RECORDS.get(model)
    if record is None:
        record = _RECORDS[model] = Loaded()
    return record


def model_name(model: Any) -> str:
    """The name a catalog reports: the one :func:`headmech.models.load_model` recorded,
    else the model's config's ``model_name``, else ``model``."""
    name = loaded(model).name
    return name if name is not None else str(getattr(model.cfg, "model_name", "model"))
