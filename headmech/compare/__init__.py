"""Competing definitions of one head role on one model, side by side (the agreement matrix).

:func:`agreement_matrix` ranks every head by each definition of "the heads that retrieve
from context" (:data:`DEFINITIONS`), keeps each ranking's top ``k``, and measures

* how much the sets agree: their pairwise Jaccard overlap and mean relative depth;
* what each set does: mean-ablated on each recall task (:data:`RECALL_TASKS`: multi-document
  recall, literal needle recall, parametric recall of facts without context) against random
  control sets of as many heads from the same layers, in the sequential Monte Carlo test of
  :func:`headmech.classification.validation.validate_heads`, with Benjamini-Hochberg's q
  over every set and task of the matrix.

``headmech compare-definitions`` writes the result (:class:`AgreementMatrix`) as
``definitions.json`` and its Jaccard heatmap. :func:`share_ablation` repeats LOCOS's
headline test (its top 4.3% of heads mean-ablated, recall against random sets and facts).
"""

from headmech.compare.definitions import DEFINITIONS, Definition
from headmech.compare.matrix import RECALL_TASKS, AgreementMatrix, MatrixOptions, agreement_matrix
from headmech.compare.share import LOCOS_SHARE, share_ablation

__all__ = [
    "DEFINITIONS",
    "LOCOS_SHARE",
    "RECALL_TASKS",
    "AgreementMatrix",
    "Definition",
    "MatrixOptions",
    "agreement_matrix",
    "share_ablation",
]
