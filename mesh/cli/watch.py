"""`mesh status --watch`: the web page's snapshot (mesh/reports/snapshot.py) as a terminal table,
redrawn once a second. It reads /ui/snapshot, the snapshot the page's stream pushes, so it
asks no stage anything either; plain ANSI, no curses."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from config.errors import MeshpipeError
from mesh.cli.bearer import KEY_ENV, auth_headers
from mesh.reports.snapshot import Snapshot
from packages.describe import human_bytes, human_parameters

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen
REFRESH_S = 1.0


class WatchError(MeshpipeError):
    """The coordinator refused the snapshot or is not a meshpipe coordinator."""


def fetch_snapshot(base: str, key: str | None = None) -> Snapshot:
    request = urllib.request.Request(f"{base}/ui/snapshot", headers=auth_headers(key))
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise WatchError(f"{base} needs an API key: pass --api-key or set ${KEY_ENV}") from None
        raise WatchError(f"{base}/ui/snapshot answered {exc.code}") from None
    try:
        return Snapshot.model_validate_json(body)
    except ValidationError as exc:
        raise WatchError(f"{base}/ui/snapshot is not a meshpipe snapshot ({exc.error_count()} problems)") from None


def watch(base: str, key: str | None, frames: int | None = None,
          write: Callable[[str], object] = sys.stdout.write) -> int:
    """Redraw every REFRESH_S until interrupted (or after `frames`); a coordinator out of
    reach is said so and tried again, one that refuses the key ends it."""
    drawn = 0
    while frames is None or drawn < frames:
        try:
            text = format_snapshot(fetch_snapshot(base, key))
        except (urllib.error.URLError, OSError) as exc:
            text = f"cannot reach the coordinator at {base}: {exc}; trying again"
        write(CLEAR + text + "\n")
        sys.stdout.flush()
        drawn += 1
        if frames is None or drawn < frames:
            time.sleep(REFRESH_S)
    return 0


def format_snapshot(s: Snapshot) -> str:
    spec, req, heal = s.speculation, s.requests, s.healing
    state = "ok" if heal.ok else f"RECOVERING: {heal.broken}"
    lines = [f"model: {s.model}   route: {state}   {time.strftime('%H:%M:%S', time.localtime(s.at))}",
             f"speculative: {spec.plan}",
             f"tok/s {spec.tok_s:.1f}   ttft {_ms(spec.ttft_s and spec.ttft_s * 1e3)}   frames in flight "
             f"{spec.frames_in_flight}   stale {spec.stale:.0%}   round trip {_ms(spec.round_trip_ms)}",
             "acceptance: " + (", ".join(f"{p.name} {p.accept_rate:.0%} (window {p.mean_window:.2f})"
                                        for p in spec.proposers) or "none yet"),
             f"requests: {req.generating} generating, {req.queued} queued, lanes {req.lanes_used}/{req.lanes}, "
             f"prefix hits {req.prefix_hit:.0%}"]
    rows = [("stage", "endpoint", "layers", "engine", "state", "rss", "mem free", "busy", "params", "note")]
    for st in s.stages:
        rows.append((str(st.stage), st.endpoint, f"[{st.start},{st.end})", st.engine or "?", st.state,
                     human_bytes(st.rss_bytes or 0), human_bytes(st.mem_available_bytes or 0),
                     "" if st.busy is None else f"{st.busy:.0%}", human_parameters(st.parameters, st.active_parameters),
                     f"replaced {st.replaced}" if st.replaced else ""))
    lines += _table(rows)
    lines += [f"spare: {e}" for e in s.spares]
    lines.append(f"recoveries: {heal.recoveries}, {heal.sessions_resumed} sessions resumed")
    lines += [f"  {time.strftime('%H:%M:%S', time.localtime(r.at))} {r.cause} (noticed after {r.detect_s:.1f}s, "
              f"serving again after {r.resume_s:.1f}s)" for r in heal.timeline[-5:]]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
