"""The ``domains`` probe: the same model read on several kinds of input.

Guo et al. 2024 find heads that are dormant (they park attention on the first token and
write almost nothing) on some input domains and active on others, so whether a head is
inactive is a question asked per domain. This probe holds three, each in its own batches
(``extras["domain"]`` names it):

* ``prose`` — sentences of the prose corpus (the default CPython documentation prose, or
  the user's ``corpus``), sampled as the ``prose`` probe samples them, without parses;
* ``code`` — short Python functions written from templates with seeded names and
  numbers (deterministic, no file needed);
* ``repeated_random`` — BOS + random tokens + the same tokens again (Olsson et al.).

``n_sequences`` sequences per domain (``half_len`` tokens in each random half).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from headmech.probes import (
    Probe,
    ProbeOptions,
    batch_sequences,
    encode_sentences,
    load_sentences,
    register_probe,
    repeated_random_probe,
)

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["DOMAINS", "code_snippets", "domains_probe"]

DOMAINS: tuple[str, ...] = ("prose", "code", "repeated_random")

_NAMES = ("total", "count", "value", "items", "result", "index", "width", "offset", "size")
_FUNCS = ("scale", "merge", "update", "parse", "clip", "shift", "reduce", "render")
_OPS = ("+", "-", "*", "//", "%")
_TEMPLATES = (
    "def {f}({a}, {b}):\n    {c} = {a} {op} {b}\n    return {c} * {n}\n",
    "def {f}({a}):\n    {c} = 0\n    for i in range({n}):\n        {c} += {a}[i]\n    return {c}\n",
    "def {f}({a}, {b}={n}):\n    if {a} > {b}:\n        return {a} {op} {b}\n    return {b}\n",
    "{c} = [{a} {op} {n} for {a} in range({b})]\nprint(len({c}), {c}[-1])\n",
)


def code_snippets(n: int, seed: int) -> list[str]:
    """``n`` short Python snippets from templates, names and numbers drawn from ``seed``
    (a private generator: global state is untouched)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.sample(_NAMES, 3)
        out.append(
            rng.choice(_TEMPLATES).format(
                f=rng.choice(_FUNCS), a=a, b=b, c=c, op=rng.choice(_OPS), n=rng.randint(2, 99)
            )
        )
    return out


@register_probe("domains", "prose, Python code and repeated random tokens, in separate batches")
def domains_probe(model: TransformerBridge, options: ProbeOptions) -> Probe:
    """Batches of each domain of :data:`DOMAINS` (module docstring)."""
    from headmech.probes.corpus import sample_sentences

    tokenizer = model.tokenizer
    prose = sample_sentences(load_sentences(options.corpus), options.n_sequences, options.seed)
    texts = {"prose": prose, "code": code_snippets(options.n_sequences, options.seed)}
    batches = []
    for domain, sentences in texts.items():
        for b in batch_sequences(encode_sentences(model, sentences), tokenizer, options.batch_size):
            b.extras["domain"] = domain
            batches.append(b)
    for b in repeated_random_probe(model, options).batches:
        b.extras["domain"] = "repeated_random"
        batches.append(b)
    info = {"domains": list(DOMAINS), "n_per_domain": options.n_sequences}
    return Probe("domains", batches, info)
