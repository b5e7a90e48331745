"""`mesh stage --announce`: advertise this stage on the LAN by mDNS/DNS-SD while it runs.

Opt-in, because it tells everyone on the segment where a stage listens. The record says how
to reach the stage and what it runs (proto/announcement.py), never the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import psutil
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from proto.announcement import SERVICE_TYPE, Announcement
from proto.version import PROTOCOL_VERSION

log = logging.getLogger("meshpipe.announce")
REFRESH_S = 30.0  # free memory changes as ranges load; the record follows it this often


def service_info(stage_id: str, advertise: str, port: int, engine: str) -> ServiceInfo:
    """The DNS-SD service for a stage reached at advertise:port."""
    control = f"[{advertise}]:{port}" if ":" in advertise else f"{advertise}:{port}"
    record = Announcement(control=control, engine=engine, version=PROTOCOL_VERSION,
                          mem_free=psutil.virtual_memory().available)
    return ServiceInfo(SERVICE_TYPE, f"meshpipe-stage-{stage_id}.{SERVICE_TYPE}", port=port,
                       properties=record.properties(), addresses=[_packed(advertise)],
                       server=f"meshpipe-{stage_id}.local.")


def _packed(host: str) -> bytes:
    """The address record's bytes; a host name is resolved once, here."""
    for family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            return socket.inet_pton(family, host)
    return socket.inet_aton(socket.gethostbyname(host))


@contextlib.asynccontextmanager
async def announced(stage_id: str, advertise: str, port: int, engine: str) -> AsyncIterator[None]:
    """Registered for as long as the block runs; unregistered (a goodbye packet) on the way out."""
    info = service_info(stage_id, advertise, port, engine)
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)  # where `mesh serve --discover` listens; an
    # IPv6 --advertise still goes out, in the record and the TXT control address
    try:
        await (await zc.async_register_service(info))
        log.info("announced on the LAN as %s (port %d)", info.name, port)
        refresh = asyncio.create_task(_refresh(zc, stage_id, advertise, port, engine))
        try:
            yield
        finally:
            refresh.cancel()
            await asyncio.wait([refresh])  # a failed refresh must not stop the withdrawal
            if not refresh.cancelled() and (error := refresh.exception()) is not None:
                log.warning("refreshing the LAN announcement failed, it kept its old free memory: %s", error)
            await (await zc.async_unregister_service(info))
    finally:
        await zc.async_close()


async def _refresh(zc: AsyncZeroconf, stage_id: str, advertise: str, port: int, engine: str) -> None:
    while True:
        await asyncio.sleep(REFRESH_S)
        await (await zc.async_update_service(service_info(stage_id, advertise, port, engine)))
