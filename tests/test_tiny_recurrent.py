"""Tiny recurrent and hybrid GGUFs: what llama.cpp makes of them, and what meshpipe does (issue 43).

Each recurrent or hybrid family of `tiny_models` (those of `WRITERS` that are not plain text,
`ONE_NODE_RECURRENT`, served on one node (tests/test_recurrent_one_node.py), and `RECURRENT`,
refused) is opened by llama-cpp-python and decoded greedily twice from fresh
contexts (a recurrent state that leaked or was left uninitialized would part the two), and
llama.cpp's own recurrent and hybrid flags agree with `packages.architecture_kinds.KINDS`. The
families in `packages.architectures.RULES` are admitted, with their kind in what they report;
tests/test_architectures.py proves their splits. The rest stay refused with the reason. In the
mesh tier, a hybrid stage without one kind of layer is shown to abort the process: the reason
their cuts leave both kinds in every stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from chain import reference_greedy
from tiny_models import ONE_NODE_RECURRENT, RECURRENT, WRITERS, write_tiny

from packages import architectures
from packages.architecture_kinds import HYBRID, TEXT
from packages.architecture_kinds import RECURRENT as RECURRENT_KIND
from packages.gguf_files import metadata_of, open_gguf
from packages.stage_metadata import package_metadata
from stage.llama_model import open_llama

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
FAMILIES = sorted([a for a in WRITERS if architectures.kind_of(a) != TEXT] + list(RECURRENT) + list(ONE_NODE_RECURRENT))
ADMITTED = [a for a in FAMILIES if a in architectures.RULES]


def test_the_families_are_these() -> None:
    assert FAMILIES == ["arwkv7", "bailingmoe3", "falcon-h1", "granitehybrid", "jamba", "kimi-linear", "lfm2",
                        "lfm2moe", "mamba", "mamba2", "nemotron_h", "nemotron_h_moe", "plamo2", "qwen35", "qwen35moe",
                        "qwen3next", "rwkv6", "rwkv6qwen2", "rwkv7"]
    assert sorted(RECURRENT) == []  # every one admitted (nemotron_h by its tap's name, hyb)


@pytest.mark.parametrize("arch", FAMILIES)
def test_loads_and_decodes_the_same_twice(arch: str, tmp_path: Path) -> None:
    gguf = write_tiny(tmp_path / f"{arch}.gguf", arch)
    first = reference_greedy(gguf, PROMPT, 6)  # each call a fresh model and context
    assert len(first) == 6
    vocab = open_llama(gguf, n_ctx=64, vocab_only=True).n_vocab()
    assert all(0 <= tok < vocab for tok in first)
    assert reference_greedy(gguf, PROMPT, 6) == first


@pytest.mark.parametrize("arch", FAMILIES)
def test_llama_cpp_takes_it_for_the_kind_meshpipe_knows(arch: str, tmp_path: Path) -> None:
    """The tiny model reaches llama.cpp's recurrent or hybrid memory, not an attention-only stand-in."""
    llm = open_llama(write_tiny(tmp_path / f"{arch}.gguf", arch), n_ctx=64, n_threads=1)
    model = llm._model.model  # held through llm: the model is freed with it
    kind = architectures.kind_of(arch)
    assert kind in (HYBRID, RECURRENT_KIND)
    assert llama_cpp.llama_model_is_recurrent(model) == (kind == RECURRENT_KIND)
    assert llama_cpp.llama_model_is_hybrid(model) == (kind == HYBRID)


@pytest.mark.parametrize("arch", ADMITTED)
def test_is_admitted_with_its_kind_reported(arch: str, tmp_path: Path) -> None:
    architectures.require_servable(arch)
    assert architectures.split_refusal(arch) is None
    kind = architectures.kind_of(arch)
    assert f"{arch}: may be split at" in architectures.describe_rule(arch)
    assert f"; {kind}: " in architectures.describe_rule(arch)
    assert dict(architectures.table())[arch].startswith("split: ")
    values = _tiny_values(arch, tmp_path)
    assert architectures.allowed_cuts(arch, int(values[f"{arch}.block_count"]), values)


