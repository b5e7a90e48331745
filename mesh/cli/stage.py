"""`mesh stage --listen HOST:PORT`."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from common import event_loop
from config.paths import cache_dir
from mesh.cli.kv_tier_args import add_kv_tier_arguments
from mesh.cli.tls_args import add_tls_arguments, tls_of
from stage.control import MAX_LANES, SHARES, StageOptions, own_address
from stage.cpu_lock import HELP as CPU_LOCK_HELP
from stage.cpus import HELP as CPUS_HELP
from stage.cpus import available_cpus, parse_cpus, pin
from stage.daemon import run_stage
from stage.engine_choice import ENGINE_CHOICES, resolve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stage", help="run a stage daemon that serves a layer range")
    p.add_argument("--listen", default="0.0.0.0:7070", help="HOST:PORT for control (gRPC; default: %(default)s)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--token", default=None,
                   help="shared mesh token (default: $MESHPIPE_TOKEN); required on every call")
    p.add_argument("--advertise", help="address other stages use to reach this one "
                   "(default: the --listen host, or this host's address when listening on 0.0.0.0)")
    p.add_argument("--threads", type=int, default=None,
                   help="engine threads (default: one per CPU this process may run on)")
    p.add_argument("--cpus", default=None, metavar="LIST", help=CPUS_HELP)
    p.add_argument("--cpu-lock", type=Path, default=None, help=CPU_LOCK_HELP)
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="range engine: mlx on Apple silicon with mlx installed, else llama.cpp "
                   "(default: %(default)s)")
    p.add_argument("--announce", action="store_true",
                   help="advertise this stage on the LAN by mDNS/DNS-SD (_meshpipe._tcp), so `mesh serve "
                   "--discover` finds it: its address, engine, protocol version and free memory, never the token")
    p.add_argument("--lanes", type=_count, default=0,
                   help="KV lanes each loaded range opens with, shared by every coordinator that claims it "
                   "(each is granted the lanes its --lanes asks, while enough are free; a range cannot add "
                   f"lanes once loaded). Default: {SHARES}x what the first claim asks, so {SHARES} coordinators "
                   "like it share the range, fewer where the lanes past its ask would take more than half "
                   "the memory left beside it (--memory, or what is free), never fewer than it asks; a "
                   "claim refused for want of lanes is told whether memory or the lanes held are why")
    p.add_argument("--memory", type=_size, default=None, metavar="SIZE",
                   help="most memory the loaded ranges may take, e.g. 12GiB or 800MB: a claim on a "
                   "range past it is refused with the figures (default: what is free at each Load)")
    p.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help="serve the stage's Prometheus metrics at http://HOST:PORT/metrics: its claims, each "
                   "claim's lanes and lanes in use, each range's free lanes and engine time (default: off; "
                   "no token is asked there, so bind it where only your monitoring reaches)")
    add_kv_tier_arguments(p)
    add_tls_arguments(p)
    p.set_defaults(func=_run)


def _count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_LANES:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LANES}")
    return value


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def _size(text: str) -> int:
    """Bytes from "12GiB", "800MB" or "1e9"."""
    number = text.rstrip("bBiIkKmMgGtT ")
    unit = text[len(number):].strip().upper()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say e.g. 12GiB or 800MB)") from None
    if not 0 < value < 1 << 60:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(value)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file
    if args.cpus:
        pin(parse_cpus(args.cpus))  # first, so every thread started from here on inherits it
    token = args.token or os.environ.get("MESHPIPE_TOKEN") or None
    host = args.listen.rpartition(":")[0].strip("[]")
    tls = tls_of(args)
    advertise = args.advertise or (host if host not in ("0.0.0.0", "::", "") else own_address())
    if advertise.startswith("127.") and host not in ("127.0.0.1", "localhost"):
        logging.warning("advertising %s, which other machines cannot reach; pass --advertise", advertise)
    engine = resolve(args.engine)  # before listening: a stage that cannot run its engine says so now
    logging.info("engine: %s", engine)
    options = StageOptions(host=host, advertise=advertise,
                           cache_dir=args.cache_dir or cache_dir(), token=token,
                           threads=args.threads or len(available_cpus()), tls=tls, cpu_lock=args.cpu_lock,
                           engine=engine, memory=args.memory, lanes=args.lanes, cache_ram=args.cache_ram,
                           cache_disk=args.cache_disk)
    if token is None:
        logging.warning("no mesh token set: anyone who can reach %s controls this stage",
                        args.listen)
    event_loop.run(run_stage(args.listen, options, announce=args.announce, metrics=args.metrics_listen))
    return 0
