"""Head pruning: masks, physical removal and iterative pruning.

``HeadMask`` gates heads through ``hook_z`` hooks, :func:`prune_heads` builds a smaller
Hugging Face model, :func:`michel_prune` runs Michel et al.'s iterative pruning and
returns a :class:`PruningResult` that writes ``pruning.json`` (DESIGN.md section 4).

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
"""

from __future__ import annotations

from headmech.pruning.mask import (
    HeadMask,
    UnsupportedPruningError,
    head_mask,
    head_mask_hooks,
    prune_heads,
)
from headmech.pruning.michel import PruningResult, masked_importance, masked_metric, michel_prune

__all__ = [
    "HeadMask",
    "PruningResult",
    "UnsupportedPruningError",
    "head_mask",
    "head_mask_hooks",
    "masked_importance",
    "masked_metric",
    "michel_prune",
    "prune_heads",
]
