"""`mesh serve`: the coordinator plus the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path

import uvicorn

from config.paths import cache_dir
from config.settings import Speculative, load_config
from mesh.coordinator import Coordinator, Topology
from mesh.metrics import Metrics
from mesh.model_source import resolve_model
from mesh.openai_api import build_app
from mesh.route import RouteSettings
from mesh.spec_plan import resolve_plan
from mesh.tls_args import add_tls_arguments, tls_of
from proto import meshpipe_pb2 as pb
from stage.control import own_address
from stage.cpu_lock import HELP as CPU_LOCK_HELP

WIRE_DTYPES = {"f32": pb.F32, "f16": pb.F16, "bf16": pb.BF16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    p.add_argument("--model", default=None,
                   help="package directory or GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config (default: ~/.config/meshpipe/config.toml, if present)")
    p.add_argument("--listen", default=None,
                   help="HOST:PORT for the HTTP API (default: [mesh] listen, else 127.0.0.1:9337)")
    p.add_argument("--local-stages", type=int, default=1,
                   help="split across N stages on this machine: this process is stage 0 and "
                   "N-1 `mesh stage` processes are spawned on loopback")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a remote `mesh stage` daemon (repeatable, in pipeline order; "
                   "default: [mesh] peers)")
    p.add_argument("--draft", default=None, metavar="REF",
                   help="draft model for speculative decoding: a GGUF path, hf://org/repo@rev/file.gguf "
                   "or org/repo:QUANT (overrides config and package)")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="fixed speculative window of N draft tokens")
    p.add_argument("--no-draft", action="store_true",
                   help="no speculative decoding: the draft is never loaded or downloaded")
    p.add_argument("--wire-delay-ms", type=float, default=0.0,
                   help="emulate this one-way latency on the link to stage 1 (benchmarks)")
    p.add_argument("--token", default=None, help="shared mesh token (default: $MESHPIPE_TOKEN)")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions (KV lanes)")
    p.add_argument("--ctx-size", type=int, default=2048, help="context tokens per session")
    p.add_argument("--batch", type=int, default=256, help="rows per engine decode")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--cpu-lock", default=None, help=CPU_LOCK_HELP + "; 'off' to never take turns "
                   "(default: CACHE/cpu.lock when --local-stages times --threads exceeds the cores)")
    p.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="f32",
                   help="hidden-state dtype on the wire (f32 is exact)")
    p.add_argument("--artifact-listen", default=None,
                   help="HOST:PORT for ArtifactTransfer (default: loopback, or 0.0.0.0 with peers)")
    p.add_argument("--advertise", default=None,
                   help="address stages use to reach this coordinator (default: auto)")
    p.add_argument("--cache-dir", type=Path, default=None)
    add_tls_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file
    if args.local_stages < 1:
        raise SystemExit("mesh: error: --local-stages must be at least 1")
    cache = args.cache_dir or cache_dir()
    config = load_config(args.config)
    package_dir, manifest, sha, model_id = resolve_model(args.model, cache, say=_say)
    names = {model_id} | ({args.model} if args.model else set())
    spec, note = resolve_plan(_cli_speculative(args), args.no_draft, config, names, manifest)
    args.peer = args.peer or list(config.mesh.peers)
    args.listen = args.listen or config.mesh.listen or "127.0.0.1:9337"
    token = args.token or os.environ.get("MESHPIPE_TOKEN") or None
    if token is None and not args.peer and args.local_stages > 1:
        token = secrets.token_hex(16)  # loopback stages still get a token nobody else knows
    settings = RouteSettings(token=token, cache_dir=cache, lanes=args.lanes,
                             ctx_size=args.ctx_size, batch=args.batch, threads=args.threads,
                             wire_dtype=WIRE_DTYPES[args.wire_dtype], tls=tls_of(args, "serve"),
                             cpu_lock=_cpu_lock(args, cache))
    remote = bool(args.peer)
    topology = Topology(
        peers=tuple(args.peer), local_stages=args.local_stages,
        artifact_listen=args.artifact_listen or ("0.0.0.0:0" if remote else "127.0.0.1:0"),
        advertise=args.advertise or (own_address() if remote else "127.0.0.1"),
    )
    if remote and topology.advertise.startswith("127."):
        _say(f"WARNING: stages will reach this coordinator at {topology.advertise}, a loopback "
             "address; pass --advertise with an address they can dial")
    coordinator = Coordinator(package_dir, manifest, sha, settings, topology, model_id, say=_say,
                              spec=spec, spec_note=note, wire_delay_ms=args.wire_delay_ms)
    host, _, port = args.listen.rpartition(":")
    asyncio.run(_serve(coordinator, host, int(port)))
    return 0


def _cpu_lock(args: argparse.Namespace, cache: Path) -> Path | None:
    if args.cpu_lock == "off":
        return None
    if args.cpu_lock:
        return Path(args.cpu_lock)
    oversubscribed = args.threads * args.local_stages > (os.cpu_count() or 1)
    return cache / "cpu.lock" if args.local_stages > 1 and oversubscribed else None


def _cli_speculative(args: argparse.Namespace) -> Speculative:
    if args.draft_window is not None and args.draft_window < 1:
        raise SystemExit("mesh serve: error: --draft-window must be at least 1")
    window = args.draft_window
    return Speculative(draft_model=args.draft, window_policy="fixed" if window else None,
                       initial_window=window, min_window=1 if window else None,
                       max_window=max(window, 16) if window else None)


async def _serve(coordinator: Coordinator, host: str, port: int) -> None:
    try:
        await coordinator.start()
        metrics = Metrics()
        metrics.watch_hops(coordinator.hops)
        app = build_app(coordinator, metrics)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        server = uvicorn.Server(config)
        _say(f"serving {coordinator.model_id} on http://{host}:{port}/v1")
        await server.serve()
    finally:
        await coordinator.stop()


def _say(message: str) -> None:
    print(f"mesh: {message}", file=sys.stderr, flush=True)
