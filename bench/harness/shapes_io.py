"""The timed steps of `mesh bench --scenarios shapes`, each run as its own process.

The scenario (bench/scenarios/shapes.py) starts each step as `taskset -c CPUS python -m
bench.harness.shapes_io STEP ...`, so a step runs pinned to its emulated machine and is timed
inside, without the interpreter's start. A step prints one JSON line with its result; the
two that serve (`artifacts`, `socket-recv`) first print a line with the port they listen on.

- `package SRC OUT`: `mesh package write`'s code (packages/writer.py) on SRC.
- `hash DIR`: sha256 of every layer file of the package in DIR, as `validate` and a stage do.
- `artifacts DIR`: the coordinator's artifact server (mesh/routing/artifact_server.py) for the package.
- `pull SOURCE SHA START END CACHE`: a stage's `prepare_stage` (stage/prepare.py) for [START, END)
  pulling from SOURCE over gRPC, as `mesh stage` does: fetched, verified, materialized.
- `socket-recv DIR COUNT` and `socket-send PORT FILE...`: the same bytes over one plain
  loopback TCP connection, written to files as they arrive: the floor a transfer is held to.
- `load GGUF CTX`: llama.cpp loading a GGUF through stage/llama_model.py's `open_llama`.
- `rowcost GGUF VOCAB`: a one-row decode against a verify window's rows at one position, the
  whole model in one engine (stage/llama_engine.py), interleaved rounds, each step rolled back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
_SIZE = struct.Struct("<Q")


def _say(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


def package(args: argparse.Namespace) -> dict[str, Any]:
    from packages.writer import write_package

    start = time.perf_counter()
    write_package(Path(args.src), Path(args.out), model_id=Path(args.src).stem, progress=lambda _: None)
    return {"seconds": time.perf_counter() - start}


def hash_layers(args: argparse.Namespace) -> dict[str, Any]:
    from packages.integrity import sha256_file

    files = sorted((Path(args.dir) / "layers").glob("layer-*.gguf"))
    start = time.perf_counter()
    for f in files:
        sha256_file(f)
    return {"seconds": time.perf_counter() - start, "bytes": sum(f.stat().st_size for f in files)}


def artifacts(args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(_serve_artifacts(Path(args.dir)))
    return {}


async def _serve_artifacts(root: Path) -> None:
    import grpc

    from mesh.routing.artifact_server import ArtifactServer
    from packages.validate import validate_package
    from proto import meshpipe_pb2_grpc as pb_grpc

    manifest, sha = validate_package(root)
    server = grpc.aio.server()
    pb_grpc.add_ArtifactTransferServicer_to_server(ArtifactServer(root, manifest, sha), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    _say({"port": port, "sha": sha})
    await server.wait_for_termination()  # until the scenario ends the process


def pull(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_pull(args.source, args.sha, args.start, args.end, Path(args.cache)))


async def _pull(source: str, sha: str, start: int, end: int, cache: Path) -> dict[str, Any]:
    from stage.prepare import Progress, Wanted, prepare_stage

    last = [0.0]
    fetch = _grpc_fetcher(source, sha, last)
    progress = Progress()
    begin = time.perf_counter()
    prepared = await prepare_stage(Wanted(str(cache / "absent"), sha, start, end), cache, fetch, progress)
    return {"bytes": progress.bytes_total, "transfer_seconds": last[0] - begin,
            "prepare_seconds": time.perf_counter() - begin, "gguf": str(prepared.gguf)}


def _grpc_fetcher(source: str, sha: str, last: list[float]) -> Callable[[str, int], AsyncIterator[bytes | memoryview]]:
    """stage/control.py's fetcher, without TLS or a token; `last` gets the time of the latest chunk."""
    from stage.artifact_fetch import ArtifactFetcher

    class Timed(ArtifactFetcher):
        async def __call__(self, path: str, offset: int) -> AsyncIterator[bytes | memoryview]:
            async for data in super().__call__(path, offset):
                last[0] = time.perf_counter()
                yield data

    return Timed(source, sha, None)


