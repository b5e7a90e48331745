"""`mesh status`: the topology a running coordinator serves, or (--discover) the stages announced
on the LAN, as a table."""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request
from collections.abc import Sequence

from pydantic import ValidationError

from config.errors import MeshpipeError
from config.settings import UsageError
from mesh.cli.bearer import KEY_ENV, auth_headers
from mesh.cli.watch import watch
from mesh.reports.health import ClaimHealth, Health
from mesh.routing.discovery import Found, browse
from packages.describe import human_bytes, human_parameters
from proto.version import PROTOCOL_VERSION


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the stages, ranges, state and memory of a mesh")
    p.add_argument("--url", default="http://127.0.0.1:9337",
                   help="the coordinator's HTTP address; the .../v1 URL `mesh serve` prints works too")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the API key the coordinator asks for (default: ${KEY_ENV})")
    p.add_argument("--watch", action="store_true",
                   help="redraw once a second from the snapshot the web page shows (/ui/snapshot): "
                   "speculation, requests and recoveries too; Ctrl-C ends it")
    p.add_argument("--discover", action="store_true",
                   help="list the stages announced on the LAN (`mesh stage --announce`) instead; "
                   "no coordinator needed")
    p.add_argument("--discover-seconds", type=float, default=2.0, metavar="SECONDS",
                   help="how long --discover listens (default: %(default)s)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.discover:
        if not 0 < args.discover_seconds <= 60:
            raise UsageError("--discover-seconds must be more than 0 and at most 60")
        print(format_found(browse(args.discover_seconds)))
        return 0
    if args.watch:
        try:
            return watch(_base_url(args.url), args.api_key)
        except KeyboardInterrupt:
            return 0
    print(format_health(fetch_health(_base_url(args.url), args.api_key)))
    return 0


def fetch_health(base: str, key: str | None = None) -> Health:
    request = urllib.request.Request(f"{base}/health", headers=auth_headers(key))
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:  # 503 still carries the topology
        body = exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise OSError(f"cannot reach the coordinator at {base}: {exc}") from None
    if body.replace(b" ", b"") in (b'{"ok":true}', b'{"ok":false}'):  # all it tells a caller without the key
        raise StatusError(f"{base}/health shows the route only with an API key: pass --api-key or set ${KEY_ENV}")
    try:
        return Health.model_validate_json(body)
    except ValidationError as exc:
        raise StatusError(f"{base}/health is not a meshpipe coordinator's answer "
                          f"({exc.error_count()} problems, first: {exc.errors()[0]['msg']})") from None


class StatusError(MeshpipeError):
    """The address answered, but not as a meshpipe coordinator does."""


def format_health(state: Health) -> str:
    lines = [f"model: {state.model}   route: {'ok' if state.ok else 'BROKEN'}"]
    for value, label in ((state.error, "error"), (state.speculative, "speculative")):
        if value:
            lines.append(f"{label}: {value}")
    if (last := state.last_recovery) is not None:
        lines.append(f"recoveries: {state.recoveries}, {state.sessions_resumed} sessions resumed; last: "
                     f"{last.cause} (noticed after {last.detect_s:.1f}s, serving again after {last.resume_s:.1f}s)")
    rows = [("stage", "endpoint", "layers", "engine", "state", "rss", "mem free", "busy",
             "decode predicted", "decode measured", "link rtt", "params")]
    for s in state.stages:
        busy = "" if s.busy_s is None else f"{s.busy_s:.1f} s"  # engine time since the route was built
        rows.append((str(s.stage), s.endpoint, f"[{s.start},{s.end})", s.engine or "?", s.state,
                     human_bytes(s.rss_bytes or 0), human_bytes(s.mem_available_bytes or 0), busy,
                     _ms(s.predicted_ms), _ms(s.measured_ms), _ms(s.link_ms),
                     human_parameters(s.parameters, s.active_parameters)))
    lines += _table(rows)
    lines += [f"stage {s.stage} is shared: " + "; ".join(_claim(c) for c in s.claims)
              for s in state.stages if len(s.claims) > 1]
    return "\n".join(lines)


def _claim(c: ClaimHealth) -> str:
    who = f"coordinator {c.coordinator}" + (" (this one)" if c.this else "")
    return f"{who} [{c.start},{c.end}) on {c.lanes} lanes, {c.lanes_in_use} in use"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} ms"


def format_found(found: Found) -> str:
    if not found.announced and not found.skipped:
        return "no meshpipe stage announced on the LAN"
    rows = [("address", "engine", "protocol", "mem free")]
    for a in found.announced:
        version = str(a.version) if a.version == PROTOCOL_VERSION else f"{a.version} (this node: {PROTOCOL_VERSION})"
        rows.append((a.control, a.engine, version, human_bytes(a.mem_free)))
    lines = _table(rows)
    lines += [f"unreadable: {s.name}: {s.reason}" for s in found.skipped]
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _base_url(url: str) -> str:
    """`mesh serve` prints the OpenAI base URL (…/v1); /health lives beside it, not under it."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")
