"""`mesh package publish`: the real HfApi upload path against tests/hub_server.py (a stand-in Hub)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub, running_hub
from huggingface_hub import HfApi, constants
from mesh_server import free_port

from packages.errors import PackageError
from packages.manifest import MANIFEST_NAME, load_manifest
from packages.publish import plan_publish, publish
from packages.speculative import DraftStrategy, declared
from packages.writer import write_package

pytestmark = pytest.mark.mesh


@pytest.fixture
def fake_hub():
    with running_hub() as hub:
        yield hub
    assert hub.unhandled == []  # the publish path called nothing the stand-in lacks


@pytest.fixture
def api(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> HfApi:
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks LFS, not Xet
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return HfApi(endpoint=fake_hub.url, token="hf_write")


def _env(tmp_path: Path, endpoint: str, token: str | None = "hf_write") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE")}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def _mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_publish_uploads_artifacts_first_and_the_manifest_last(fake_hub, tiny_package, tmp_path):
    done = _mesh(_env(tmp_path, fake_hub.url), "package", "publish", str(tiny_package), "--repo", "org/tiny")
    assert done.returncode == 0, done.stderr
    manifest, _ = load_manifest(tiny_package)
    head = fake_hub.commits("org/tiny")[-1]
    assert done.stdout.strip() == f"hf://org/tiny@{head.oid}"  # the immutable ref of the final commit

    events = fake_hub.events
    manifest_at = events.index(("add", MANIFEST_NAME))
    assert manifest_at == len(events) - 2
    assert events[-1] == ("commit", head.oid)
    for art in manifest.artifacts():  # every artifact's bytes and tree entry came before it
        assert events.index(("put", art.sha256)) < manifest_at
        assert events.index(("add", art.path)) < manifest_at

    # Separate commits: the one before the manifest holds every artifact and no manifest.
    artifacts_commit = fake_hub.commits("org/tiny")[-2]
    assert MANIFEST_NAME not in artifacts_commit.tree
    assert {a.path for a in manifest.artifacts()} <= set(artifacts_commit.tree)
    assert [path for _, path in head.changes] == ["README.md", MANIFEST_NAME]

    # What landed is byte for byte the package, with LFS oids equal to the manifest's sha256.
    for art in manifest.artifacts():
        blob = head.tree[art.path]
        assert blob.lfs
        assert _sha256(blob.data) == art.sha256
    assert head.tree[MANIFEST_NAME].data == (tiny_package / MANIFEST_NAME).read_bytes()
    card = head.tree["README.md"].data.decode()
    for needle in ("architecture | llama", "layers | 4", "allowed cuts | any layer (1..3)",
                   "mesh serve --model hf://org/tiny", "mesh package pull hf://org/tiny", "None declared"):
        assert needle in card


def test_dry_run_prints_the_plan_and_uploads_nothing(fake_hub, tiny_package, tmp_path):
    done = _mesh(_env(tmp_path, fake_hub.url), "package", "publish", str(tiny_package), "--repo", "org/tiny",
                 "--dry-run")
    assert done.returncode == 0, done.stderr
    manifest, _ = load_manifest(tiny_package)
    lines = done.stdout.splitlines()
    listed = [line.split()[-1] for line in lines[1:-1]]
    assert listed == [*(a.path for a in manifest.artifacts()), "README.md", MANIFEST_NAME]
    assert lines[-1].startswith("total ")
    assert "in 9 files; nothing was uploaded" in lines[-1]
    assert fake_hub.requests == []  # not even a request, let alone an upload


def test_republishing_drops_the_old_manifest_before_new_artifacts(api, fake_hub, tiny_package):
    plan = plan_publish(tiny_package, "org/tiny")
    first = publish(plan, api=api)
    second = publish(plan_publish(tiny_package, "org/tiny"), api=api)
    assert first.revision != second.revision
    assert second.pinned
    artifacts_commit, final = fake_hub.commits("org/tiny")[-2:]
    assert artifacts_commit.changes[0] == ("delete", MANIFEST_NAME)
    assert MANIFEST_NAME not in artifacts_commit.tree
    assert final.changes[-1] == ("add", MANIFEST_NAME)
    assert final.oid == second.revision


def test_publish_to_a_branch(api, fake_hub, tiny_package):
    ref = publish(plan_publish(tiny_package, "org/tiny", revision="exp/q4"), api=api)
    branch = fake_hub.commits("org/tiny", "exp/q4")
    assert branch[-1].oid == ref.revision
    assert MANIFEST_NAME in branch[-1].tree
    assert MANIFEST_NAME not in fake_hub.commits("org/tiny", "main")[-1].tree
    with pytest.raises(PackageError, match="is a commit: publish to a branch"):
        plan_publish(tiny_package, "org/tiny", revision="a" * 40)


def test_speculative_strategy_and_its_bundled_draft_are_published(api, fake_hub, tiny_gguf, tmp_path):
    package = tmp_path / "pkg"
    write_package(tiny_gguf, package, model_id="spec", progress=lambda _: None, draft=str(tiny_gguf))
    manifest, _ = load_manifest(package)
    _, strategies = declared(manifest.generation)
    draft = strategies["spec-draft"]
    assert isinstance(draft, DraftStrategy)
    publish(plan_publish(package, "org/spec"), api=api)
    head = fake_hub.commits("org/spec")[-1]
    assert _sha256(head.tree[draft.draft_model].data) == draft.draft_sha256  # the draft travels along
    assert fake_hub.events.index(("add", draft.draft_model)) < fake_hub.events.index(("add", MANIFEST_NAME))
    card = head.tree["README.md"].data.decode()
    assert (f"- `spec-draft` (default): draft model `{draft.draft_model}` (shipped in the package), "
            "adaptive window starting at 4 tokens, between 1 and 16") in card


def test_publish_validates_first(api, fake_hub, tiny_package, tmp_path):
    package = tmp_path / "pkg"
    shutil.copytree(tiny_package, package)
    (package / "layers" / "layer-00002.gguf").write_bytes(b"corrupt")
    with pytest.raises(PackageError, match=r"layer-00002\.gguf"):
        plan_publish(package, "org/tiny")
    with pytest.raises(PackageError, match="bad --repo"):
        plan_publish(tiny_package, "no-namespace")
    assert fake_hub.requests == []


def test_a_publish_that_fails_half_way_is_never_resolvable(fake_hub, tiny_package, tmp_path):
    fake_hub.fail_commits_with.add(MANIFEST_NAME)
    env = _env(tmp_path, fake_hub.url)
    failed = _mesh(env, "package", "publish", str(tiny_package), "--repo", "org/tiny")
    assert failed.returncode == 2
    assert f"{MANIFEST_NAME} was not uploaded, so nothing half-published resolves" in failed.stderr
    assert MANIFEST_NAME not in fake_hub.commits("org/tiny")[-1].tree  # the artifacts did land
    pulled = _mesh(env, "package", "pull", "hf://org/tiny")
    assert pulled.returncode == 2
    assert "hf://org/tiny has no model-package.json: it is not a layer package, or its publish did not " \
           "finish" in pulled.stderr


@pytest.mark.parametrize(("token", "expected"), [
    (None, "no Hugging Face token: log in with `hf auth login` or set HF_TOKEN"),
    ("hf_read", "no permission to write to org/tiny (HTTP 403)"),
    ("hf_bogus", "the Hub rejected the token (HTTP 401)"),
])
def test_token_problems_are_clear(fake_hub, tiny_package, tmp_path, token, expected):
    done = _mesh(_env(tmp_path, fake_hub.url, token), "package", "publish", str(tiny_package), "--repo", "org/tiny")
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert "org/tiny" not in fake_hub.repos or MANIFEST_NAME not in fake_hub.commits("org/tiny")[-1].tree


def test_network_down_is_clear(tiny_package, tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = _mesh(_env(tmp_path, endpoint), "package", "publish", str(tiny_package), "--repo", "org/tiny")
    assert done.returncode == 2
    assert f"publish to org/tiny failed: cannot reach the Hub at {endpoint} (ConnectError" in done.stderr


def test_resolving_a_missing_repo_or_file_online_is_clear(api, fake_hub, tiny_package, tmp_path):
    ref = publish(plan_publish(tiny_package, "org/tiny"), api=api)
    env = _env(tmp_path, fake_hub.url)
    absent = _mesh(env, "package", "pull", "hf://org/absent")
    assert absent.returncode == 2
    assert "repository org/absent not found on the Hub" in absent.stderr
    probe = (f"from pathlib import Path; from packages.hub import resolve_draft; "
             f"resolve_draft('hf://org/tiny@{ref.revision}/drafts/none.gguf', Path('.'))")
    missing = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert f"PackageError: hf://org/tiny@{ref.revision} has no file drafts/none.gguf" in missing.stderr
