"""Resolving hf:// packages through a real huggingface_hub cache layout, offline (no Hub in CI).

The cache is built file by file the way huggingface_hub lays it out (tests/hub_cache.py); the
code under test is the real resolution path (hf_hub_download with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from hub_cache import COMMIT, OTHER_COMMIT, add_files, cache_package, package_files, repo_dir, use_hf_home
from mesh_server import mesh_serve

import packages.hub as hub_module
from mesh.model.source import resolve_model
from packages import hub
from packages.errors import PackageError
from packages.manifest import MANIFEST_NAME, load_manifest
from packages.refs import HubRef, parse_hub_ref
from packages.speculative import DraftStrategy, declared, verify_draft
from packages.writer import write_package
from stage.prepare import Fetcher, PreparedStage, Progress, Wanted, prepare_stage

pytestmark = pytest.mark.mesh


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    return use_hf_home(tmp_path / "hf", monkeypatch, offline=True)


def _flip_last_byte(path: Path) -> None:
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))


def test_mutable_refs_pin_to_the_cached_commit(hf_offline, tiny_package, tmp_path):
    cache_package(hf_offline, "org/tiny", tiny_package, OTHER_COMMIT)  # an older commit...
    newer = cache_package(hf_offline, "org/tiny", tiny_package, COMMIT)  # ...then main moved on
    for text in ("hf://org/tiny", "hf://org/tiny@main", "hf://org/tiny:main"):
        pkg = hub.open_package(parse_hub_ref(text))
        assert pkg.ref == HubRef("org/tiny", COMMIT)
        assert pkg.ref.pinned
        assert pkg.root == newer
    older = hub.open_package(parse_hub_ref(f"hf://org/tiny@{OTHER_COMMIT}"))
    assert older.ref.revision == OTHER_COMMIT
    assert older.manifest_sha == load_manifest(tiny_package)[1]


def test_a_stage_fetches_only_the_manifest_and_its_range(hf_offline, tiny_package, monkeypatch):
    cache_package(hf_offline, "org/tiny", tiny_package, layers=[0, 1])  # what a stage for [0,2) pulled
    asked: list[str] = []
    real = hub_module.hf_hub_download

    def spy(repo_id: str, filename: str, *, revision: str | None = None, local_files_only: bool = False,
            force_download: bool = False) -> str:
        asked.append(filename)
        return real(repo_id, filename, revision=revision, local_files_only=local_files_only,
                    force_download=force_download)

    monkeypatch.setattr(hub_module, "hf_hub_download", spy)
    pkg = hub.fetch_range(parse_hub_ref("hf://org/tiny"), 0, 2)
    shared = [a.path for a in pkg.manifest.shared.values()]
    assert asked == [MANIFEST_NAME, *shared, "layers/layer-00000.gguf", "layers/layer-00001.gguf"]
    with pytest.raises(PackageError, match=r"layers/layer-00002\.gguf of hf://org/tiny@\w+ is not in the "
                                           r"Hugging Face cache .* HF_HUB_OFFLINE is set"):
        hub.fetch_range(parse_hub_ref("hf://org/tiny"), 2, 4)


def test_a_tampered_cached_artifact_is_detected_on_every_use(hf_offline, tiny_package):
    cache_package(hf_offline, "org/tiny", tiny_package)
    ref = parse_hub_ref("hf://org/tiny")
    pkg = hub.fetch_range(ref, 0, 4)  # sound the first time
    _flip_last_byte(pkg.root / "layers/layer-00001.gguf")
    with pytest.raises(PackageError, match=r"sha256 mismatch in layers/layer-00001\.gguf of hf://org/tiny@"):
        hub.fetch_range(ref, 0, 4)  # a cache hit, still verified
    hub.fetch_range(ref, 2, 4)  # other ranges do not depend on that file
    assert hub.cached_range(ref, 0, 2, pkg.manifest_sha) is None


def test_a_tampered_cached_manifest_is_detected(hf_offline, tiny_package):
    snapshot = cache_package(hf_offline, "org/tiny", tiny_package)
    blob = (snapshot / MANIFEST_NAME).resolve()
    blob.write_bytes(blob.read_bytes().replace(b'"tiny"', b'"tinx"'))
    with pytest.raises(PackageError, match=rf"checksum mismatch in {MANIFEST_NAME} of hf://org/tiny"):
        hub.open_package(parse_hub_ref("hf://org/tiny"))


def test_offline_without_a_cache_is_a_clear_error(hf_offline):
    with pytest.raises(PackageError, match=r"org/absent is not in the Hugging Face cache \(.*\) and "
                                           r"HF_HUB_OFFLINE is set: run `mesh package pull hf://org/absent`"):
        hub.open_package(parse_hub_ref("hf://org/absent"))


def test_missing_revision_and_manifest_offline(hf_offline, tiny_package):
    cache_package(hf_offline, "org/tiny", tiny_package)
    add_files(hf_offline, "org/notapackage", COMMIT, {"README.md": b"hello"})
    with pytest.raises(PackageError, match=r"model-package\.json of hf://org/tiny@v9 is not in the"):
        hub.open_package(parse_hub_ref("hf://org/tiny@v9"))
    with pytest.raises(PackageError, match=r"model-package\.json of hf://org/notapackage is not in the"):
        hub.open_package(parse_hub_ref("hf://org/notapackage"))


def test_coordinator_resolves_the_whole_package_pinned(hf_offline, tiny_package, tmp_path):
    cache_package(hf_offline, "org/tiny", tiny_package)
    said: list[str] = []
    package_dir, manifest, sha, model_id = resolve_model("hf://org/tiny", tmp_path / "cache", said.append)
    assert (manifest, sha) == load_manifest(tiny_package)
    assert model_id == "tiny"
    assert said == [f"serving hf://org/tiny@{COMMIT}"]
    assert hub.package_ref(package_dir) == f"hf://org/tiny@{COMMIT}"  # what stages are handed


def test_coordinator_needs_every_artifact(hf_offline, tiny_package, tmp_path):
    cache_package(hf_offline, "org/tiny", tiny_package, layers=[0, 1])
    with pytest.raises(PackageError, match=r"layers/layer-00002\.gguf"):
        resolve_model("hf://org/tiny", tmp_path / "cache", lambda _: None)


def test_the_coordinator_also_fetches_a_bundled_draft(hf_offline, tiny_gguf, tmp_path):
    package = tmp_path / "pkg"
    write_package(tiny_gguf, package, model_id="spec", progress=lambda _: None, draft=str(tiny_gguf))
    draft = declared(load_manifest(package)[0].generation)[1]["spec-draft"]
    assert isinstance(draft, DraftStrategy)
    files = package_files(package)
    cache_package(hf_offline, "org/spec", package)  # the layers but not the draft...
    pkg = hub.fetch_package(parse_hub_ref("hf://org/spec"))  # ...which only costs speculation
    with pytest.raises(PackageError, match="missing file"):
        verify_draft(pkg.root, draft)
    add_files(hf_offline, "org/spec", COMMIT, {**files, draft.draft_model: package / draft.draft_model})
    pkg = hub.fetch_package(parse_hub_ref("hf://org/spec"))
    assert verify_draft(pkg.root, draft).is_file()


# -- stage preparation with an hf:// package_ref ---------------------------------------------------------


def _prepare(ref: str, sha: str, start: int, end: int, cache: Path, fetch: Fetcher | None = None) -> PreparedStage:
    return asyncio.run(prepare_stage(Wanted(ref, sha, start, end), cache, fetch, Progress()))


def _coordinator(package_dir: Path, calls: list[str], broken: bool = False) -> Fetcher:
    """A stand-in for the coordinator's ArtifactTransfer: serves files from a package directory."""
    async def fetch(path: str, offset: int) -> AsyncIterator[bytes]:
        calls.append(path)
        if broken:
            raise OSError("coordinator unreachable")
        yield (package_dir / path).read_bytes()[offset:]

    return fetch


