"""llama.cpp's own servers for `mesh bench --scenarios peers`: what a user would run instead.

One node is `llama-server`. Two or three machines are llama.cpp's RPC backend: one
`ggml-rpc-server` on each machine after the first and `llama-server --rpc HOST:PORT[,...]`
on the first, each link through its own delay proxy (bench/harness/delay_proxy.py), so every
token goes out to each RPC device and back to llama-server in turn. `-ngl K` puts the output
head and the last K-1 layers on the RPC devices (llama.cpp counts the head as the first layer
to offload) and keeps the embeddings and the other layers with llama-server; with two RPC
devices `--tensor-split` divides those K between them in proportion, in --rpc order, the
head counted in the last one's share (src/llama-model.cpp, load_tensors). The bench gives it
the cuts meshpipe's split chose (`RpcSplit`): the same layers and the head on each machine as
meshpipe's stages hold. Its log's "offloaded K/N layers" line, each RPC device's model
buffer and the layers its KV buffer holds are checked, so a flag that stopped splitting
fails the run instead of measuring one machine. `--fit off`: llama-server would otherwise
adjust what was not set to the devices' memory. Speculation is llama-server's
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
import itertools
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
_LOADING = "load_tensors: loading model tensors"  # once per model loaded, the target first


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
class RpcSplit:
    """llama-server's layers on its RPC devices, as meshpipe's stages after stage 0 hold them:
    device i (the i-th --rpc address) holds [cuts[i], cuts[i+1]), the last one up to
    layer_count and the output head; the embeddings and the layers before cuts[0] stay with
    llama-server."""

    links: tuple[str, ...]  # HOST:PORT of each (proxied) ggml-rpc-server, in stage order
    cuts: tuple[int, ...]  # each later stage's first layer (meshpipe's /health)
    layer_count: int

    def __post_init__(self) -> None:
        bounds = (0, *self.cuts, self.layer_count)
        if len(self.links) != len(self.cuts) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"an RPC split needs one link per cut and cuts inside (0, {self.layer_count}), "
                             f"ascending: {self.links} at {self.cuts}")

    @property
    def layers(self) -> tuple[int, ...]:
        """The repeating layers each RPC device holds."""
        ends = (*self.cuts[1:], self.layer_count)
        return tuple(end - start for start, end in zip(self.cuts, ends, strict=True))

    @property
    def offload(self) -> int:
        """-ngl: the output head and every layer from the first cut on."""
        return self.layer_count - self.cuts[0] + 1

    def flags(self) -> list[str]:
        """With several devices, `--tensor-split` in whole layers: llama.cpp gives device i the
        offloaded layers whose index among them falls in its share, the head last, so the
        last device's share counts the head."""
        flags = ["--rpc", ",".join(self.links), "-ngl", str(self.offload)]
        if len(self.links) > 1:
            shares = (*self.layers[:-1], self.layers[-1] + 1)
            flags += ["--tensor-split", ",".join(map(str, shares))]
        return flags


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server: the model, its machine, and the RPC split and draft when it has them."""

    target: Path
    cpus: str
    ctx: int
    split: RpcSplit | None = None
    draft: Path | None = None
    parallel: int = 1  # -np: slots, each of ctx / parallel tokens unless `extra` unifies them
    extra: tuple[str, ...] = ()  # a scenario's own flags


def threads(cpus: str) -> str:
    return str(len(parse_cpus(cpus)))


def server_cmd(bins: Binaries, spec: ServerSpec, port: int) -> list[str]:
    t = threads(spec.cpus)
    cmd = ["taskset", "-c", spec.cpus, str(bins.server), "-m", str(spec.target), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(spec.ctx), "-np", str(spec.parallel), "-t", t, "-tb", t,
           "-fa", "on" if flash_attn() else "off", "--fit", "off", "--no-webui",
           "-lv", "4"]  # the load_tensors lines the split is checked from are logged from level 4
    if not use_extra_bufts():  # the kernels meshpipe's engines run; AMX's crash llama-server too
        cmd.append("--no-repack")
    # without an RPC device nothing can be offloaded, but the log would still say "offloaded 31/31"
    cmd += spec.split.flags() if spec.split else ["-ngl", "0"]
    if spec.draft:
        cmd += ["-md", str(spec.draft), "-ngld", "0", "-td", t, "--spec-type", "draft-simple"]
    return cmd + list(spec.extra)


def rpc_server_cmd(bins: Binaries, cpus: str, port: int) -> list[str]:
    return ["taskset", "-c", cpus, str(bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", threads(cpus)]


def split_evidence(log: str, split: RpcSplit) -> str:
    """What llama-server's log says it put on each RPC device; raises unless it offloaded
    `split.offload` layers, every device holds model weights, and each device's KV buffer
    holds as many layers as it should (checked where each device has one KV cache, so every
    layer's cache is alike; with a sliding-window cache beside it the weights must do).
    Only the target's part of the log counts: a draft loads after it, all on the CPU."""
    target = _LOADING.join(log.split(_LOADING, 2)[:2])
    found = _OFFLOADED.search(target)
    if not found or int(found.group(1)) != split.offload:
        line = found.group(0) if found else "no 'offloaded K/N layers' line"
        raise LlamaCppError(f"llama-server did not put {split.offload} layers on the RPC devices: {line}")
    weights = _buffers(target, "model")
    for link in split.links:
        if weights.get(link, [0.0])[0] <= 0:  # a tiny model's layers take a fraction of a MiB
            raise LlamaCppError(f"llama-server's log shows no model weights on the RPC device at {link}")
    said = [f"{link}: {weights[link][0]:.2f} MiB of weights" for link in split.links]
    held = _kv_layers(target, split)
    if held is not None:
        if held != split.layers:
            raise LlamaCppError(f"llama-server's RPC devices hold {held} layers' KV, not {split.layers}")
        said = [f"{text}, KV for {n} layer{'s' if n != 1 else ''}" for text, n in zip(said, held, strict=True)]
    return f"{found.group(0)}; " + "; ".join(said)


def _buffers(log: str, kind: str) -> dict[str, list[float]]:
    """MiB per buffer of one kind ("model", "KV"), by the RPC device's address ("CPU" and
    the like as named); a device with two caches has two entries."""
    sizes: dict[str, list[float]] = {}
    for name, mib in re.findall(rf"(\S+) {kind} buffer size\s*=\s*(\d+(?:\.\d+)?) MiB", log):
        link = re.fullmatch(r"RPC\d*\[(.+)\]", name)
        sizes.setdefault(link.group(1) if link else name, []).append(float(mib))
    return sizes


def _kv_layers(log: str, split: RpcSplit) -> tuple[int, ...] | None:
    """The layers each RPC device's KV buffer holds, from its share of all KV buffers; None
    where a device has more than one cache (their layers are not alike)."""
    kv = _buffers(log, "KV")
    if not kv:
        raise LlamaCppError("llama-server's log shows no KV buffer sizes to check its split from")
    if any(len(sizes) > 1 for sizes in kv.values()):
        return None
    per_layer = sum(sizes[0] for sizes in kv.values()) / split.layer_count
    if per_layer <= 0:
        return None
    return tuple(round(kv.get(link, [0.0])[0] / per_layer) for link in split.links)


@dataclass(frozen=True)
class Started:
    url: str
    split: str = ""  # with an RPC split: what the log says each device holds (split_evidence)


@contextlib.contextmanager
def llama_server(bins: Binaries, spec: ServerSpec, logs: Path, timeout: float = 300) -> Iterator[Started]:
    """It once it answers /health; with an RPC split, only once the split is confirmed."""
    port = free_port()
    log = logs / f"llama-server-{port}.log"
    with _process(server_cmd(bins, spec, port), log) as proc:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout)
        yield Started(url, split_evidence(log.read_text(errors="replace"), spec.split) if spec.split else "")


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
