"""A throwaway mesh CA and node certificates (subjectAltName DNS:meshpipe) for TLS tests."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stage.tls import MESH_NAME


@dataclass(frozen=True)
class NodeCert:
    cert: Path
    key: Path
    ca: Path

    def args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(MESH_NAME)]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def mesh_ca(directory: Path, nodes: int) -> tuple[Path, list[NodeCert]]:
    """Write a CA and `nodes` node certificates it signed; return the CA path and the nodes."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshpipe test CA")])
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(_cert("meshpipe test CA", ca_key, ca_name, ca_key, ca=True)
                        .public_bytes(serialization.Encoding.PEM))
    out = []
    for i in range(nodes):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = directory / f"node{i}.pem"
        cert.write_bytes(_cert(f"node{i}", key, ca_name, ca_key, ca=False)
                         .public_bytes(serialization.Encoding.PEM))
        out.append(NodeCert(cert, _write_key(key, directory / f"node{i}.key"), ca_path))
    return ca_path, out
