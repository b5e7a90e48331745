"""Reading GGUF files and writing new ones from copied metadata and byte-exact tensors."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, ReaderTensor

from packages.errors import PackageError

# Keys the writer derives itself; copying them would duplicate them.
_DERIVED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF read-only (memory-mapped), turning any parse failure into one clear line."""
    if not path.is_file():
        raise PackageError(f"missing file: {path}")
    try:
        return GGUFReader(path, "r")
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


def write_gguf(
    dest: Path,
    architecture: str,
    metadata: Iterable[KeyValue],
    tensors: Iterable[TensorCopy],
) -> None:
    """Write a GGUF; quantized tensor blocks are copied byte for byte."""
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
    for item in items:
        writer.write_tensor_data(np.asarray(item.source.data))
    writer.close()


def tensor_bytes(tensors: Iterable[ReaderTensor]) -> int:
    return sum(int(t.n_bytes) for t in tensors)
