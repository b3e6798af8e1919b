"""Options, without torch: the probes' sizes and sources (:class:`ProbeOptions`, which
:mod:`headmech.probes` re-exports) and a registered method's typed options
(:func:`build_options`, :func:`parse_options`), checked before anything heavy is imported."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headmech.core.errors import HeadmechError

if TYPE_CHECKING:
    from headmech.core.registry import Entry

__all__ = ["PROBE_FLAG_NAMES", "PROBE_PARAMETERS", "ProbeOptions", "build_options", "parse_options"]


@dataclass
class ProbeOptions:
    """Sizes and sources of probe data; ``classify(**probe_options)`` fills these.

    Attributes:
        corpus: a text file, a list of sentences, or None for the default prose corpus.
        n_sentences: prose sentences sampled from the corpus.
        n_sequences: repeated-random-token sequences.
        half_len: tokens in each half of a repeated sequence.
        batch_size: sequences per forward pass.
        seed: seeds every sampler.
        needle_lengths: haystack sizes in tokens of the ``needle`` probe (scaled down to
            fit the model's context).
        needle_depths: where the needle sits in each haystack (0 = start, 1 = end).
    """

    corpus: str | os.PathLike | Sequence[str] | None = None
    n_sentences: int = 256
    n_sequences: int = 32
    half_len: int = 32
    batch_size: int = 16
    seed: int = 0
    needle_lengths: tuple[int, ...] = (300, 700, 1100, 1500)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def __post_init__(self) -> None:
        from headmech.core.checks import probe_options

        probe_options(self)  # one-line InputError on a count < 1, a bad seed, ...


def build_options(entry: Entry[Any], options: dict[str, Any]) -> Any:
    """An instance of the entry's options dataclass from keyword options.

    Raises:
        HeadmechError: an option the entry does not take (one line naming the ones it
            does), or options given to an entry that takes none.
    """
    if entry.options is None:
        if options:
            raise HeadmechError(f"'{entry.name}' takes no options, got {', '.join(options)}")
        return None
    fields = {f.name for f in dataclasses.fields(entry.options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise HeadmechError(
            f"'{entry.name}' has no option {', '.join(unknown)} (it takes: {', '.join(sorted(fields)) or 'none'})"
        )
    return entry.options(**options)


def parse_options(entry: Entry[Any], pairs: Sequence[str]) -> dict[str, Any]:
    """``["chunk=4", "direction=denoising"]`` → typed keyword options for ``entry``.

    Each value is converted to its field's type (``int``, ``float``, ``bool``, ``str``,
    ``None`` for ``none``); a malformed pair or an unknown field is a one-line error.
    """
    if entry.options is None:
        if pairs:
            raise HeadmechError(f"'{entry.name}' takes no options")
        return {}
    fields = {f.name: f for f in dataclasses.fields(entry.options)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise HeadmechError(f"options are KEY=VALUE, got '{pair}'")
        if key not in fields:
            raise HeadmechError(
                f"'{entry.name}' has no option '{key}' (it takes: {', '.join(sorted(fields)) or 'none'})"
            )
        out[key] = _convert(str(fields[key].type), raw.strip(), key)
    return out


def _convert(type_name: str, raw: str, key: str) -> Any:
    if raw.lower() == "none" and "None" in type_name:
        return None
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
        if type_name.startswith("tuple[float"):
            return tuple(float(x) for x in raw.split(",") if x.strip())
        if type_name.startswith("tuple[int"):
            return tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise HeadmechError(f"option '{key}' takes a {type_name}, got '{raw}'") from None
    return raw


def _numbers(kind: type, low: float, high: float | None) -> Any:
    """A flag's comma-separated numbers of ``kind`` within ``[low, high]``."""

    def parse(text: str, flag: str) -> tuple[Any, ...]:
        from headmech.core.checks import number_list

        return number_list(text, flag, kind, low=low, high=high)

    return parse


def _seed(value: Any, name: str) -> int:
    from headmech.core.checks import seed

    return seed(value, name)


def _probe_parameters() -> dict[str, Any]:
    from headmech.core.constraints import Custom, Integer, Param

    return {
        "n_sentences": Param(Integer(1), "--n-sentences"),
        "n_sequences": Param(Integer(1), "--n-sequences"),
        "half_len": Param(Integer(2), "--half-len"),
        "batch_size": Param(Integer(1), "--batch-size"),
        "seed": Param(Custom(_seed), "--seed", default=0),
        "needle_lengths": Param(None, "--context", _numbers(int, 1, None)),
        "needle_depths": Param(None, "--depths", _numbers(float, 0, 1)),
    }


#: the probe options' parameters (:mod:`headmech.core.constraints`): the sizes every
#: command that builds a probe takes, with their flags (``--context`` and ``--depths`` are
#: the needle's lengths and depths); ``corpus`` is classify's alone
PROBE_PARAMETERS = _probe_parameters()
#: the parsed arguments' names of the parameters whose flag is not their keyword
PROBE_FLAG_NAMES = {"needle_lengths": "context", "needle_depths": "depths"}
