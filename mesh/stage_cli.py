"""`mesh stage --listen HOST:PORT`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from config.paths import cache_dir
from stage.control import StageOptions, own_address
from stage.daemon import run_stage, server_credentials, tls_contexts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stage", help="run a stage daemon that serves a layer range")
    p.add_argument("--listen", default="0.0.0.0:7070", help="HOST:PORT for control (gRPC)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--token", default=None,
                   help="shared mesh token (default: $MESHPIPE_TOKEN); required on every call")
    p.add_argument("--advertise", help="address other stages use to reach this one "
                   "(default: the --listen host, or this host's address when listening on 0.0.0.0)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--tls-cert", help="PEM certificate for gRPC and activation listeners")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA bundle to verify downstream stages")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file
    token = args.token or os.environ.get("MESHPIPE_TOKEN") or None
    host = args.listen.rpartition(":")[0].strip("[]")
    server_tls, client_tls = tls_contexts(args.tls_cert, args.tls_key, args.tls_ca)
    advertise = args.advertise or (host if host not in ("0.0.0.0", "::", "") else own_address())
    options = StageOptions(host=host, advertise=advertise,
                           cache_dir=args.cache_dir or cache_dir(), token=token,
                           threads=args.threads, server_tls=server_tls, client_tls=client_tls)
    creds = server_credentials(args.tls_cert, args.tls_key) if server_tls else None
    if token is None:
        logging.warning("no mesh token set: anyone who can reach %s controls this stage",
                        args.listen)
    asyncio.run(run_stage(args.listen, options, creds))
    return 0
