"""Head → tail cases of dependency relations on the ``prose`` probe (Ren et al. 2024).

A case is a dependency arc whose syntactic head word comes before its dependent (the
*tail*) and is not the word just before it: the query is the token just before the
tail's first token (the position that predicts the tail), the key is the head word's last
token, and the tail token is the tail's first token. Both the ``semantic_induction`` head
type and its ``relation_tail`` task read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from headmech.stream.engine import ProbeBatch

__all__ = ["RELATIONS", "RelationCases", "relation_cases"]

# the relations of the syntactic type (headmech.headtypes.syntactic) and of semantic induction
RELATIONS: tuple[str, ...] = (
    "nsubj",
    "dobj",  # spaCy's label for a direct object (UD's "obj")
    "amod",
    "advmod",
    "det",
    "pobj",
    "poss",
    "aux",
    "mark",
)


@dataclass(frozen=True)
class RelationCases:
    """One batch's cases, one entry each."""

    seq: Int[Tensor, " n"]  # batch row
    query: Int[Tensor, " n"]  # the token just before the tail
    key: Int[Tensor, " n"]  # the head word's last token
    tail: Int[Tensor, " n"]  # the tail's first token id
    relation: Int[Tensor, " n"]  # index into the relations asked for


def relation_cases(batch: ProbeBatch, relations: Sequence[str]) -> RelationCases:
    """The head-before-tail, non-adjacent cases of ``relations`` (module docstring)."""
    seq, query, key, tail, rel = [], [], [], [], []
    if "word_ids" in batch.extras and "dep_labels" in batch.extras:
        labels = list(batch.extras["dep_labels"])
        wanted = {labels.index(r): i for i, r in enumerate(relations) if r in labels}
        word_ids = batch.extras["word_ids"].tolist()
        heads = batch.extras["word_heads"].tolist()
        deps = batch.extras["word_deps"].tolist()
        ids = batch.input_ids.tolist()
        for b, row in enumerate(word_ids):
            first: dict[int, int] = {}
            last: dict[int, int] = {}
            for p, w in enumerate(row):
                if w >= 0:
                    first.setdefault(w, p)
                    last[w] = p
            for w, p in first.items():
                h = heads[b][w] if w < len(heads[b]) else -1
                d = deps[b][w] if w < len(deps[b]) else -1
                if d in wanted and 0 <= h < w and h in last and last[h] < p - 1:
                    seq.append(b)
                    query.append(p - 1)
                    key.append(last[h])
                    tail.append(ids[b][p])
                    rel.append(wanted[d])
    t = [torch.tensor(x, dtype=torch.long) for x in (seq, query, key, tail, rel)]
    return RelationCases(*t)
