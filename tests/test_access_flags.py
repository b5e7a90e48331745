"""Where `mesh serve`'s API keys come from, the warning an open public address gets, the
origin and limit flags' checks, and `mesh status` with a keyed coordinator."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from config.settings import ConfigError, UsageError, parse_config
from mesh.api.app import Access
from mesh.cli.access_args import access_of, open_warning
from mesh.cli.bearer import auth_headers
from mesh.cli.main import build_parser
from mesh.cli.serve import _check
from mesh.cli.status import StatusError, fetch_health


def _args(*argv: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *argv])


def _keys(*argv: str, config: dict | None = None) -> tuple[str, ...]:
    return access_of(_args(*argv), parse_config(config or {})).api_keys


def test_keys_from_flags_and_file_then_env_then_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MESHPIPE_API_KEY", raising=False)
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team keys\n\n  alpha  \nbeta\n   # old: gamma\n")
    config = {"mesh": {"api_keys": ["from-config"]}}
    assert _keys("--api-key", "one", "--api-key", "two", "--api-key-file", str(keyfile), config=config) == \
        ("one", "two", "alpha", "beta")
    assert _keys(config=config) == ("from-config",)
    monkeypatch.setenv("MESHPIPE_API_KEY", "from-env")
    assert _keys(config=config) == ("from-env",)
    assert _keys("--api-key-file", str(keyfile), config=config) == ("alpha", "beta")
    monkeypatch.setenv("MESHPIPE_API_KEY", "")
    assert _keys() == ()  # none anywhere: open, as before


def test_a_key_file_that_cannot_serve_is_a_startup_error(tmp_path: Path):
    with pytest.raises(UsageError, match="cannot read"):
        _keys("--api-key-file", str(tmp_path / "missing"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(UsageError, match="cannot read"):
        _keys("--api-key-file", str(tmp_path / "dir"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(UsageError, match="holds no key"):  # meant closed, would start open
        _keys("--api-key-file", str(empty))
    with pytest.raises(UsageError, match="empty"):
        _keys("--api-key", "  ")


def test_config_api_keys_are_checked():
    assert parse_config({"mesh": {"api_keys": ["a", "b"]}}).mesh.api_keys == ("a", "b")
    for bad in ("a", [1], [""], [" a"], [["a"]]):
        with pytest.raises(ConfigError, match=r"mesh\.api_keys"):
            parse_config({"mesh": {"api_keys": bad}})
    with pytest.raises(ConfigError, match="allowed here: api_keys, listen, peers, spares"):
        parse_config({"mesh": {"api_key": "a"}})


def test_an_open_public_address_warns_naming_the_risk():
    warning = open_warning(("0.0.0.0", 9337), Access())
    assert warning is not None
    assert "0.0.0.0:9337" in warning
    assert "no API key" in warning
    assert "--api-key" in warning
    assert open_warning(("192.168.1.5", 80), Access()) is not None
    assert open_warning(("::", 80, 0, 0), Access()) is not None
    for loopback in ("127.0.0.1", "127.0.0.2", "::1"):
        assert open_warning((loopback, 9337), Access()) is None
    assert open_warning(("0.0.0.0", 9337), Access(api_keys=("k",))) is None


def test_origins_and_limits_are_checked():
    assert access_of(_args("--cors-origin", "HTTP://App.Example:3000/", "--cors-origin", "*"),
                     parse_config({})).cors_origins == ("http://app.example:3000", "*")
    for bad in ("app.example", "http://app.example/path", "ftp://app.example", "http://"):
        with pytest.raises(UsageError, match="--cors-origin"):
            access_of(_args("--cors-origin", bad), parse_config({}))
    for flags in (["--max-queue", "-1"], ["--request-timeout", "0"], ["--request-timeout", "nan"]):
        with pytest.raises(UsageError):
            _check(_args(*flags))
    _check(_args("--max-queue", "0", "--request-timeout", "2.5"))


def test_clients_send_the_key_they_are_given_or_the_environments(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MESHPIPE_API_KEY", raising=False)
    assert auth_headers() == {}
    assert auth_headers("k") == {"Authorization": "Bearer k"}
    monkeypatch.setenv("MESHPIPE_API_KEY", "env-key")
    assert auth_headers() == {"Authorization": "Bearer env-key"}
    assert auth_headers("k") == {"Authorization": "Bearer k"}


def test_status_says_a_key_is_needed(monkeypatch: pytest.MonkeyPatch):
    import urllib.request

    class Minimal:
        def __enter__(self) -> Minimal:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def read(self) -> bytes:
            return b'{"ok":true}'

    seen: list[urllib.request.Request] = []
    def urlopen(req: urllib.request.Request, timeout: float) -> Minimal:
        seen.append(req)
        return Minimal()

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(StatusError, match="--api-key or set \\$MESHPIPE_API_KEY"):
        fetch_health("http://127.0.0.1:1", "the-key")
    assert seen[0].get_header("Authorization") == "Bearer the-key"