def test_a_stage_uses_a_pulled_range_from_the_hf_cache(hf_offline, tiny_package, tmp_path):
    cache_package(hf_offline, "org/tiny", tiny_package, layers=[2, 3])
    _, sha = load_manifest(tiny_package)
    calls: list[str] = []
    prepared = _prepare(f"hf://org/tiny@{COMMIT}", sha, 2, 4, tmp_path / "stage",
                        _coordinator(tiny_package, calls))
    assert prepared.gguf.is_file()
    assert (prepared.start, prepared.end) == (2, 4)
    assert calls == []  # everything was already in the HF cache: nothing crossed the network


def test_a_stage_prefers_the_coordinator_over_the_hub(hf_offline, tiny_package, tmp_path):
    _, sha = load_manifest(tiny_package)
    calls: list[str] = []
    prepared = _prepare(f"hf://org/tiny@{COMMIT}", sha, 0, 2, tmp_path / "stage",
                        _coordinator(tiny_package, calls))
    assert prepared.gguf.is_file()
    assert calls[0] == MANIFEST_NAME
    assert "layers/layer-00002.gguf" not in calls
    assert not repo_dir(hf_offline, "org/tiny").exists()  # the Hub was never needed


def test_a_stage_falls_back_to_the_hub_when_the_coordinator_fails(hf_offline, tiny_package, tmp_path):
    snapshot = cache_package(hf_offline, "org/tiny", tiny_package, layers=[0, 1])
    _flip_last_byte(snapshot / "layers/layer-00001.gguf")  # so the cache alone does not do
    _, sha = load_manifest(tiny_package)
    calls: list[str] = []
    with pytest.raises(PackageError, match=r"sha256 mismatch in layers/layer-00001\.gguf"):
        _prepare(f"hf://org/tiny@{COMMIT}", sha, 0, 2, tmp_path / "stage",
                 _coordinator(tiny_package, calls, broken=True))
    assert calls == [MANIFEST_NAME]  # peer transfer was tried first; the Hub answer is what failed
    # With the coordinator up, the corrupt HF cache entry is simply not used.
    assert _prepare(f"hf://org/tiny@{COMMIT}", sha, 0, 2, tmp_path / "stage2",
                    _coordinator(tiny_package, [])).gguf.is_file()


