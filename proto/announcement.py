"""What a stage says about itself on the LAN (mDNS/DNS-SD TXT properties), and reading it back.

The record is part of the wire contract between `mesh stage --announce` and `mesh serve
--discover`, so it lives beside the protocol version. It never carries the mesh token: anyone
on the LAN can read it, and a coordinator proves the token by calling the stage instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from config.errors import MeshpipeError

SERVICE_TYPE = "_meshpipe._tcp.local."
# TXT keys; DNS-SD wants them short (RFC 6763 §6.4)
CONTROL, ENGINE, VERSION, MEM_FREE = "control", "engine", "proto", "mem_free"


class AnnouncementError(MeshpipeError):
    """A _meshpipe._tcp service whose TXT record is not one a stage writes."""


@dataclass(frozen=True)
class Announcement:
    control: str  # HOST:PORT of the stage's gRPC control plane; activations are negotiated there
    engine: str
    version: int  # the protocol version the stage speaks (proto/version.py)
    mem_free: int  # bytes available when it last announced

    def properties(self) -> dict[str, str]:
        return {CONTROL: self.control, ENGINE: self.engine, VERSION: str(self.version),
                MEM_FREE: str(self.mem_free)}

    def order_key(self) -> tuple[int, int | str, int]:
        """Sorts by address, numerically where it is one (10.0.0.9 before 10.0.0.10), then port."""
        host, _, port = self.control.rpartition(":")
        try:
            return 0, int(ipaddress.ip_address(host.strip("[]"))), int(port)
        except ValueError:
            return 1, host, int(port) if port.isdigit() else 0


def parse(properties: Mapping[bytes, bytes | None]) -> Announcement:
    """The announcement in a TXT record; AnnouncementError names what is missing or wrong."""
    text = {k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace") for k, v in properties.items()}
    missing = [key for key in (CONTROL, ENGINE, VERSION, MEM_FREE) if not text.get(key)]
    if missing:
        raise AnnouncementError(f"TXT record lacks {', '.join(missing)}")
    host, sep, port = text[CONTROL].rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise AnnouncementError(f"control address {text[CONTROL]!r} is not HOST:PORT")
    if not (text[VERSION].isascii() and text[VERSION].isdigit()):
        raise AnnouncementError(f"protocol version {text[VERSION]!r} is not a number")
    if not (text[MEM_FREE].isascii() and text[MEM_FREE].isdigit()):
        raise AnnouncementError(f"free memory {text[MEM_FREE]!r} is not a number")
    return Announcement(control=text[CONTROL], engine=text[ENGINE], version=int(text[VERSION]),
                        mem_free=int(text[MEM_FREE]))
