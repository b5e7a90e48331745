"""Reading GGUF files and writing new ones from copied metadata and byte-exact tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor

from packages.errors import PackageError

# Keys the writer derives itself; copying them would duplicate them.
_DERIVED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


class SlicedReader(GGUFReader):
    """GGUFReader, its fields and tensors sliced from a plain ndarray view of the mapping.

    Slicing np.memmap runs Python code per slice (its __getitem__ and __array_finalize__), and
    the reader slices a few times per vocabulary entry: on a 128k vocabulary that was most of
    the seconds an open took. The values and the mapping are the same.
    """

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None,
    ) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        kind = np.dtype(dtype)
        arr = plain[offset:offset + kind.itemsize * count].view(kind)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF read-only (memory-mapped), turning any parse failure into one clear line."""
    if not path.is_file():
        raise PackageError(f"missing file: {path}")
    try:
        return SlicedReader(path, "r")
    except Exception as exc:  # noqa: BLE001 -- the reader raises ValueError, struct.error, IndexError, ...
        raise PackageError(f"not a valid GGUF file: {path} ({type(exc).__name__}: {exc})") from None


def architecture_of(reader: GGUFReader) -> str:
    return str(field_value(reader, "general.architecture"))


def field_value(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise PackageError(f"GGUF metadata lacks '{key}'")
    return field.contents()


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None


def metadata_of(reader: GGUFReader) -> list[KeyValue]:
    """Every metadata entry the writer does not derive, in file order."""
    out = []
    for key, field in reader.fields.items():
        if key in _DERIVED_KEYS:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        out.append(KeyValue(key, field.contents(), field.types[0], sub))
    return out


@dataclass(frozen=True)
class TensorCopy:
    """A tensor to write under `name`, with its bytes taken unchanged from `source`."""

    name: str
    source: ReaderTensor


@dataclass(frozen=True)
class Written:
    """What write_gguf wrote: its size and sha256, taken from the bytes as they went out."""

    size: int
    sha256: str


_CHUNK = 4 * 1024 * 1024


class SourceDigest:
    """The sha256 of a whole source file, fed the tensor bytes a writer copies out of it.

    Bytes are hashed in file order: a copy at the cursor is hashed from the buffer already in
    hand; a copy past it first hashes the gap (header, padding) from `data`; a copy behind it
    was hashed before. `hexdigest` hashes what is left. Copying in file order reads it once.
    """

    def __init__(self, data: np.ndarray) -> None:
        self._data = data.data.cast("B")
        self._digest = hashlib.sha256()
        self._cursor = 0

    def feed(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        if end <= self._cursor:
            return
        if offset > self._cursor:
            self._hash_source(offset)
        self._digest.update(chunk[self._cursor - offset:])
        self._cursor = end

    def hexdigest(self) -> str:
        self._hash_source(len(self._data))
        return self._digest.hexdigest()

    def _hash_source(self, upto: int) -> None:
        while self._cursor < upto:
            step = min(upto, self._cursor + _CHUNK)
            self._digest.update(self._data[self._cursor:step])
            self._cursor = step


def write_gguf(
    dest: Path,
    architecture: str,
    metadata: Iterable[KeyValue],
    tensors: Iterable[TensorCopy],
    source: SourceDigest | None = None,
) -> Written:
    """Write a GGUF; quantized tensor blocks are copied byte for byte, and hashed on the way out
    (and fed to `source`, the digest of the file they come from, when given)."""
    writer = GGUFWriter(dest, architecture)
    for kv in metadata:
        if kv.key == "general.alignment":
            writer.data_alignment = int(kv.value)
        writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    items = list(tensors)
    for item in items:
        data = item.source.data
        writer.add_tensor_info(
            item.name, data.shape, data.dtype, data.nbytes, item.source.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    out = writer.fout[0]
    out.flush()
    with dest.open("rb") as f:  # the header, tensor infos and metadata: small, and just written
        digest = hashlib.sha256(f.read(out.tell()))
    size = out.tell()
    for item in items:
        size = _write_tensor(out, digest, size, item.source, writer.data_alignment, source)
    writer.close()
    return Written(size, digest.hexdigest())


def _write_tensor(out: BinaryIO, digest: Any, at: int, tensor: ReaderTensor, align: int,
                  source: SourceDigest | None) -> int:
    """Write `tensor`'s bytes at offset `at`, padded before and after to `align` as GGUFWriter
    pads them, into `out` and `digest`; return the offset after them."""
    pad = bytes(-at % align)
    digest.update(pad)
    out.write(pad)
    data = np.ascontiguousarray(tensor.data).data.cast("B")
    for i in range(0, len(data), _CHUNK):
        block = data[i:i + _CHUNK]
        digest.update(block)
        if source is not None:
            source.feed(int(tensor.data_offset) + i, block)
        out.write(block)
    tail = bytes(-len(data) % align)
    digest.update(tail)
    out.write(tail)
    return at + len(pad) + len(data) + len(tail)


def tensor_bytes(tensors: Iterable[ReaderTensor]) -> int:
    return sum(int(t.n_bytes) for t in tensors)
