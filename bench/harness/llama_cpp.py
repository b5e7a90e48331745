"""llama.cpp's own servers for `mesh bench --scenarios peers`: what a user would run instead.

One node is `llama-server`. Two machines are llama.cpp's RPC backend: `ggml-rpc-server` on
the second machine and `llama-server --rpc HOST:PORT` on the first, their one link through
the bench's delay proxy (bench/harness/delay_proxy.py). `-ngl K` puts the output head and
the last K-1 layers on the RPC device (llama.cpp counts the head as the first layer to
offload) and keeps the embeddings and the other layers with llama-server, so the bench
gives it the cut meshpipe's split-2 chose: the same layers and the head on each machine as
meshpipe's stages hold. Its log's "offloaded K/N layers" line and the RPC device's model
buffer are checked, so a flag that stopped splitting fails the run instead of measuring
one machine. `--fit off`: llama-server would otherwise adjust what was not set to the
devices' memory. Speculation is llama-server's
own with the same draft on the first machine: without `--spec-type` it loads the draft
and never uses it.

Each process is pinned with `taskset -c` to its emulated machine and runs one thread per
CPU of it, as `mesh serve --stage-cpus` runs each stage. llama-server repacks weights only
where meshpipe's engines do (`--no-repack` otherwise, stage/llama_model.py): on a CPU with
AMX its default repack segfaults on the first prompt, as meshpipe's would. Built by
deploy/build-llama-cpp.sh.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.harness.delay_proxy import DelayProxy
from bench.harness.local_server import free_port, stop, unhealthy
from stage.cpus import parse_cpus
from stage.llama_model import flash_attn, use_extra_bufts

SERVER, RPC_SERVER = "llama-server", "ggml-rpc-server"
BUILD_HINT = "build them with deploy/build-llama-cpp.sh, docs/bench.md"
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")


class LlamaCppError(RuntimeError):
    """A llama.cpp server that would not start, or started without the split asked for."""


@dataclass(frozen=True)
class Binaries:
    dir: Path

    def missing(self) -> list[str]:
        return [name for name in (SERVER, RPC_SERVER) if not (self.dir / name).is_file()]

    @property
    def server(self) -> Path:
        return self.dir / SERVER

    @property
    def rpc_server(self) -> Path:
        return self.dir / RPC_SERVER


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server: the model, its machine, and the RPC split and draft when it has them."""

    target: Path
    cpus: str
    ctx: int
    rpc: str | None = None  # HOST:PORT of the (proxied) ggml-rpc-server
    offload: int = 0  # -ngl: the output head and the last offload-1 layers, on the RPC device
    draft: Path | None = None


def threads(cpus: str) -> str:
    return str(len(parse_cpus(cpus)))


def server_cmd(bins: Binaries, spec: ServerSpec, port: int) -> list[str]:
    t = threads(spec.cpus)
    cmd = ["taskset", "-c", spec.cpus, str(bins.server), "-m", str(spec.target), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(spec.ctx), "-np", "1", "-t", t, "-tb", t,
           "-fa", "on" if flash_attn() else "off", "--fit", "off", "--no-webui",
           "-lv", "4"]  # the load_tensors lines the split is checked from are logged from level 4
    if not use_extra_bufts():  # the kernels meshpipe's engines run; AMX's crash llama-server too
        cmd.append("--no-repack")
    # without an RPC device nothing can be offloaded, but the log would still say "offloaded 31/31"
    cmd += ["--rpc", spec.rpc, "-ngl", str(spec.offload)] if spec.rpc else ["-ngl", "0"]
    if spec.draft:
        cmd += ["-md", str(spec.draft), "-ngld", "0", "-td", t, "--spec-type", "draft-simple"]
    return cmd


def rpc_server_cmd(bins: Binaries, cpus: str, port: int) -> list[str]:
    return ["taskset", "-c", cpus, str(bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", threads(cpus)]


def offload_for_cut(layer_count: int, cut: int) -> int:
    """-ngl for layers [cut, layer_count) and the output head on the RPC device."""
    return layer_count - cut + 1


def split_evidence(log: str, offload: int) -> str:
    """The log's line saying how many layers went to the RPC device; raises unless it is
    `offload` and the RPC device holds model weights."""
    found = _OFFLOADED.search(log)
    if not found or int(found.group(1)) != offload:
        said = found.group(0) if found else "no 'offloaded K/N layers' line"
        raise LlamaCppError(f"llama-server did not put {offload} layers on the RPC device: {said}")
    on_rpc = re.search(r"RPC\S*\s+model buffer size\s*=\s*(\d+(?:\.\d+)?)", log)
    if not on_rpc or float(on_rpc.group(1)) <= 0:  # a tiny model's layers take a fraction of a MiB
        raise LlamaCppError("llama-server's log shows no model weights on the RPC device")
    return found.group(0)


@contextlib.contextmanager
def llama_server(bins: Binaries, spec: ServerSpec, logs: Path, timeout: float = 300) -> Iterator[str]:
    """Its URL once it answers /health; with an RPC split, only once the split is confirmed."""
    port = free_port()
    log = logs / f"llama-server-{port}.log"
    with _process(server_cmd(bins, spec, port), log) as proc:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout)
        if spec.rpc:
            split_evidence(log.read_text(errors="replace"), spec.offload)
        yield url


@contextlib.contextmanager
def rpc_link(bins: Binaries, cpus: str, delay_ms: float, logs: Path, timeout: float = 60) -> Iterator[str]:
    """ggml-rpc-server on `cpus`, behind a delay proxy: the address llama-server --rpc dials."""
    port = free_port()
    with _process(rpc_server_cmd(bins, cpus, port), logs / f"ggml-rpc-server-{port}.log") as proc:
        _wait_listening(port, proc, timeout)
        with DelayProxy(("127.0.0.1", port), delay_ms) as proxy:
            yield proxy.address


@contextlib.contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    problem = unhealthy(url, proc, log, timeout)
    if problem is not None:
        raise LlamaCppError(f"llama-server {problem}")


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Polls the log-free way: ggml-rpc-server is ready once its port accepts a connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaCppError(f"ggml-rpc-server exited early with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise LlamaCppError(f"ggml-rpc-server not listening on {port} after {timeout}s")
