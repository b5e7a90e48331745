"""A GGUF's header alone: its metadata and tensor infos, never its tensor data.

`mesh plan` sizes a model before any of it is fetched, so it reads a local file's header
(a file cut off after it reads the same) or the first bytes of a remote one, asked for in
growing ranges until the header parses (a large vocabulary makes it several MiB).
Split GGUFs (`-00001-of-00003.gguf`) hold their tensors across shards, each with its own
header: every shard's header is read.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

from packages.errors import PackageError
from packages.gguf_files import KeyValue, SlicedReader, architecture_of, metadata_of
from packages.manifest import load_manifest

FIRST_READ = 4 << 20  # bytes first asked of a remote header; doubled while it does not parse
MOST_READ = 512 << 20  # no header is this large: past it the file is not a GGUF
ReadRange = Callable[[int, int], bytes]  # the bytes [start, end) of a file; fewer at its end
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the input dimension first
    type_name: str  # the GGML type, as `gguf.GGMLQuantizationType` names it
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def of(tensor: ReaderTensor) -> TensorInfo:
        return TensorInfo(tensor.name, tuple(int(n) for n in tensor.shape), tensor.tensor_type.name,
                          int(tensor.n_bytes))


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    metadata: tuple[KeyValue, ...]  # every entry the package writer copies, in file order
    tensors: tuple[TensorInfo, ...]
    header_bytes: int  # what was read of the file(s): the headers, not the weights

    def value(self, key: str) -> Any:
        return next((kv.value for kv in self.metadata if kv.key == key), None)


class _HeaderReader(SlicedReader):
    """The reader's own parser for fields and tensor infos; the tensors' data is never touched,
    so the file may end where the header does."""

    infos: list[TensorInfo]
    header_end: int

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self.infos = []
        for field in fields:
            _, name, _, dims, raw_type, _ = field.parts
            kind = GGMLQuantizationType(int(raw_type[0]))
            shape = tuple(int(n) for n in dims)
            block, size = GGML_QUANT_SIZES[kind]
            self.infos.append(TensorInfo(bytes(name).decode(), shape, kind.name, math.prod(shape) * size // block))
        last = fields[-1] if fields else list(self.fields.values())[-1]
        self.header_end = int(last.offset) + sum(int(p.nbytes) for p in last.parts)
        if self.header_end > len(self.data):
            raise ValueError("the header runs past the bytes read")


def read_header(path: Path) -> GGUFInfo:
    """A local GGUF's header (every shard's, for a split GGUF)."""
    if not path.is_file():
        raise PackageError(f"missing file: {path}")
    first = _parse(path, str(path))
    shards = [first] + [_parse(path.with_name(name), name) for name in _other_shards(path.name, first)]
    return _joined(shards)


def read_remote_header(name: str, read_range: Callable[[str], ReadRange]) -> GGUFInfo:
    """A remote GGUF's header by ranges of its bytes: `read_range(file name)` reads that file
    (a shard of a split GGUF lies beside the first)."""
    first = _parse_prefix(read_range(name), name)
    shards = [first] + [_parse_prefix(read_range(_sibling(name, other)), other)
                        for other in _other_shards(name.rsplit("/", 1)[-1], first)]
    return _joined(shards)


def _parse(path: Path, label: str) -> _HeaderReader:
    try:
        return _HeaderReader(path, "r")
    except Exception as exc:  # noqa: BLE001 -- the reader raises ValueError, struct.error, IndexError, ...
        raise PackageError(f"not a valid GGUF header: {label} ({type(exc).__name__}: {exc})") from None


def _parse_prefix(read: ReadRange, label: str) -> _HeaderReader:
    """Parse the header from a growing prefix of the file, kept in a temporary file (the
    reader maps a file)."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as tmp:
        have, want = 0, FIRST_READ
        while True:
            chunk = read(have, want)
            tmp.write(chunk)
            tmp.flush()
            have += len(chunk)
            try:
                return _HeaderReader(Path(tmp.name), "r")
            except Exception as exc:  # noqa: BLE001 -- a prefix cut inside the header fails to parse
                if have < want or want >= MOST_READ:  # the whole file, or more than any header
                    raise PackageError(f"not a valid GGUF header: {label} ({type(exc).__name__}: {exc}; "
                                       f"{have} bytes read)") from None
            want *= 2


def _other_shards(name: str, first: _HeaderReader) -> list[str]:
    """The names of a split GGUF's shards after the first, from `split.count`."""
    field = first.fields.get("split.count")
    count = int(field.contents()) if field is not None else 1
    match = _SHARD.search(name)
    if count <= 1:
        return []
    if match is None or int(match[1]) != 1:
        raise PackageError(f"{name} is one shard of a split GGUF of {count}: name its first shard, "
                           "…-00001-of-…gguf")
    stem = name[:match.start()]
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(2, count + 1)]


def _sibling(path: str, name: str) -> str:
    folder = path.rsplit("/", 1)[0] if "/" in path else ""
    return f"{folder}/{name}" if folder else name


def _joined(shards: list[_HeaderReader]) -> GGUFInfo:
    tensors = tuple(t for shard in shards for t in shard.infos)
    return GGUFInfo(architecture_of(shards[0]), tuple(metadata_of(shards[0])), tensors,
                    sum(s.header_end for s in shards))


def read_package_header(package_dir: Path) -> GGUFInfo:
    """A layer package's headers as one GGUF's: its metadata artifact's entries and every
    artifact's tensor infos (a package keeps the source's tensor names)."""
    manifest, _ = load_manifest(package_dir)
    if "metadata" not in manifest.shared:
        raise PackageError(f"{package_dir}: the package has no shared metadata artifact")
    meta = _parse(package_dir / manifest.shared["metadata"].path, str(package_dir))
    parts = [_parse(package_dir / a.path, a.path) for a in manifest.artifacts() if a.path.endswith(".gguf")]
    return GGUFInfo(manifest.architecture, tuple(metadata_of(meta)), tuple(t for p in parts for t in p.infos),
                    sum(p.header_end for p in parts))
