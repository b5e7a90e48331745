"""gemma4's KV-sharing layers stay with their sources, and per-layer inputs keep it whole (issue 54).

The last `attention.shared_kv_layers` layers reuse the KV of layer n_layer_kv_from_start - 2
(sliding) or - 1 (full), which create_memory (llama-model.cpp) reckons from the stage's own
count and asserts is at least 2. Each stage gets its share of the count; the last keeps the
sources, and no stage has fewer than 2 KV layers. E2B and E4B add a per-layer input made from
the token ids to every layer (gemma4.cpp), which a later stage has not: they are not split.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType
from tiny_models import GEMMA4_SHARED_KV, GEMMA4_SLIDING

from packages import architectures
from packages.architectures import allowed_cuts, swa_key
from packages.gguf_files import KeyValue
from packages.stage_metadata import stage_metadata

SHARED = "gemma4.attention.shared_kv_layers"
META = {swa_key("gemma4"): GEMMA4_SLIDING, SHARED: GEMMA4_SHARED_KV, "gemma4.block_count": len(GEMMA4_SLIDING)}


def test_cuts_keep_the_sharing_layers_with_their_sources_and_two_layers_a_stage() -> None:
    # 1 would leave a one-layer stage; 7 and 8 part layers 8 and 9 from layers 6 and 7
    assert allowed_cuts("gemma4", 10, META) == [3, 4, 6]
    assert allowed_cuts("gemma4", 10, {**META, SHARED: 0}) == [3, 4, 6, 8]
    assert "2 layers or more" in (architectures.stage_refusal("gemma4", META, 3, 4) or "")


def test_each_stage_gets_its_share_of_the_count() -> None:
    u32 = GGUFValueType.UINT32
    metadata = [KeyValue("gemma4.block_count", 10, u32, None), KeyValue(SHARED, 2, u32, None)]
    for (start, end), share in {(0, 6): 0, (6, 10): 2, (3, 10): 2}.items():
        stage = {kv.key: kv.value for kv in stage_metadata("gemma4", metadata, start, end)}
        assert stage[SHARED] == share, (start, end)


def test_per_layer_inputs_keep_it_whole() -> None:
    meta = {**META, "gemma4.embedding_length_per_layer_input": 256}
    assert "per-layer inputs" in (architectures.split_refusal("gemma4", meta) or "")
    assert allowed_cuts("gemma4", 10, meta) == []


# Packaged without the rule, a split at CUT decodes: the first stage keeps the whole model's count.
_WHOLE_COUNT = """
import sys
from pathlib import Path
from chain import build_chain, greedy
from packages.architectures import RULES, CutRule
from packages.writer import write_package
from tiny_models import write_tiny
cut, root = int(sys.argv[1]), Path(sys.argv[2])
RULES["gemma4"] = CutRule()
write_package(write_tiny(root / "m.gguf", "gemma4"), root / "pkg", progress=lambda _: None)
greedy(build_chain(root / "pkg", [cut], root / "cache", lanes=1, ctx=64), [1, 72, 101], 2)
print("decoded")
"""


@pytest.mark.mesh
def test_a_stage_keeping_the_whole_count_aborts(tmp_path: Path) -> None:
    """Why `CutRule.kv_shared` exists: [0,3) with 2 sharing layers has one KV layer of its own."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "tests"), str(repo)]), "GGML_NO_BACKTRACE": "1"}
    done = subprocess.run([sys.executable, "-c", _WHOLE_COUNT, "3", str(tmp_path)],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert "decoded" not in done.stdout
    assert done.returncode == -signal.SIGABRT, done.stderr[-3000:]
    assert "n_layer_kv_from_start >= 2" in done.stderr
