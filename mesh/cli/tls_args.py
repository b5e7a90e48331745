"""The --tls-* options that `mesh serve` and `mesh stage` share."""

from __future__ import annotations

import argparse

from config.settings import UsageError
from stage.tls import MeshTls, TlsConfigError


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", help="PEM certificate of this node (subjectAltName DNS:meshpipe); "
                   "turns on TLS for gRPC and activation links")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-ca", help="PEM mesh CA that signed every node's certificate "
                   "(default: --tls-cert itself, for one self-signed certificate shared by all)")


def tls_of(args: argparse.Namespace) -> MeshTls | None:
    try:
        return MeshTls.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    except TlsConfigError as exc:
        raise UsageError(str(exc)) from None  # `mesh` prints it as "mesh COMMAND: error: ..."
