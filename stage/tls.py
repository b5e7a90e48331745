"""Optional TLS for activation links (the ssl module around asyncio streams)."""

from __future__ import annotations

import ssl


def server_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str | None = None, cert: str | None = None,
                   key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    # Stages are addressed by IP inside a mesh; trust comes from the mesh CA, not DNS names.
    ctx.check_hostname = False
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx
