"""Result files: how every result headmech saves (``catalog.json``, ``pruning.json``,
``importance.json``, ``plan.json``, ``discovery.json``) is written and read back.

A :class:`FileSchema` describes one kind of file: its name in messages, its file name in a
folder, its schema version, the top-level keys every such file has (which tell one kind
from another) and the error it raises. It owns the header every file starts with
(``schema_version``, ``headmech_version`` where that kind records it, ``provenance``),
writes deterministic JSON (:func:`headmech.runs.provenance.dumps`: sorted keys, floats
rounded to 6 decimals; or, with ``exact``, values that read back bit for bit through
:mod:`headmech.core.exact_json`) and tensors as a ``.safetensors`` file beside the JSON, and reads them back with a
one-line :class:`~headmech.core.errors.ResultFileError` (or the schema's subclass) for a
missing, corrupt, other-kind or newer-schema file. Nothing is ever pickled.

:class:`ResultFile` is the base of the result classes: ``save``, ``load``, ``to_json`` and
equality (``load(save(x)) == x``) from two methods each class writes, ``_body`` (the
contents but for the header) and ``_from_json`` (the object from the contents).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from headmech._version import __version__
from headmech.core.errors import HeadmechError, InputError, ResultFileError
from headmech.core.exact_json import decode, encode
from headmech.runs.provenance import dumps

__all__ = ["SCHEMAS", "FileSchema", "ResultFile", "write_text"]

R = TypeVar("R", bound="ResultFile")

# every schema made, by its name: a file of one kind read as another is named in the error
SCHEMAS: dict[str, FileSchema] = {}


def write_text(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all (a temporary file
    beside it, renamed): a killed process never leaves half a result file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:  # the umask's permissions, like any file written
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _release(version: Any) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.2.0.dev1"`` → ``(0, 2, 0)``."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


@dataclass(frozen=True)
class FileSchema:
    """One kind of result file.

    Attributes:
        name: what the file is, in messages ("catalog", "KV plan").
        filename: its name inside a result folder (``catalog.json``).
        version: the schema version written, and the newest one read.
        required: the top-level keys every such file has: a file with another schema's
            keys is named as that kind in the error.
        headmech_version: the header records the headmech version that wrote the file
            (a file from a newer headmech is read with a one-line warning).
        error: the :class:`~headmech.core.errors.ResultFileError` subclass raised.
        exact: values stored exactly (:mod:`headmech.core.exact_json`: tensors as bytes,
            floats by ``repr``) instead of rounded to 6 decimals.
    """

    name: str
    filename: str
    version: str
    required: tuple[str, ...] = ()
    headmech_version: bool = True
    error: type[HeadmechError] = ResultFileError
    exact: bool = False

    def __post_init__(self) -> None:
        SCHEMAS[self.name] = self

    # --- writing ---------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        """``schema_version`` and, where recorded, ``headmech_version``."""
        out: dict[str, Any] = {"schema_version": self.version}
        if self.headmech_version:
            out["headmech_version"] = __version__
        return out

    def text(self, data: Mapping[str, Any]) -> str:
        """The file's text for JSON data (:meth:`contents`): deterministic
        (:func:`~headmech.runs.provenance.dumps`); with ``exact``, the same layout, floats
        by ``repr`` (NaN and infinities as Python's ``json`` writes them)."""
        if self.exact:
            return json.dumps(dict(data), indent=1, sort_keys=True) + "\n"
        return dumps(data)

    def contents(
        self, body: Mapping[str, Any], provenance: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The file's contents as JSON data, as :meth:`write` takes them (and :meth:`read`
        gives them back; decoded, with ``exact``): the header, ``body`` and ``provenance``
        (when not None)."""
        data = {**self.header(), **body}
        if provenance is not None:
            data["provenance"] = provenance
        return dict(json.loads(self.text(encode(data) if self.exact else data)))

    def target(self, path: str | os.PathLike) -> Path:
        """Where :meth:`write` writes: ``path`` itself when it ends in ``.json``, else
        :attr:`filename` inside the folder ``path`` (made). A one-line
        :class:`~headmech.core.errors.InputError` when a file stands in the way."""
        p = Path(path)
        if p.exists() and not p.is_dir() and p.suffix != ".json":
            raise InputError(f"cannot save the {self.name} in {p}: an existing file, not a folder")
        above = next((a for a in p.parents if a.exists()), None)
        if above is not None and not above.is_dir():
            raise InputError(f"cannot save the {self.name} in {p}: {above} is a file, not a folder")
        if p.suffix == ".json":
            p.parent.mkdir(parents=True, exist_ok=True)
            return p
        p.mkdir(parents=True, exist_ok=True)
        return p / self.filename

    def write(
        self,
        path: str | os.PathLike,
        data: Mapping[str, Any],
        tensors: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write ``data`` (already holding the header: :meth:`contents`) to
        :meth:`target`, and ``tensors`` (name → tensor) as safetensors beside it (same
        stem), named under the key ``tensors``; returns the JSON path. The same data
        always gives the same bytes; each file is written whole or not at all."""
        p = self.target(path)
        if tensors:
            from safetensors.torch import save as save_tensors

            side = p.with_suffix(".safetensors")
            data = {**data, "tensors": side.name}
            meta = {"schema": self.name, "schema_version": self.version}
            blob = save_tensors({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
            write_text(side, blob)
        write_text(p, self.text(data))
        return p

    # --- reading ---------------------------------------------------------------
    def source(self, path: str | os.PathLike) -> Path:
        """The file :meth:`read` reads: ``path``, or :attr:`filename` in the folder ``path``."""
        p = Path(path)
        return p / self.filename if p.is_dir() else p

    def read(self, path: str | os.PathLike) -> dict[str, Any]:
        """The contents of a file of this kind (a folder: its :attr:`filename`).

        Raises:
            ResultFileError: (this schema's :attr:`error`) no such file, not JSON, not a
                JSON object, a file of another kind, of an unknown or newer schema
                version, or without one of the :attr:`required` keys; one line each.
        """
        p = self.source(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise self.error(f"no {self.name} file at {p}") from None
        except IsADirectoryError:
            raise self.error(f"{p} is a folder, not a {self.name} file") from None
        except UnicodeDecodeError as e:
            raise self.error(f"{p} is not a headmech {self.name}: not valid JSON ({e})") from None
        except OSError as e:
            raise self.error(f"cannot read the {self.name} file {p}: {e.strerror or e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise self.error(f"{p} is not a headmech {self.name}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise self.error(f"{p} is not a headmech {self.name}: the file holds no JSON object")
        other = self.kind_of(data)
        if other is not None and other is not self:
            raise self.error(f"{p} is a headmech {other.name}, not a {self.name}")
        self.check_version(data, p)
        missing = [k for k in self.required if k not in data]
        if missing:
            raise self.error(f"{p} is not a headmech {self.name}: it has no '{missing[0]}'")
        return decode(data) if self.exact else data

    def kind_of(self, data: Mapping[str, Any]) -> FileSchema | None:
        """The schema whose required keys ``data`` has (the one with most of them), if any."""
        fits = [s for s in SCHEMAS.values() if s.required and all(k in data for k in s.required)]
        return max(fits, key=lambda s: len(s.required), default=None)

    def check_version(self, data: Mapping[str, Any], path: str | os.PathLike) -> None:
        """Refuse a file of a newer schema than this headmech reads (one line); warn in one
        line when a newer headmech wrote it (what it added is not read)."""
        by = data.get("headmech_version")
        written = f" (written by headmech {by})" if by is not None else ""
        schema = data.get("schema_version")
        if schema is not None:
            if not re.fullmatch(r"\d+", str(schema)):
                raise self.error(
                    f"{path} has an unknown {self.name} schema version {schema!r}{written}"
                )
            if int(str(schema)) > int(self.version):
                raise self.error(
                    f"{path} is a {self.name} of schema {schema}{written}; this headmech "
                    f"({__version__}) reads schema {self.version} or older: upgrade headmech"
                )
        if by is not None and _release(by) > _release(__version__):
            from headmech.core.checks import warn

            warn(
                f"{path} was written by headmech {by}, newer than this one ({__version__}): "
                "anything it added is ignored"
            )

    def read_tensors(self, path: str | os.PathLike) -> dict[str, Any]:
        """The tensors :meth:`write` stored beside the file at ``path`` (none: ``{}``);
        a one-line error for a missing, corrupt or other-kind safetensors file."""
        p = self.source(path)
        data = self.read(p)
        name = data.get("tensors")
        if name is None:
            return {}
        side = p.parent / str(name)
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(side), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except FileNotFoundError:
            raise self.error(f"no tensors file at {side} (named by {p})") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise self.error(f"{side} is not a safetensors file: {e}") from None
        if meta.get("schema") != self.name:
            raise self.error(f"{side} holds no tensors of a headmech {self.name}")
        return tensors

    @contextmanager
    def parsing(self, path: str | os.PathLike) -> Iterator[None]:
        """Turn what a malformed file raises while it is parsed (``KeyError``,
        ``ValueError``, ``TypeError``, ...) into a one-line error naming the file."""
        try:
            yield
        except HeadmechError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            why = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise self.error(f"{self.source(path)} is not a headmech {self.name}: {why}") from None


class ResultFile:
    """The base of headmech's result classes: one :class:`FileSchema`, ``SCHEMA``.

    A subclass writes ``_body()`` (its file's contents but for the header) and
    ``_from_json(data)`` (the object from a file's contents; ``KeyError``, ``ValueError``
    and the like for a malformed one), keeps a ``provenance`` dict, and may write figures
    beside the file (``_figures(folder)``). A dataclass subclass is declared with
    ``eq=False``, so that equality is the base's: the same file contents.
    """

    SCHEMA: ClassVar[FileSchema]
    provenance: dict[str, Any]

    def _body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_json(cls: type[R], data: dict[str, Any]) -> R:
        raise NotImplementedError(f"{cls.__name__} files are written, not read back")

    def _figures(self, folder: Path) -> None:
        """Figures written beside the file when it is saved into a folder (none here)."""

    def to_json(self) -> dict[str, Any]:
        """The file's contents: the header, the result, the provenance."""
        return self.SCHEMA.contents(self._body(), self.provenance)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file: a folder gets :attr:`FileSchema.filename` (and the class's
        figures), a path ending in ``.json`` the JSON alone. Returns the JSON path; the
        same result always gives the same bytes."""
        p = self.SCHEMA.write(path, self.to_json())
        if Path(path).suffix != ".json":
            self._figures(p.parent)
        return p

    @classmethod
    def load(cls: type[R], path: str | os.PathLike) -> R:
        """Read a file :meth:`save` wrote (or its folder); a one-line error (the schema's
        :class:`~headmech.core.errors.ResultFileError`) if it is not one."""
        data = cls.SCHEMA.read(path)
        with cls.SCHEMA.parsing(path):
            return cls._from_json(data)

    def __eq__(self, other: object) -> bool:
        """Equal when they write the same file."""
        return isinstance(other, type(self)) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]
