"""One intervention layer: what is done to which heads, where, in which variant of a batch.

A head intervention is ``(site, heads, effect)``:

* **site** — the hook it acts on: ``"z"`` (``blocks.{l}.attn.hook_z``, the head outputs),
  ``"pattern"`` (``hook_pattern``), ``"q"``, ``"k"``, ``"v"`` (``hook_q``/``hook_k``/
  ``hook_v``; under grouped-query attention ``k`` and ``v`` have one head per KV head);
* **heads** — ``(layer, head)`` pairs, optionally restricted to one position (``pos``:
  a token position for z/q/k/v, a query position for the pattern);
* **effect** — :class:`Zero`, :class:`Mean` (a per-head mean output), :class:`Patch`
  (the activation of another run: activation patching, resampling), :class:`Set` (a
  given value, e.g. a planted pattern), :class:`Uniform` (uniform attention over the
  keys a query may see), :class:`Window` (attention to sinks and a recent window only,
  renormalised: a compressed KV cache, :mod:`headmech.kv`), :class:`Scale` (a
  differentiable multiplier: Michel's ξ, L0 gates, head masks), :class:`Gate` (an
  input-dependent multiplier computed from the layer's input: mixture-of-heads gates),
  :class:`Tap` (adds a zero leaf whose gradient is ∂metric/∂activation) and
  :class:`PathPatch` (a q/k/v input recomputed from the layer's input plus another head's
  output difference: direct path patching).

Every effect works in one layout, heads first — ``[batch, head_index, pos, d_head]`` for
z/q/k/v, ``[batch, head_index, query_pos, key_pos]`` for the pattern — reached from the
hook's own layout with :func:`einops.rearrange`. Hooks return a modified copy and never
write into the activation they receive.

**Variants.** Exact methods need many interventions on the same inputs (one per head, a
control set, ...). :func:`run_variants` stacks ``k`` copies of a batch along the batch
dimension and hook code applies variant ``i``'s interventions to copy ``i`` only, so one
forward pass serves ``k`` interventions; the clean run rides along as variant 0. The
task (:mod:`headmech.tasks`) turns each copy's output into its metric.

Reading without changing: :func:`capture` (activations at hook points during one run),
:func:`recording` (the same around any forward the caller runs), :func:`capture_z`,
:func:`mean_outputs` and :func:`gradients` (head outputs and ∂metric/∂z in one forward
and backward pass).

Layout: :mod:`~headmech.interventions.effects` (the effects),
:mod:`~headmech.interventions.intervention` (interventions as hooks, captures — with
:mod:`headmech.stream.engine`'s reducers the only place that registers TransformerLens hook
functions) and :mod:`~headmech.interventions.runner` (variants, evaluation, gradients).
"""

from headmech.interventions.effects import (
    SITES,
    DropFirst,
    Effect,
    Gate,
    Mean,
    Patch,
    PathPatch,
    Scale,
    Set,
    Tap,
    Uniform,
    Window,
    Zero,
)
from headmech.interventions.intervention import (
    Intervention,
    applied,
    capture,
    capture_z,
    hooks,
    mean_outputs,
    pattern_edits_apply,
    recording,
)
from headmech.interventions.runner import Cost, evaluate, gradients, run_variants

__all__ = [
    "SITES",
    "Cost",
    "DropFirst",
    "Effect",
    "Gate",
    "Intervention",
    "Mean",
    "Patch",
    "PathPatch",
    "Scale",
    "Set",
    "Tap",
    "Uniform",
    "Window",
    "Zero",
    "applied",
    "capture",
    "capture_z",
    "evaluate",
    "gradients",
    "hooks",
    "mean_outputs",
    "pattern_edits_apply",
    "recording",
    "run_variants",
]
