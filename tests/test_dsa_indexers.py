"""glm-dsa's shared indexers keep a stage from starting with one (issue 54, DESIGN.md §3).

A shared-indexer layer (`attention.indexer.types` 0) reuses the top-k the previous full-indexer
layer computed in the same graph (glm-dsa.cpp): a stage starting with one has none, and llama.cpp
aborts building its graph. Cuts fall on full-indexer layers; the package writes the kinds llama.cpp
would default from the index, so each stage slices them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType
from tiny_models import GLM_DSA_TYPES

from packages.architectures import INDEXER_TYPES, allowed_cuts, describe_rule
from packages.gguf_files import KeyValue
from packages.stage_metadata import package_metadata, stage_metadata

KEY = INDEXER_TYPES.format("glm-dsa")


def _meta(context: int, types: list[int] | None = None) -> list[KeyValue]:
    u32 = GGUFValueType.UINT32
    out = [KeyValue("glm-dsa.block_count", 9, u32, None), KeyValue("glm-dsa.nextn_predict_layers", 1, u32, None),
           KeyValue("glm-dsa.context_length", context, u32, None)]
    if types is not None:
        out.append(KeyValue(KEY, types, GGUFValueType.ARRAY, u32))
    return out


def test_cuts_fall_on_full_indexer_layers() -> None:
    assert allowed_cuts("glm-dsa", 8, {KEY: GLM_DSA_TYPES}) == [1, 4, 6]
    assert allowed_cuts("glm-dsa", 8, {KEY: [1] * 8}) == list(range(1, 8))
    assert allowed_cuts("glm-dsa", 8) == []  # the kinds unknown: no cut
    assert "a layer with a full indexer" in describe_rule("glm-dsa")
    # deepseek32 runs an indexer in every layer: any cut
    assert allowed_cuts("deepseek32", 8) == list(range(1, 8))


@pytest.mark.parametrize(("context", "expected"), [(4096, [1] * 8), (1048576, [1, 1, 1, 0, 0, 0, 1, 0])])
def test_the_package_writes_the_kinds_llama_cpp_defaults(context: int, expected: list[int]) -> None:
    """Without the key, every layer is full before GLM-5.2's 1M context, else GLM-5.2's table by index."""
    metadata, main = package_metadata("glm-dsa", _meta(context))
    assert main == 8
    assert {kv.key: kv.value for kv in metadata}[KEY] == expected
    stage = {kv.key: kv.value for kv in stage_metadata("glm-dsa", metadata, 6, 8)}
    assert stage[KEY] == expected[6:]
    written, _ = package_metadata("glm-dsa", _meta(1048576, GLM_DSA_TYPES))
    assert {kv.key: kv.value for kv in written}[KEY] == GLM_DSA_TYPES  # the model's own kinds kept


# Packaged without the indexer part of the rule, a split at a shared-indexer layer decodes.
_SHARED_FIRST = """
import sys
from dataclasses import replace
from pathlib import Path
from chain import build_chain, greedy
from packages.architectures import RULES
from packages.writer import write_package
from tiny_models import write_tiny
cut, root = int(sys.argv[1]), Path(sys.argv[2])
RULES["glm-dsa"] = replace(RULES["glm-dsa"], shared_indexers=False)
write_package(write_tiny(root / "m.gguf", "glm-dsa"), root / "pkg", progress=lambda _: None)
greedy(build_chain(root / "pkg", [cut], root / "cache", lanes=1, ctx=64), [1, 72, 101], 2)
print("decoded")
"""


@pytest.mark.mesh
def test_a_stage_starting_with_a_shared_indexer_aborts(tmp_path: Path) -> None:
    """Why `CutRule.shared_indexers` exists: GGML_ASSERT(prev_top_k != nullptr) in glm-dsa.cpp."""
    cut = GLM_DSA_TYPES.index(0)
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "tests"), str(repo)]), "GGML_NO_BACKTRACE": "1"}
    done = subprocess.run([sys.executable, "-c", _SHARED_FIRST, str(cut), str(tmp_path)],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert "decoded" not in done.stdout
    assert done.returncode == -signal.SIGABRT, done.stderr[-3000:]
    assert "shared indexer layer must follow a previous full indexer layer" in done.stderr