def test_nemotron_h_is_split_where_a_recurrent_layer_follows_attention_past_ffn_layers() -> None:
    """nemotron-h.cpp's FFN layers are neither kind: the tap reads nemotron_h_block_out, and a cut
    leaves an attention and a Mamba-2 layer in every stage whatever FFN layers lie between (hyb)."""
    assert architectures.tap_name("nemotron_h", 7) == architectures.tap_name("nemotron_h_moe", 7) \
        == "nemotron_h_block_out-7"
    kinds = "MFMA" * 3
    meta = {"nemotron_h.attention.head_count_kv": [2 if k == "A" else 0 for k in kinds],
            "nemotron_h.feed_forward_length": [8 if k == "F" else 0 for k in kinds]}
    assert architectures.allowed_cuts("nemotron_h", 12, meta) == [4, 8]
    assert "all recurrent" in (architectures.stage_refusal("nemotron_h", meta, 0, 3) or "")
    assert architectures.stage_refusal("nemotron_h", meta, 1, 4) is None


def test_qwen4exp_is_refused_with_its_graphs_reason() -> None:
    """Its residual is hyper-connection streams, which no n_embd-wide stage input can carry (hyb)."""
    assert architectures.allowed_cuts("qwen4exp", 8) == []
    assert "hyper_connection.count streams" in dict(architectures.table())["qwen4exp"]


# Packaged with every cut allowed (no recurrent_layers; its other rules kept, so each stage loads), a split at
# CUT decodes: the process should abort.
_ONE_KIND_STAGE = """
import sys
from pathlib import Path
from chain import build_chain, greedy
import dataclasses
from packages.architectures import RULES
from packages.writer import write_package
from tiny_models import write_tiny
arch, cut, root = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
RULES[arch] = dataclasses.replace(RULES[arch], recurrent_layers="")
write_package(write_tiny(root / "m.gguf", arch), root / "pkg", progress=lambda _: None)
greedy(build_chain(root / "pkg", [cut], root / "cache", lanes=1, ctx=64), [1, 72, 101], 2)
print("decoded")
"""


@pytest.mark.mesh
@pytest.mark.parametrize(("arch", "cut"), [("lfm2", 2), ("granitehybrid", 11), ("nemotron_h", 2),
                                         ("nemotron_h_moe", 2), ("jamba", 2), ("plamo2", 2), ("kimi-linear", 2)])
def test_a_hybrid_stage_of_one_kind_of_layer_aborts(arch: str, cut: int, tmp_path: Path) -> None:
    """lfm2 [0,2) holds only short-convolution layers, granitehybrid [11,12) only attention:
    llm_graph_input_mem_hybrid::set_input fills the inputs of both memories, and the kind the
    graph lacks has no buffer (GGML_ASSERT(buffer)). Why `CutRule.recurrent_layers` exists."""
    assert cut not in architectures.allowed_cuts(arch, 12, _tiny_values(arch, tmp_path))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "tests"), str(repo)]), "GGML_NO_BACKTRACE": "1"}
    done = subprocess.run([sys.executable, "-c", _ONE_KIND_STAGE, arch, str(cut), str(tmp_path)],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert "decoded" not in done.stdout
    assert done.returncode == -signal.SIGABRT, done.stderr[-3000:]
    # the input of the missing kind without a buffer: asserted in set_input, or (plamo2, kimi-linear,
    # whose graphs build the missing kind's inputs anyway) where ggml_backend_tensor_set writes it
    assert "GGML_ASSERT(buffer) failed" in done.stderr or "tensor buffer not set" in done.stderr


def _tiny_values(arch: str, root: Path) -> dict[str, Any]:
    metadata, _ = package_metadata(arch, metadata_of(open_gguf(write_tiny(root / "check.gguf", arch))))
    return {kv.key: kv.value for kv in metadata}
