from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from models import gemma3_path, smollm2_path, write_tiny_llama

from packages.writer import write_package

TIERS = ("mesh", "soak")  # the fast tier is every test with neither mark (pyproject.toml)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers are disjoint, so `-m mesh` and `-m soak` each run their own tests once."""
    both = [item.nodeid for item in items if all(item.get_closest_marker(t) for t in TIERS)]
    if both:
        raise pytest.UsageError(f"a test is in one tier, mesh or soak, not both: {both}")


class _NoProcessInTheFastTier(subprocess.Popen):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a fast-tier test started a process: mark it pytest.mark.mesh")


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier runs in seconds because it starts nothing: a process there fails the test."""
    if not any(request.node.get_closest_marker(t) for t in TIERS):
        monkeypatch.setattr(subprocess, "Popen", _NoProcessInTheFastTier)


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _package(factory: pytest.TempPathFactory, gguf: Path, model_id: str) -> Path:
    out = factory.mktemp(f"{model_id}-pkg") / "pkg"
    write_package(gguf, out, model_id=model_id, progress=_quiet)
    return out


@pytest.fixture(scope="session")
def tiny_package(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    return _package(tmp_path_factory, tiny_gguf, "tiny")


@pytest.fixture(scope="session")
def tiny_byte_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model, with the byte tokens llama.cpp's tokenizer needs to serve it."""
    gguf = write_tiny_llama(tmp_path_factory.mktemp("tiny-bytes") / "tiny.gguf", byte_vocab=True)
    return _package(tmp_path_factory, gguf, "tiny")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_package(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    return _package(tmp_path_factory, smollm2_gguf, "smollm2")


@pytest.fixture(scope="session")
def draft_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded package's draft: SmolLM2 requantized to Q4_0."""
    from packages.requantize import requantize

    return requantize(smollm2_gguf, tmp_path_factory.mktemp("draft") / "smol-q4_0.gguf", "Q4_0")


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma3_path(tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="session")
def gemma3_package(tmp_path_factory: pytest.TempPathFactory, gemma3_gguf: Path) -> Path:
    return _package(tmp_path_factory, gemma3_gguf, "gemma3")


@pytest.fixture(scope="session")
def stage_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stage-cache")



@pytest.fixture(scope="session")
def serve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-cache")


@pytest.fixture(scope="session")
def expected_texts(smollm2_gguf: Path) -> dict[str, str]:
    from chat_reference import unsplit_texts

    return unsplit_texts(smollm2_gguf)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory):  # -> mesh.model.tokenizer.Tokenizer
    """The tiny GGUF's vocabulary (token b + 3 is byte b): loads in milliseconds, no weights used."""
    from mesh.model.tokenizer import Tokenizer

    gguf = write_tiny_llama(tmp_path_factory.mktemp("bytes") / "bytes.gguf", layers=1, byte_vocab=True)
    return Tokenizer(gguf, "tiny")


class _Unbounded:
    """A request ledger that allows whatever the controllers ask (mesh/speculative/ledger.py):
    for tests of the loop's and the proposers' mechanics, whose scripted or tiny pipelines
    take microseconds, so a ledger's prices would decide what they test."""

    priced = True

    def __init__(self, started: float) -> None:
        pass

    def heard(self, seen: object) -> None:
        pass

    def allowed_depth(self, asked: int, now: float) -> int:
        return asked

    def allowed_window(self, asked: int, now: float, catch_up: int = 0, prospect: float = 0.0) -> int:
        return max(asked, 0)


@pytest.fixture
def unbounded_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session's ledger allows what its controllers ask (`_Unbounded`)."""
    import mesh.serving.proposals as proposals

    monkeypatch.setattr(proposals, "Ledger", _Unbounded)
