"""The ``parsed_prose`` probe: prose sentences with spaCy dependency parses, word-aligned.

Syntactic head types compare attention with a dependency parse, which is defined on words,
while attention is defined on model tokens. This probe parses the sampled corpus sentences
with spaCy (:func:`headmech.probes.text.parse_sentences`), tokenises them with the model's
tokenizer and aligns every token with its word (:func:`headmech.probes.text.encode_parsed`).
Sentences whose token and word boundaries disagree (a token spanning two words, such as BERT's
``"cannot"`` for spaCy's ``"can"`` + ``"not"``) are dropped, so every word has at least one
token of its own.

Per sequence, ``ProbeBatch.extras`` holds (padded with -1 to the batch width):

* ``word_ids``: per token, its word index, -1 for special tokens and padding;
* ``word_heads``: per word, the index of its syntactic head (a root points to itself);
* ``word_deps``: per word, the index of its dependency label in ``extras["dep_labels"]``;

and, per batch, ``dep_labels``: the label vocabulary (:data:`DEP_LABELS`, then any label the
parser produced that is not in it, in order of appearance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headmech.probes import Probe, ProbeOptions, batch_sequences, load_sentences, register_probe

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["DEP_LABELS", "parsed_prose_probe"]

# spaCy's English (ClearNLP-style) labels, fixed so that label ids do not depend on the sample.
DEP_LABELS: tuple[str, ...] = (
    "ROOT", "acl", "acomp", "advcl", "advmod", "agent", "amod", "appos", "attr", "aux",
    "auxpass", "case", "cc", "ccomp", "compound", "conj", "csubj", "csubjpass", "dative",
    "dep", "det", "dobj", "expl", "intj", "mark", "meta", "neg", "nmod", "npadvmod",
    "nsubj", "nsubjpass", "nummod", "oprd", "parataxis", "pcomp", "pobj", "poss",
    "preconj", "predet", "prep", "prt", "punct", "quantmod", "relcl", "xcomp",
)  # fmt: skip


@register_probe("parsed_prose")
def parsed_prose_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """Corpus sentences with word alignment and dependency parses (see the module docstring).

    The sentences are the same sample as the ``prose`` probe's (same corpus, size and seed),
    less those that do not align with the model's tokens or do not fit its context.
    """
    from headmech.probes import text

    sentences = text.sample_sentences(
        load_sentences(options.corpus), options.n_sentences, options.seed
    )
    parsed = text.parse_sentences(sentences)
    encoded = text.encode_parsed(model.tokenizer, parsed, max_length=int(model.cfg.n_ctx))
    kept = [e for e in encoded if e.aligned and not e.truncated and len(e.parsed) > 0]
    labels = list(DEP_LABELS)
    label_id = {lab: i for i, lab in enumerate(labels)}
    extras: list[dict[str, Any]] = []
    for e in kept:
        for dep in e.parsed.deps:
            if dep not in label_id:  # a parser with labels beyond spaCy's English set
                label_id[dep] = len(labels)
                labels.append(dep)
        extras.append(
            {
                "word_ids": e.word_ids,
                "word_heads": list(e.parsed.heads),
                "word_deps": [label_id[d] for d in e.parsed.deps],
            }
        )
    batches = batch_sequences(
        [e.input_ids for e in kept], model.tokenizer, options.batch_size, extras
    )
    for b in batches:
        b.extras["dep_labels"] = tuple(labels)
    info = {
        "n_sentences": len(kept),
        "n_dropped": len(encoded) - len(kept),
        "n_words": sum(len(e.parsed) for e in kept),
    }
    return Probe("parsed_prose", batches, info)
