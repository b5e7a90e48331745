"""packages/gguf_header.py: a GGUF's scalar metadata through ggml's parser, as GGUFReader reads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from packages.errors import PackageError
from packages.gguf_files import open_gguf
from packages.gguf_header import read_scalars
from packages.manifest import MANIFEST_NAME
from packages.validate import validate_package


def test_every_scalar_reads_as_gguf_reader_reads_it(tiny_gguf: Path) -> None:
    fields = open_gguf(tiny_gguf).fields
    scalars = {k: f.contents() for k, f in fields.items() if len(f.types) == 1 and not k.startswith("GGUF.")}
    arrays = [k for k, f in fields.items() if len(f.types) > 1]
    assert {"general.architecture", "llama.block_count", "llama.embedding_length"} <= set(scalars)
    assert arrays  # the tokenizer's: left out, not decoded
    read = read_scalars(tiny_gguf, [*scalars, *arrays, "no.such.key"])
    assert set(read) == set(scalars)
    for key, value in scalars.items():
        assert read[key] == pytest.approx(value) if isinstance(value, float) else read[key] == value, key


def test_a_file_ggml_cannot_read_is_named(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(PackageError, match=r"not a valid GGUF file: .*garbage\.gguf"):
        read_scalars(garbage, ["general.architecture"])
    with pytest.raises(PackageError, match="missing file"):
        read_scalars(tmp_path / "absent.gguf", ["general.architecture"])


def test_validate_checks_the_manifest_against_the_header(tiny_package: Path, tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_package, pkg)
    doc = json.loads((pkg / MANIFEST_NAME).read_text())
    width = read_scalars(pkg / doc["shared"]["metadata"]["path"], ["llama.embedding_length"])["llama.embedding_length"]
    doc["activation_width"] = int(width) + 1
    (pkg / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(PackageError, match=f"'activation_width' is {int(width) + 1} but metadata says {width}"):
        validate_package(pkg)
