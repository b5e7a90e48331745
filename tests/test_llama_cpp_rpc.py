"""The peers bench's llama.cpp RPC split, for real: the flags split the model, through the delay proxy.

Needs the binaries deploy/build-llama-cpp.sh builds, named by MESH_LLAMA_CPP_BIN; skipped
without them (CI has none: the bench itself runs without them too).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench.harness.client import stream_chat
from bench.harness.llama_cpp import Binaries, RpcSplit, ServerSpec, llama_server, rpc_link
from mesh.model.source import embedded_gguf

pytestmark = pytest.mark.mesh
ENV = "MESH_LLAMA_CPP_BIN"


@pytest.fixture(scope="module")
def bins() -> Binaries:
    where = os.environ.get(ENV)
    if not where:
        pytest.skip(f"needs llama-server and ggml-rpc-server: set {ENV} to the directory "
                    "deploy/build-llama-cpp.sh filled")
    found = Binaries(Path(where))
    if missing := found.missing():
        pytest.skip(f"{where} lacks {', '.join(missing)}")
    return found


def test_the_rpc_split_through_the_delay_proxy_is_confirmed_from_the_log_and_serves(bins, tmp_path):
    second = str(1 % (os.cpu_count() or 1))
    with rpc_link(bins, second, 5, tmp_path) as link:
        # llama_server raises unless its log shows the 16 layers on the RPC device
        spec = ServerSpec(embedded_gguf(), "0", 512, RpcSplit((link,), (15,), 30))
        with llama_server(bins, spec, tmp_path) as started:
            timing = stream_chat(started.url, "smollm2", "Name a colour.", 4)
    assert timing.completion_tokens == 4
    log = next(tmp_path.glob("llama-server-*.log")).read_text(errors="replace")
    assert "offloaded 16/31 layers" in log
    said = rf"offloaded 16/31 layers; {re.escape(link)}: [\d.]+ MiB of weights, KV for 15 layers"
    assert re.fullmatch(said, started.split)


def test_two_rpc_devices_each_hold_their_stages_layers_and_serve(bins, tmp_path):
    """Split-3 as the peers bench runs it: layers [11, 21) on the first RPC device, [21, 30) and
    the head on the second, each through its own proxy; the KV buffers say how many layers each holds."""
    cpus = [str(k % (os.cpu_count() or 1)) for k in (1, 0)]
    with rpc_link(bins, cpus[0], 5, tmp_path) as a, rpc_link(bins, cpus[1], 5, tmp_path) as b:
        spec = ServerSpec(embedded_gguf(), "0", 512, RpcSplit((a, b), (11, 21), 30))
        with llama_server(bins, spec, tmp_path) as started:
            timing = stream_chat(started.url, "smollm2", "Name a colour.", 4)
    assert timing.completion_tokens == 4
    assert re.fullmatch(rf"offloaded 20/31 layers; {re.escape(a)}: [\d.]+ MiB of weights, KV for 10 layers; "
                        rf"{re.escape(b)}: [\d.]+ MiB of weights, KV for 9 layers", started.split)
