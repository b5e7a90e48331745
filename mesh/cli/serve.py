"""`mesh serve`: the coordinator plus the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from common import event_loop
from config.paths import cache_dir
from config.settings import Config, Speculative, UsageError, load_config
from mesh.api.app import build_app
from mesh.api.reads import ReadLimits
from mesh.api.server import bind, kill_children, serve
from mesh.cli.access_args import access_of, add_access_arguments, open_warning
from mesh.cli.bench_args import add_bench_arguments
from mesh.cli.kv_tier_args import add_kv_tier_arguments
from mesh.cli.tls_args import add_tls_arguments, tls_of
from mesh.coordinator import Coordinator, ServedModel, Topology
from mesh.model.source import resolve_model
from mesh.observe.metrics import Metrics
from mesh.observe.sampler import Sampler
from mesh.routing.peer_probe import discovered_peers
from mesh.routing.route import BenchKnobs, RouteSettings
from mesh.serving.settings import ServingSettings
from mesh.speculative.plan import FRAMES_IN_FLIGHT, PRICED_FRAMES_IN_FLIGHT, resolve_plan
from mesh.speculative.speculation import Speculation
from proto import meshpipe_pb2 as pb
from stage.control import MAX_WIRE_DELAY_MS, own_address
from stage.cpu_lock import HELP as CPU_LOCK_HELP
from stage.cpus import parse_cpus, pin
from stage.engine_choice import ENGINE_CHOICES, Engine, resolve
from stage.kv_tier import TierSizes
from stage.transport import WireEmulation

WIRE_DTYPES = {"f32": pb.F32, "f16": pb.F16, "bf16": pb.BF16}
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 9337


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    p.add_argument("--model", default=None,
                   help="package directory or GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config (default: ~/.config/meshpipe/config.toml, if present)")
    _http_arguments(p)
    add_access_arguments(p)
    _mesh_arguments(p)
    _speculation_arguments(p)
    _engine_arguments(p)
    add_tls_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=_run)


def _http_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="HTTP API address; a bare PORT binds loopback 127.0.0.1 "
                   "(default: [mesh] listen, else 127.0.0.1:9337)")
    p.add_argument("--host", default=None,
                   help="HTTP API host name or address (instead of --listen; default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="HTTP API port (instead of --listen; default: 9337)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long in-flight requests may finish before they are "
                   "cancelled; a second signal exits at once (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, metavar="N",
                   help="largest request body accepted (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=ReadLimits.header_timeout_s, metavar="SECONDS",
                   help="time a request's head (request line and headers) may take to arrive whole; past it, "
                   "408 and the connection closes (default: %(default)s, as nginx)")
    p.add_argument("--body-timeout", type=float, default=ReadLimits.body_timeout_s, metavar="SECONDS",
                   help="longest pause between two reads of a request body; past it, 408 and the connection "
                   "closes (default: %(default)s, as nginx)")
    p.add_argument("--max-header-bytes", type=int, default=ReadLimits.header_bytes, metavar="N",
                   help="largest request head (request line and headers) accepted; beyond it, 431 "
                   "(default: %(default)s, as nginx's 4 x 8k)")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait for a lane; beyond the lanes and these, 429 with Retry-After "
                   "(default: 4 x --lanes; 0: none wait)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="end a request that runs longer than this, queue wait included, with 504 (a stream: "
                   "an error event, then [DONE]) and free its lane on every stage (default: no limit)")

def _mesh_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-stages", type=int, default=1,
                   help="split across N stages on this machine: this process is stage 0 and "
                   "N-1 `mesh stage` processes are spawned on loopback")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a remote `mesh stage` daemon (repeatable, in pipeline order; "
                   "default: [mesh] peers)")
    p.add_argument("--spare", action="append", default=[], metavar="HOST:PORT",
                   help="a standby `mesh stage` (repeatable; default: [mesh] spares): claimed at start and "
                   "sent the artifacts a takeover needs, it replaces a peer that stops answering")
    p.add_argument("--discover", action="store_true",
                   help="also use every stage announced on the LAN (`mesh stage --announce`) that accepts the "
                   "mesh token, after the --peer ones, ordered by address")
    p.add_argument("--discover-seconds", type=float, default=2.0, metavar="SECONDS",
                   help="how long --discover listens for announcements at start (default: %(default)s)")

def _speculation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, metavar="REF",
                   help="draft model for speculative decoding: a GGUF path, hf://org/repo@rev/file.gguf "
                   "or org/repo:QUANT (overrides config and package)")
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="fixed speculative window of N draft tokens")
    p.add_argument("--frames-in-flight", type=int, default=None, metavar="N",
                   help="the most verify frames a session may have in flight while the draft goes on "
                   "(1: wait for each reply). Default auto: 1 with no stage past stage 0, "
                   f"{FRAMES_IN_FLIGHT} under a CPU lock, else {PRICED_FRAMES_IN_FLIGHT} for a cost-aware window, "
                   "which keeps fewer where more "
                   f"does not pay, and {FRAMES_IN_FLIGHT} for a fixed or adaptive one (DESIGN.md §6)")
    p.add_argument("--windows-in-flight", type=int, dest="frames_in_flight", help=argparse.SUPPRESS)  # its old name
    p.add_argument("--speculative-acceptance", choices=("auto", "exact", "rejection"), default=None,
                   help="how a sampled request's drafts are accepted when it names no rule "
                   "(\"speculative_acceptance\" in its body): exact keeps drafts equal to the (seed, "
                   "position) draw, so the output is the same on any topology with or without a draft; "
                   "rejection keeps each with probability min(1, p/q), exact in distribution and accepted "
                   "far more often; auto (default): exact for a seeded request, rejection for an unseeded one")
    p.add_argument("--no-draft", action="store_true",
                   help="no speculative decoding: the draft is never loaded or downloaded")
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help="speculative strategy: auto (the package's default, prompt lookup asked first where that is a "
                   "draft model; the model's MTP layers where it "
                   "declares no draft and carries them), disabled, ngram (prompt lookup, no draft model), "
                   "ngram+draft (prompt lookup first, the draft where it finds no match), draft (the draft model "
                   "alone), mtp (the model's own "
                   "MTP layers draft at the final stage), ngram+mtp, or a strategy the package declares "
                   "(overrides config; --no-draft still turns all off)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="N",
                   help="groups of sessions kept in flight at once, so every stage has work while the "
                   "others compute (default: one per stage; 1 when local stages share cores through the "
                   "CPU lock, where they cannot compute at once)")

def _engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-forced-drafts", action="store_true",
                   help="under response_format or tools, do not propose the tokens the grammar forces as drafts "
                   "(they are proposed by default, with speculation on or off)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="drop every finished request's KV: by default it stays in its lane on every stage, "
                   "and a later request whose prompt starts the same way (a chat's next turn) prefills "
                   "only the rest")
    p.add_argument("--no-warm-up", action="store_true",
                   help="answer at once after start: by default, with a cost-aware window, a 48-token generation "
                   "first lets it choose, so the first request does not pay for the exploration")
    p.add_argument("--cut-on", choices=("measured", "parameters"), default="measured",
                   help="where to cut the model: on the time each stage measures at load (the first route "
                   "is re-cut once when that is clearly faster; rebuilds cut on it) or on parameters and "
                   "memory alone (no re-cut: a faster start)")
    p.add_argument("--resume-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="when a stage dies or hangs, in-flight requests wait this long for the rebuilt route "
                   "and go on where they stopped; past it they fail naming the cause (0: fail at once)")
    p.add_argument("--token", default=None, help="shared mesh token (default: $MESHPIPE_TOKEN)")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions (KV lanes)")
    p.add_argument("--ctx-size", type=int, default=2048, help="context tokens per session")
    p.add_argument("--batch", type=int, default=256, help="rows per engine decode")
    p.add_argument("--threads", type=int, default=None,
                   help="engine threads per stage (default: all cores)")
    p.add_argument("--cpu-lock", default=None, help=CPU_LOCK_HELP + "; 'off' to never take turns "
                   "(default: CACHE/cpu.lock when --local-stages times --threads exceeds the cores)")
    p.add_argument("--engine", nargs="+", default=["auto"], choices=ENGINE_CHOICES, metavar="ENGINE",
                   help="range engine, auto|llama|mlx: one for every local stage, or one per local stage "
                   "with this process first, as in --engine llama mlx (default: auto, which is mlx on "
                   "Apple silicon with mlx installed, else llama)")
    p.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="f32",
                   help="hidden-state dtype on the wire (f32 is exact)")
    p.add_argument("--artifact-listen", default=None,
                   help="HOST:PORT for ArtifactTransfer (default: loopback, or 0.0.0.0 with peers)")
    p.add_argument("--advertise", default=None,
                   help="address stages use to reach this coordinator (default: auto)")
    p.add_argument("--cache-dir", type=Path, default=None)
    add_kv_tier_arguments(p)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every file
    _check(args)
    if args.stage_cpus:
        pin(parse_cpus(args.stage_cpus[0]))  # stage 0 is this process; its threads inherit the set
    config = load_config(args.config)
    access = access_of(args, config)
    sock = bind(*_address(args, config.mesh.listen))  # before anything slow: a taken port fails now
    if (warning := open_warning(sock.getsockname(), access)) is not None:
        _say(warning)
    coordinator = _coordinator(args, config, sock.getsockname()[1])
    metrics = Metrics()
    metrics.watch_hops(coordinator.routes.hops)
    metrics.watch_recoveries(coordinator.recoveries)
    metrics.watch_admission(coordinator.requests.admission)
    metrics.watch_kv_tier(coordinator.routes.tier_figures, lambda: coordinator.requests.tier_misses)
    metrics.watch_windows(coordinator.requests.choices)
    metrics.watch_failures(coordinator.requests.failures)  # /health's record: the two count alike
    sampler = Sampler(coordinator, metrics)  # the web page's snapshots
    reads = ReadLimits(args.header_timeout, args.body_timeout, args.max_header_bytes)
    app = build_app(coordinator, metrics, max_body=args.max_body_bytes, access=access, ui=sampler, reads=reads)
    try:
        event_loop.run(serve(coordinator, app, sock, args.shutdown_grace, _say, on_stop=sampler.close, reads=reads))
    finally:
        kill_children()  # normally none are left; a forced or abandoned stop may leave some
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.local_stages < 1:
        raise UsageError("--local-stages must be at least 1")
    if args.listen and (args.host or args.port is not None):
        raise UsageError("give either --listen HOST:PORT or --host/--port, not both")
    if args.port is not None and not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0-65535, got {args.port}")
    if args.shutdown_grace < 0 or args.max_body_bytes < 1:
        raise UsageError("--shutdown-grace must be >= 0 and --max-body-bytes >= 1")
    if not (0 < args.header_timeout <= 3600 and 0 < args.body_timeout <= 3600):
        raise UsageError("--header-timeout and --body-timeout must be more than 0 and at most 3600 seconds")
    if args.max_header_bytes < 1024:
        raise UsageError("--max-header-bytes must be at least 1024")
    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError("--max-queue must be >= 0")
    if args.request_timeout is not None and not 0 < args.request_timeout <= 86400:
        raise UsageError("--request-timeout must be more than 0 and at most 86400 seconds")
    if args.stage_cpus is not None and len(args.stage_cpus) != args.local_stages:
        raise UsageError(f"--stage-cpus wants one CPU list per local stage ({args.local_stages}), "
                         f"got {len(args.stage_cpus)}")
    if len(args.engine) not in (1, args.local_stages):
        raise UsageError(f"--engine wants one engine, or one per local stage ({args.local_stages}), "
                         f"got {len(args.engine)}")
    for cpus in args.stage_cpus or ():
        parse_cpus(cpus)  # a bad list fails now, not in a spawned stage
    if not 0 <= args.resume_timeout <= 3600:
        raise UsageError("--resume-timeout must be 0-3600 seconds")
    if args.micro_batches is not None and not 1 <= args.micro_batches <= 64:
        raise UsageError("--micro-batches must be between 1 and 64")
    if not 0 < args.discover_seconds <= 60:
        raise UsageError("--discover-seconds must be more than 0 and at most 60")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    if not (0 <= args.wire_delay_ms <= MAX_WIRE_DELAY_MS and 0 <= args.wire_jitter_ms <= MAX_WIRE_DELAY_MS):
        raise UsageError(f"--wire-delay-ms and --wire-jitter-ms must be in 0..{MAX_WIRE_DELAY_MS:g}")


def _address(args: argparse.Namespace, configured: str | None) -> tuple[str, int]:
    """--host/--port, else --listen, else [mesh] listen; a bare port means loopback."""
    listen = args.listen or configured or ""
    host, sep, port = listen.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, listen or str(DEFAULT_PORT)
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen wants HOST:PORT or PORT, got {listen!r}")
    host = args.host or host.strip("[]") or DEFAULT_HOST
    return host, args.port if args.port is not None else int(port)


def _coordinator(args: argparse.Namespace, config: Config, api_port: int) -> Coordinator:
    cache = args.cache_dir or cache_dir()
    package_dir, manifest, sha, model_id = resolve_model(args.model, cache, say=_say)
    names = {model_id} | ({args.model} if args.model else set())
    spec, note = resolve_plan(_cli_speculative(args), args.no_draft, config, names, manifest)
    args.peer = args.peer or list(config.mesh.peers)
    args.spare = args.spare or list(config.mesh.spares)
    token = args.token or os.environ.get("MESHPIPE_TOKEN") or None
    if args.discover:  # found peers join the configured ones, so healing retries them as well
        args.peer += discovered_peers(args.discover_seconds, [*args.peer, *args.spare], token, tls_of(args), _say)
    if token is None and not args.peer and args.local_stages > 1:
        token = secrets.token_hex(16)  # loopback stages still get a token nobody else knows
    cpu_lock = _cpu_lock(args, cache)
    settings, serving = _route_settings(args, cache, token, cpu_lock), _serving_settings(args, cpu_lock)
    settings = replace(settings, mtp=spec is not None and spec.mtp is not None)
    remote = bool(args.peer)
    topology = Topology(
        peers=tuple(args.peer), local_stages=args.local_stages, spares=tuple(args.spare),
        artifact_listen=args.artifact_listen or ("0.0.0.0:0" if remote else "127.0.0.1:0"),
        advertise=args.advertise or (own_address() if remote else "127.0.0.1"),
    )
    if remote and topology.advertise.startswith("127."):
        _say(f"WARNING: stages will reach this coordinator at {topology.advertise}, a loopback "
             "address; pass --advertise with an address they can dial")
    return Coordinator(ServedModel(package_dir, manifest, sha, model_id), settings, serving, topology,
                       Speculation(spec, note, _say), coordinator_id(topology.advertise, api_port), say=_say)


def _route_settings(args: argparse.Namespace, cache: Path, token: str | None, cpu_lock: Path | None) -> RouteSettings:
    bench = BenchKnobs(wire=WireEmulation(args.wire_delay_ms, args.wire_jitter_ms),
                       direct_return=not args.relay_replies, stage_cpus=tuple(args.stage_cpus or ()))
    return RouteSettings(token=token, cache_dir=cache, lanes=args.lanes, ctx_size=args.ctx_size, batch=args.batch,
                         threads=_threads(args), wire_dtype=WIRE_DTYPES[args.wire_dtype], tls=tls_of(args),
                         cpu_lock=cpu_lock, micro_batches=args.micro_batches, prefix_cache=not args.no_prefix_cache,
                         engines=_engines(args), cut_on_measured=args.cut_on == "measured", bench=bench,
                         kv_tier=TierSizes(args.cache_ram, args.cache_disk))


def _serving_settings(args: argparse.Namespace, cpu_lock: Path | None) -> ServingSettings:
    return ServingSettings(lanes=args.lanes, ctx_size=args.ctx_size,
                           max_queue=4 * args.lanes if args.max_queue is None else args.max_queue,
                           request_timeout_s=args.request_timeout, resume_s=args.resume_timeout,
                           prefix_cache=not args.no_prefix_cache, forced_drafts=not args.no_forced_drafts,
                           warm_up=not args.no_warm_up, cpu_lock=cpu_lock)


def coordinator_id(advertise: str, api_port: int) -> str:
    """This coordinator's name on the stages: the same for a `mesh serve` restarted at the same
    address, whose newer term then takes over its old claims at once (a new name would wait
    for their leases to run out, the lanes still granted to them), and different for each
    coordinator sharing the stages."""
    return hashlib.sha256(f"{advertise}:{api_port}".encode()).hexdigest()[:12]


def _engines(args: argparse.Namespace) -> tuple[Engine, ...]:
    """One resolved engine per local stage, stage 0 first; local stages run on this machine,
    so what it cannot run fails here, before any stage starts."""
    names = args.engine * args.local_stages if len(args.engine) == 1 else args.engine
    return tuple(resolve(name) for name in names)


def _threads(args: argparse.Namespace) -> int:
    """--threads; else 0 with --stage-cpus (each process one per CPU of its set), else all cores."""
    if args.threads is not None:
        return int(args.threads)
    return 0 if args.stage_cpus else os.cpu_count() or 2


def _cpu_lock(args: argparse.Namespace, cache: Path) -> Path | None:
    if args.cpu_lock == "off":
        return None
    if args.cpu_lock:
        return Path(args.cpu_lock)
    if args.stage_cpus:
        return None  # each stage on its own cores, as on its own machine
    oversubscribed = _threads(args) * args.local_stages > (os.cpu_count() or 1)
    return cache / "cpu.lock" if args.local_stages > 1 and oversubscribed else None


def _cli_speculative(args: argparse.Namespace) -> Speculative:
    if args.draft_window is not None and args.draft_window < 1:
        raise UsageError("--draft-window must be at least 1")
    if args.frames_in_flight is not None and not 1 <= args.frames_in_flight <= 16:
        raise UsageError("--frames-in-flight must be between 1 and 16")
    if args.strategy is not None and not args.strategy:
        raise UsageError("--strategy wants a name: auto, disabled, ngram, ngram+draft, draft, mtp, ngram+mtp or a "
                         "package strategy")
    if args.draft and args.strategy in ("ngram", "disabled"):
        raise UsageError(f"--draft with --strategy {args.strategy} loads no draft: use --strategy ngram+draft")
    window = args.draft_window
    return Speculative(strategy=args.strategy, draft_model=args.draft, window_policy="fixed" if window else None,
                       initial_window=window, min_window=1 if window else None,
                       max_window=max(window, 16) if window else None,
                       frames_in_flight=args.frames_in_flight, acceptance=args.speculative_acceptance)


def _say(message: str) -> None:
    print(f"mesh: {message}", file=sys.stderr, flush=True)
