"""The committed generated protobuf code matches proto/meshpipe.proto."""

from __future__ import annotations

from pathlib import Path

from proto.generate import HERE, OUTPUTS, generate
from proto.version import PROTOCOL_VERSION, check_version


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    stale = [name for name in OUTPUTS if (tmp_path / name).read_bytes() != (HERE / name).read_bytes()]
    assert not stale, f"{stale} are stale: run `python -m proto.generate` and commit the result"


def test_version_check_names_both_versions() -> None:
    assert check_version(PROTOCOL_VERSION) is None
    message = check_version(PROTOCOL_VERSION + 1)
    assert message is not None and str(PROTOCOL_VERSION + 1) in message and str(PROTOCOL_VERSION) in message
