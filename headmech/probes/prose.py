"""The ``prose`` probe: corpus sentences, parsed, word-aligned and with token counts.

One probe serves every prose-based head type, so they share one set of forward passes:
previous-token, positional and attention-sink types read only the tokens; syntactic types
compare attention with spaCy dependency parses, which are defined on words while attention
is defined on model tokens; rare-word types need each token's count in a reference corpus.

The sampled sentences are parsed with spaCy (:func:`headmech.probes.text.parse_sentences`),
tokenised with the model's tokenizer and aligned word by word
(:func:`headmech.probes.text.encode_parsed`). A sentence whose token and word boundaries
disagree (a token spanning two words, such as BERT's ``"cannot"`` for spaCy's ``"can"`` +
``"not"``) stays in the probe but carries no words, so word-level types skip it.

Per sequence, ``ProbeBatch.extras`` holds (padded with -1 to the batch width):

* ``word_ids``: per token, its word index; -1 for special tokens, padding and every token
  of an unaligned sentence;
* ``word_heads``: per word, the index of its syntactic head (a root points to itself);
* ``word_deps``: per word, the index of its dependency label in ``extras["dep_labels"]``;
* ``token_count``: per token, how often its id occurs in the whole corpus the sentences are
  sampled from (-1 for special tokens and padding; at least 1 otherwise);

and, per batch, ``dep_labels``: the label vocabulary (:data:`DEP_LABELS`, then any label the
parser produced that is not in it, in order of appearance).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from torch import Tensor

from headmech.core.errors import InputError
from headmech.probes import Probe, ProbeOptions, batch_sequences, load_sentences, register_probe

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["DEP_LABELS", "prose_probe", "reference_counts"]

# spaCy's English (ClearNLP-style) labels, fixed so that label ids do not depend on the sample.
DEP_LABELS: tuple[str, ...] = (
    "ROOT", "acl", "acomp", "advcl", "advmod", "agent", "amod", "appos", "attr", "aux",
    "auxpass", "case", "cc", "ccomp", "compound", "conj", "csubj", "csubjpass", "dative",
    "dep", "det", "dobj", "expl", "intj", "mark", "meta", "neg", "nmod", "npadvmod",
    "nsubj", "nsubjpass", "nummod", "oprd", "parataxis", "pcomp", "pobj", "poss",
    "preconj", "predet", "prep", "prt", "punct", "quantmod", "relcl", "xcomp",
)  # fmt: skip


@lru_cache(maxsize=4)
def _default_corpus_counts(tokenizer: Any, vocab_size: int) -> Tensor:
    """Token counts over the default corpus, once per tokenizer (tokenising ~700 sentences)."""
    from headmech.probes import text

    return text.token_frequencies(tokenizer, text.default_corpus(), vocab_size=vocab_size)


def reference_counts(model: TransformerBridge, corpus: Any = None) -> Tensor:
    """``[vocab]`` token counts over the whole corpus the probe samples from (default:
    :func:`headmech.probes.text.default_corpus`, cached)."""
    from headmech.probes import text

    tokenizer = model.tokenizer
    vocab = max(len(tokenizer), int(model.cfg.d_vocab))
    if corpus is None:
        return _default_corpus_counts(tokenizer, vocab)
    return text.token_frequencies(tokenizer, load_sentences(corpus), vocab_size=vocab)


@register_probe("prose")
def prose_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """Corpus sentences with word alignment, dependency parses and token counts (see the
    module docstring)."""
    from headmech.probes import text

    sentences = text.sample_sentences(
        load_sentences(options.corpus), options.n_sentences, options.seed
    )
    # parses only where spaCy is installed (the syntactic extra); the other types read tokens
    has_parses = text.parser_available()
    parsed = text.parse_sentences(sentences) if has_parses else text.unparsed(sentences)
    encoded = text.encode_parsed(model.tokenizer, parsed)
    n_ctx = int(model.cfg.n_ctx)
    for i, e in enumerate(encoded):
        if len(e.input_ids) > n_ctx:
            raise InputError(
                f"sentence {i} of the corpus has {len(e.input_ids)} tokens, more than the model's context of {n_ctx}"
            )
    counts = reference_counts(model, options.corpus)
    special_ids = set(model.tokenizer.all_special_ids)
    labels = list(DEP_LABELS)
    label_id = {lab: i for i, lab in enumerate(labels)}
    extras: list[dict[str, Any]] = []
    n_aligned = 0
    for e in encoded:
        aligned = e.aligned and len(e.parsed) > 0
        n_aligned += aligned
        for dep in e.parsed.deps:
            if dep not in label_id:  # a parser with labels beyond spaCy's English set
                label_id[dep] = len(labels)
                labels.append(dep)
        extras.append(
            {
                "word_ids": e.word_ids if aligned else [-1] * len(e.input_ids),
                "word_heads": list(e.parsed.heads) if aligned else [],
                "word_deps": [label_id[d] for d in e.parsed.deps] if aligned else [],
                "token_count": [-1 if t in special_ids else int(counts[t]) for t in e.input_ids],
            }
        )
    batches = batch_sequences(
        [e.input_ids for e in encoded], model.tokenizer, options.batch_size, extras
    )
    for b in batches:
        b.extras["dep_labels"] = tuple(labels)
    info = {
        "n_sentences": len(encoded),
        "n_aligned": n_aligned,
        "n_words": sum(len(e.parsed) for e in encoded),
        "parses": has_parses,
    }
    return Probe("prose", batches, info)
