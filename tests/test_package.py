"""Layer packages: round trip, tamper detection, atomicity, and clear CLI errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import write_tiny_llama

import packages.writer as writer_module
from packages.errors import PackageError
from packages.gguf_files import field_value, open_gguf
from packages.manifest import MANIFEST_NAME, load_manifest
from packages.materialize import materialize_stage
from packages.validate import validate_package
from packages.writer import write_package
from stage.engine import Step
from stage.llama_engine import EngineConfig, LlamaRangeEngine

pytestmark = pytest.mark.mesh


def _quiet(_: str) -> None:
    pass


def _copy(package: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "pkg"
    shutil.copytree(package, dest)
    return dest


def mesh(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_round_trip_write_validate_materialize_load(tiny_package, tmp_path):
    manifest, sha = validate_package(tiny_package)
    assert manifest.layer_count == 4
    assert manifest.allowed_cuts == (1, 2, 3)
    assert len(manifest.layers) == 4
    assert all(a.sha256 for a in manifest.artifacts())
    stage = materialize_stage(tiny_package, manifest, sha, 1, 3, tmp_path)
    reader = open_gguf(stage)
    assert field_value(reader, "llama.block_count") == 2
    names = {t.name for t in reader.tensors}
    assert "blk.0.attn_q.weight" in names
    assert "blk.1.attn_q.weight" in names
    assert "blk.2.attn_q.weight" not in names
    assert "token_embd.weight" in names
    engine = LlamaRangeEngine(stage, EngineConfig(first=False, final=False, lanes=1, ctx_per_lane=64))
    try:
        out = engine.step([Step(lane=0, start=0, hidden=np.ones((3, 64), dtype=np.float32))])[0]
        assert out.shape == (3, 64)
        assert np.isfinite(out).all()
    finally:
        engine.close()


def test_materialize_is_cached_and_rebuilt_when_tampered(tiny_package, tmp_path):
    manifest, sha = load_manifest(tiny_package)
    first = materialize_stage(tiny_package, manifest, sha, 0, 2, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert materialize_stage(tiny_package, manifest, sha, 0, 2, tmp_path).stat().st_mtime_ns == stamp
    with first.open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"XXXXXXXX")
    rebuilt = materialize_stage(tiny_package, manifest, sha, 0, 2, tmp_path)
    assert validate_stage_digest(rebuilt)


def validate_stage_digest(path: Path) -> bool:
    from packages.integrity import sha256_file

    return sha256_file(path) == path.with_suffix(".sha256").read_text().strip()


def test_tampered_layer_is_detected(tiny_package, tmp_path):
    pkg = _copy(tiny_package, tmp_path)
    layer = pkg / "layers" / "layer-00002.gguf"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"sha256 mismatch in layers/layer-00002\.gguf"):
        validate_package(pkg)
    manifest, sha = load_manifest(pkg)
    with pytest.raises(PackageError, match="layer-00002"):
        materialize_stage(pkg, manifest, sha, 2, 4, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_manifest_problems_name_the_field(tiny_package, tmp_path):
    pkg = _copy(tiny_package, tmp_path)
    doc = json.loads((pkg / MANIFEST_NAME).read_text())
    cases = {
        "unknown field 'surprise'": lambda d: d.update(surprise=1),
        "missing field 'layer_count'": lambda d: d.pop("layer_count"),
        "lists 3 layers but layer_count is 4": lambda d: d["layers"].pop(),
        "escapes the package": lambda d: d["layers"][0].update(path="../../etc/passwd"),
        r"unsafe for llama|allowed_cuts": lambda d: d.update(allowed_cuts=[0]),
    }
    for message, mutate in cases.items():
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        (pkg / MANIFEST_NAME).write_text(json.dumps(bad))
        with pytest.raises(PackageError, match=message):
            validate_package(pkg)


def test_layer_count_must_match_metadata(tiny_package, tmp_path):
    pkg = _copy(tiny_package, tmp_path)
    doc = json.loads((pkg / MANIFEST_NAME).read_text())
    doc["layer_count"] = 3
    doc["layers"].pop()
    doc["allowed_cuts"] = [1, 2]
    (pkg / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(PackageError, match="layer_count"):
        validate_package(pkg)


def test_failed_write_leaves_nothing_behind(tiny_gguf, tmp_path, monkeypatch):
    real = writer_module._write_artifact
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "_write_artifact", failing)
    with pytest.raises(OSError, match="disk full"):
        write_package(tiny_gguf, tmp_path / "out", progress=_quiet)
    assert list(tmp_path.iterdir()) == []


def test_refuses_nonempty_output_dir(tiny_gguf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(PackageError, match="not empty"):
        write_package(tiny_gguf, tmp_path / "out", progress=_quiet)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def _assert_clean_failure(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("mesh package: error:"), result.stderr
    assert needle in lines[-1], result.stderr


def test_cli_bad_inputs_fail_cleanly(tiny_gguf, tiny_package, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:5000])
    alien = write_tiny_llama(tmp_path / "alien.gguf", layers=2)
    alien.write_bytes(alien.read_bytes().replace(b"llama", b"dream", 1))
    cases = [
        (("package", "write", garbage, tmp_path / "o1"), "not a valid GGUF"),
        (("package", "write", truncated, tmp_path / "o2"), "not a valid GGUF"),
        (("package", "write", tmp_path / "absent.gguf", tmp_path / "o3"), "missing file"),
        (("package", "write", alien, tmp_path / "o4"), "cannot serve architecture 'dream': a diffusion"),
        (("package", "validate", tmp_path / "nope"), "not a package directory"),
        (("package", "materialize", tiny_package, "--range", "2:2", "--cache-dir", tmp_path / "c"),
         "empty"),
        (("package", "materialize", tiny_package, "--range", "1:9", "--cache-dir", tmp_path / "c"),
         "outside"),
    ]
    for args, needle in cases:
        _assert_clean_failure(mesh(*args), needle)
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir() if p.is_dir())
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").rglob("*.gguf"))


def test_cli_tampered_package_and_disallowed_cut(tiny_package, gemma3_package, tmp_path):
    pkg = _copy(tiny_package, tmp_path)
    (pkg / "shared" / "embeddings.gguf").write_bytes(b"\0" * 10)
    _assert_clean_failure(mesh("package", "validate", pkg), "shared/embeddings.gguf")
    result = mesh("package", "materialize", gemma3_package, "--range", "0:11",
                  "--cache-dir", tmp_path / "c")
    _assert_clean_failure(result, "cut at layer 11 is not allowed")


def test_cli_write_inspect_validate(tiny_gguf, tmp_path):
    out = tmp_path / "pkg"
    assert mesh("package", "write", tiny_gguf, out, "--model-id", "tiny").returncode == 0
    shown = mesh("package", "inspect", out).stdout
    for needle in ("architecture", "llama", "layers", "allowed cuts", "quantization"):
        assert needle in shown
    ok = mesh("package", "validate", out)
    assert ok.returncode == 0
    assert ok.stdout.startswith("ok: tiny")