def socket_recv(args: argparse.Namespace) -> dict[str, Any]:
    dest = Path(args.dir)
    dest.mkdir(parents=True, exist_ok=True)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        _say({"port": listener.getsockname()[1]})
        conn, _ = listener.accept()
        with conn:
            start, total, buf = time.perf_counter(), 0, bytearray(CHUNK)
            for i in range(args.count):
                size = _SIZE.unpack(_exactly(conn, _SIZE.size))[0]
                with (dest / f"file-{i}").open("wb") as out:
                    left = size
                    while left:
                        n = conn.recv_into(buf, min(left, CHUNK))
                        if not n:
                            raise ConnectionError("the sender closed early")
                        out.write(memoryview(buf)[:n])
                        left -= n
                total += size
            return {"bytes": total, "seconds": time.perf_counter() - start}


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("the sender closed early")
        data += more
    return data


def socket_send(args: argparse.Namespace) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", args.port)) as conn:
        for name in args.files:
            path = Path(name)
            conn.sendall(_SIZE.pack(path.stat().st_size))
            with path.open("rb") as f:
                while block := f.read(CHUNK):
                    conn.sendall(block)
    return {}


def load(args: argparse.Namespace) -> dict[str, Any]:
    from mesh.reports.proc_memory import peak_rss
    from stage.llama_model import open_llama

    start = time.perf_counter()
    model = open_llama(Path(args.gguf), n_ctx=args.ctx, n_threads=1, n_threads_batch=1)
    seconds = time.perf_counter() - start
    del model
    return {"seconds": seconds, "peak_rss": peak_rss()}


ROW_COST_AT, ROW_COST_WINDOW, ROW_COST_ROUNDS = 128, 4, 8


def row_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Median ms of a one-row decode and of a verify window (ROW_COST_WINDOW drafts, every
    row's logits) at position ROW_COST_AT; random ids, so an MoE's rows route apart."""
    import statistics

    import numpy as np

    from stage.engine import EngineConfig, Step
    from stage.llama_engine import LlamaRangeEngine

    rows = ROW_COST_WINDOW + 1
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=ROW_COST_AT + rows + 8, threads=1)
    engine = LlamaRangeEngine(Path(args.gguf), cfg)
    ids = np.random.default_rng(0).integers(259, args.vocab, ROW_COST_AT + rows).astype(np.int32)
    engine.step([Step(0, 0, tokens=ids[:ROW_COST_AT])])
    times: dict[int, list[float]] = {1: [], rows: []}
    for r in range(ROW_COST_ROUNDS + 1):
        for n in ((1, rows) if r % 2 else (rows, 1)):  # each first half the time
            start = time.perf_counter()
            engine.step([Step(0, ROW_COST_AT, tokens=ids[ROW_COST_AT:ROW_COST_AT + n], all_logits=n > 1)])
            if r:  # the first round warms up
                times[n].append(time.perf_counter() - start)
    engine.close()
    return {"decode_ms": statistics.median(times[1]) * 1e3, "verify_ms": statistics.median(times[rows]) * 1e3,
            "rows": rows, "at": ROW_COST_AT}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.harness.shapes_io")
    sub = p.add_subparsers(dest="step", required=True)
    for name, step, params in (("package", package, ["src", "out"]), ("hash", hash_layers, ["dir"]),
                               ("artifacts", artifacts, ["dir"]), ("socket-recv", socket_recv, ["dir"]),
                               ("pull", pull, ["source", "sha"]), ("load", load, ["gguf"]),
                               ("socket-send", socket_send, []), ("rowcost", row_cost, ["gguf"])):
        s = sub.add_parser(name)
        s.set_defaults(run=step)
        for param in params:
            s.add_argument(param)
    sub.choices["pull"].add_argument("start", type=int)
    sub.choices["pull"].add_argument("end", type=int)
    sub.choices["pull"].add_argument("cache")
    sub.choices["socket-recv"].add_argument("count", type=int)
    sub.choices["socket-send"].add_argument("port", type=int)
    sub.choices["socket-send"].add_argument("files", nargs="+")
    sub.choices["load"].add_argument("ctx", type=int)
    sub.choices["rowcost"].add_argument("vocab", type=int)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _say(args.run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
