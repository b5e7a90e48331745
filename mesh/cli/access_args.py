"""`mesh serve`'s flags for who may use the HTTP API: API keys, web origins, open metrics.

Keys come from the first of these that gives any: `--api-key` and `--api-key-file`
together, then $MESHPIPE_API_KEY, then `[mesh] api_keys` in the config. A key on the
command line shows in `ps`; the file or the environment keeps it out of sight.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path
from typing import Any

from config.settings import Config, UsageError
from mesh.api.app import Access
from mesh.api.origins import OriginError, origin
from mesh.cli.bearer import KEY_ENV


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/*, /metrics and /health's details "
                   f"(repeatable; default: ${KEY_ENV}, else [mesh] api_keys; none: the API is open)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                   help="API keys, one a line; blank lines and # comments are skipped")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (scheme://host[:port], or * for any) whose pages may call the API "
                   "from a browser (repeatable); a request from any other origin gets 403 (default: none)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without a key even when API keys are set")


def access_of(args: argparse.Namespace, config: Config) -> Access:
    try:
        origins = tuple(origin(o) for o in args.cors_origin)
    except OriginError as exc:
        raise UsageError(str(exc)) from None
    return Access(api_keys=_keys(args, config), cors_origins=origins, public_metrics=args.public_metrics)


def _keys(args: argparse.Namespace, config: Config) -> tuple[str, ...]:
    if any(not k.strip() for k in args.api_key):
        raise UsageError("--api-key wants a key, got an empty one")
    given = [k.strip() for k in args.api_key]
    if args.api_key_file is not None:
        given += read_key_file(args.api_key_file)
    if given:
        return tuple(given)
    if env := os.environ.get(KEY_ENV, "").strip():
        return (env,)
    return config.mesh.api_keys


def read_key_file(path: Path) -> list[str]:
    """The keys in `path`, one a line; a file that cannot be read, or holds none, is an error:
    a server meant to be closed must not start open."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--api-key-file {path}: cannot read it: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise UsageError(f"--api-key-file {path}: holds no key (one a line; blank and # lines are skipped)")
    return keys


def open_warning(address: tuple[Any, ...], access: Access) -> str | None:
    """A warning when the API listens beyond this machine with no key: anyone who reaches the
    port may generate, and read the route and the metrics."""
    host, port = address[:2]
    try:
        loopback = ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = False
    if access.api_keys or loopback:
        return None
    return (f"WARNING: the API at {host}:{port} is reachable beyond this machine and needs no API key: anyone "
            "who can reach it can generate with this model (spending its compute) and read /health and "
            f"/metrics; set --api-key, --api-key-file or ${KEY_ENV}")
