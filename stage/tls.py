"""Optional TLS for the whole mesh: gRPC control, ArtifactTransfer and activation links.

Every node holds a certificate and key signed by one mesh CA (a single self-signed
certificate shared by all nodes works too: it is then its own CA). Stages are addressed
by IP, so peers are checked against the fixed name `meshpipe`, not their addresses: issue
the certificates with subjectAltName DNS:meshpipe.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from config.errors import MeshpipeError

MESH_NAME = "meshpipe"


class TlsConfigError(MeshpipeError, ValueError):
    pass


@dataclass(frozen=True)
class MeshTls:
    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, ca: str | None) -> MeshTls | None:
        """None when TLS is off; a clear error for a half-given or unreadable set."""
        if not (cert or key or ca):
            return None
        if not (cert and key):
            raise TlsConfigError("TLS needs both --tls-cert and --tls-key (and --tls-ca unless "
                                 "the certificate is its own CA)")
        tls = cls(Path(cert), Path(key), Path(ca or cert))
        for path in (tls.cert, tls.key, tls.ca):
            if not path.is_file():
                raise TlsConfigError(f"TLS file not found: {path}")
        return tls

    def server_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def client_ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))

    def grpc_server(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def grpc_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())
        return grpc.aio.secure_channel(target, creds,
                                       options=[("grpc.ssl_target_name_override", MESH_NAME), *options])


def channel(target: str, tls: MeshTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A gRPC channel to another mesh node, encrypted when the mesh uses TLS."""
    return tls.grpc_channel(target, options) if tls else grpc.aio.insecure_channel(target, options=list(options))


def add_port(server: grpc.aio.Server, address: str, tls: MeshTls | None) -> int:
    return server.add_secure_port(address, tls.grpc_server()) if tls else server.add_insecure_port(address)


def server_ssl(tls: MeshTls | None) -> ssl.SSLContext | None:
    return tls.server_ssl() if tls else None


def client_ssl(tls: MeshTls | None) -> ssl.SSLContext | None:
    return tls.client_ssl() if tls else None