def test_a_stage_refuses_a_hub_manifest_that_differs_from_prepare(hf_offline, tiny_package, tmp_path):
    cache_package(hf_offline, "org/tiny", tiny_package)
    with pytest.raises(PackageError, match="refusing it"):
        _prepare(f"hf://org/tiny@{COMMIT}", "0" * 64, 0, 2, tmp_path / "stage")


# -- the CLI and `mesh serve` as separate processes, configured only by the environment ----------------


def _env(hf_home: Path) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub")}


def _mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_pull_and_validate_cli_offline(tmp_path, tiny_package):
    hf_home = tmp_path / "hf"
    cache_package(hf_home / "hub", "org/tiny", tiny_package, layers=[0, 1])
    env = _env(hf_home)
    ok = _mesh(env, "package", "pull", "hf://org/tiny", "--range", "0:2")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().startswith(f"hf://org/tiny@{COMMIT} verified in {hf_home / 'hub'}")
    missing = _mesh(env, "package", "pull", "hf://org/tiny", "--range", "2:4")
    assert missing.returncode == 2
    assert "layers/layer-00002.gguf" in missing.stderr
    assert "Traceback" not in missing.stderr
    partial = _mesh(env, "package", "validate", "hf://org/tiny")
    assert partial.returncode == 2
    assert "not in the Hugging Face cache" in partial.stderr
    cache_package(hf_home / "hub", "org/tiny", tiny_package)
    full = _mesh(env, "package", "validate", f"hf://org/tiny@{COMMIT}")
    assert full.returncode == 0
    assert full.stdout.startswith("ok: tiny (4 layers")


def test_serve_an_hf_ref_end_to_end(tmp_path, smollm2_package, expected_texts):
    from chat_reference import MAX_TOKENS, PROMPTS

    hf_home = tmp_path / "hf"
    cache_package(hf_home / "hub", "org/smollm2", smollm2_package)
    cache = tmp_path / "mesh-cache"
    cache.mkdir()
    with mesh_serve(cache, "--model", f"hf://org/smollm2@{COMMIT}", "--local-stages", "2",
                    env=_env(hf_home)) as (url, _):
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["smollm2"]
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": PROMPTS[0]}]}).json()
        assert reply["choices"][0]["message"]["content"] == expected_texts[PROMPTS[0]]
    assert not (cache / "packages").exists()  # served from the HF cache, not re-packaged
