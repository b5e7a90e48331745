"""The peers bench's llama.cpp RPC split, for real: the flags split the model, through the delay proxy.

Needs the binaries deploy/build-llama-cpp.sh builds, named by MESH_LLAMA_CPP_BIN; skipped
without them (CI has none: the bench itself runs without them too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.harness.client import stream_chat
from bench.harness.llama_cpp import Binaries, ServerSpec, llama_server, offload_for_cut, rpc_link
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
        spec = ServerSpec(embedded_gguf(), "0", 512, rpc=link, offload=offload_for_cut(30, 15))
        with llama_server(bins, spec, tmp_path) as url:
            timing = stream_chat(url, "smollm2", "Name a colour.", 4)
    assert timing.completion_tokens == 4
    log = next(tmp_path.glob("llama-server-*.log")).read_text(errors="replace")
    assert "offloaded 16/31 layers" in log
