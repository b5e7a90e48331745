"""What stages announce on the LAN (`mesh stage --announce`), browsed for a bounded time, and
which of them a coordinator may use: the right protocol version, not already a --peer, in a
stable order. Whether a stage accepts the mesh token is asked of the stage (mesh/routing/peer_probe.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceListener, Zeroconf

from proto.announcement import SERVICE_TYPE, Announcement, AnnouncementError, parse
from proto.version import PROTOCOL_VERSION

RESOLVE_TIMEOUT_MS = 1000  # a service seen but not yet resolved gets this long for its records


@dataclass(frozen=True)
class Skipped:
    name: str  # the control address, or the service name where the record had none
    reason: str


@dataclass(frozen=True)
class Found:
    announced: tuple[Announcement, ...]  # in the order of Announcement.order_key
    skipped: tuple[Skipped, ...]  # records that could not be read


class _Names(ServiceListener):
    """Collects service names as the browser sees them; zeroconf calls it from its own thread."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.lock = threading.Lock()

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        with self.lock:
            self.names.add(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.add_service(zc, type_, name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        with self.lock:
            self.names.discard(name)


def browse(seconds: float) -> Found:
    """Every stage announced on this host's networks within `seconds` (IPv4). Blocking: call it
    outside an event loop."""
    zc = Zeroconf(ip_version=IPVersion.V4Only)
    try:
        listener = _Names()
        browser = ServiceBrowser(zc, SERVICE_TYPE, listener)
        time.sleep(seconds)
        browser.cancel()
        with listener.lock:
            names = sorted(listener.names)
        records = [(name, zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS)) for name in names]
    finally:
        zc.close()
    return read_records((name, info.properties if info else None) for name, info in records)


def read_records(records: Iterable[tuple[str, Mapping[bytes, bytes | None] | None]]) -> Found:
    """(service name, TXT properties or None when it did not resolve) -> announcements, ordered."""
    announced: dict[str, Announcement] = {}
    skipped = []
    for name, properties in records:
        if properties is None:
            skipped.append(Skipped(name, "announced, but its records did not resolve"))
            continue
        try:
            record = parse(properties)
        except AnnouncementError as exc:
            skipped.append(Skipped(name, str(exc)))
            continue
        announced.setdefault(record.control, record)  # one stage on two interfaces is one stage
    ordered = tuple(sorted(announced.values(), key=Announcement.order_key))
    return Found(ordered, tuple(skipped))


def candidates(found: Found, named: Sequence[str]) -> tuple[list[Announcement], list[Skipped]]:
    """The announced stages a coordinator may add after the ones it was `named` (--peer, --spare):
    those speaking its protocol version and not among them, in the stable order; and why the
    others were left out."""
    usable, skipped = [], list(found.skipped)
    for record in found.announced:
        if record.control in named:
            continue  # already named, and in the place the operator gave it
        if record.version != PROTOCOL_VERSION:
            skipped.append(Skipped(record.control, f"speaks protocol {record.version}, this coordinator "
                                   f"speaks {PROTOCOL_VERSION}; run the same meshpipe version on both"))
            continue
        usable.append(record)
    return usable, skipped
