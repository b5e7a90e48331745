"""Packages keep a model's MTP (nextn) layers, and a final stage built with them drafts as the
unsplit model does (issue 56, DESIGN.md §3 step 1, §5).

For tiny deepseek2, glm4moe and qwen35 models with one nextn layer (tests/tiny_models.py): the
package lists the layer in `mtp_layers`; the final stage of a split-2 and the whole model, built
with `mtp`, load with llama.cpp's `load_mtp`, and an MTP context on them gives the logits an MTP
context on the unsplit GGUF gives, bit for bit, for the same tokens and hidden rows; prepare,
the Hub and publish carry the MTP artifacts with the final range. Without `mtp` nothing
changes: the stage GGUF keeps its sha256, a package of a model without nextn layers its
manifest. All in-process, milliseconds a load.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from hub_cache import COMMIT, add_files, package_files, use_hf_home
from llama_cpp import llama_cpp as L
from llama_cpp import llama_cpp_ext as E
from tiny_models import write_tiny

from packages import hub
from packages.architectures import mtp_refusal
from packages.describe import describe
from packages.errors import PackageError
from packages.gguf_files import field_value, metadata_of, open_gguf
from packages.integrity import sha256_file
from packages.manifest import MANIFEST_NAME, Manifest, load_manifest, parse_manifest
from packages.materialize import materialize_stage, mtp_cost, stage_path
from packages.publish import plan_publish
from packages.refs import parse_hub_ref
from packages.validate import validate_package
from packages.writer import write_package
from stage.llama_model import flash_attn_type, model_params
from stage.prepare import PreparedStage, Progress, Wanted, prepare_stage

ARCHS = ("deepseek2", "glm4moe", "qwen35")
TOKENS = [1, 40, 41, 42, 77, 9]


@dataclass(frozen=True)
class Tiny:
    gguf: Path
    package: Path
    manifest: Manifest
    sha: str

    @property
    def cut(self) -> int:
        return self.manifest.allowed_cuts[len(self.manifest.allowed_cuts) // 2]

    @property
    def mtp_start(self) -> int:
        """The first layer of a final stage that runs MTP: after the cut, where it may be."""
        return 0 if mtp_refusal(self.manifest.architecture, self.cut) else self.cut


def _quiet(_: str) -> None:
    pass


def _tiny(root: Path, arch: str) -> Tiny:
    gguf = write_tiny(root / f"{arch}.gguf", arch)
    write_package(gguf, root / f"{arch}-pkg", progress=_quiet, created_at=0)
    manifest, sha = load_manifest(root / f"{arch}-pkg")
    return Tiny(gguf, root / f"{arch}-pkg", manifest, sha)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return _tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A model without nextn layers."""
    return _tiny(tmp_path_factory.mktemp("llama"), "llama")


@contextmanager
def _model(gguf: Path, load_mtp: bool) -> Iterator[ctypes.c_void_p]:
    L.llama_backend_init()
    params = model_params()
    params.load_mtp = load_mtp
    model = L.llama_model_load_from_file(str(gguf).encode(), params)
    assert model, f"llama.cpp did not load {gguf.name}"
    try:
        yield model
    finally:
        L.llama_model_free(model)


@contextmanager
def _context(model: ctypes.c_void_p, kind: int) -> Iterator[ctypes.c_void_p]:
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 64, 16, 16, 1
    params.n_threads = params.n_threads_batch = 1
    params.flash_attn_type = flash_attn_type()
    params.ctx_type = kind
    ctx = L.llama_init_from_model(model, params)
    assert ctx, "llama.cpp made no context"
    try:
        yield ctx
    finally:
        L.llama_free(ctx)


def _vocab(model: ctypes.c_void_p) -> int:
    return int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))


def mtp_logits(gguf: Path) -> np.ndarray:
    """The MTP head's logits after TOKENS, each row's hidden input a fixed random row (what the
    target's last layer would give): an MTP context fed as a drafting final stage feeds it."""
    with _model(gguf, load_mtp=True) as model, _context(model, L.LLAMA_CONTEXT_TYPE_MTP) as ctx:
        assert L.llama_model_n_layer_nextn(model) == 1
        width = int(L.llama_model_n_embd(model))
        rows = np.random.default_rng(7).standard_normal((len(TOKENS), width)).astype(np.float32)
        E.llama_set_embeddings_nextn(ctx, True, True)
        batch = L.llama_batch_ext_init(ctx)
        try:
            for pos, token in enumerate(TOKENS):
                idx = L.llama_batch_ext_add_token(batch, 0, token)
                L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(ctypes.c_int(pos)))
                row = rows[pos].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                L.llama_batch_ext_set_embd_token(batch, idx, L.llama_embd(row, 1, width))
                L.llama_batch_ext_set_output_logits(batch, idx, pos == len(TOKENS) - 1)
            assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        finally:
            L.llama_batch_ext_free(batch)
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(_vocab(model),)).copy()


def decode_logits(gguf: Path, load_mtp: bool) -> np.ndarray:
    """The last row's logits of a plain decode of TOKENS (a whole-model stage)."""
    with _model(gguf, load_mtp) as model, _context(model, L.LLAMA_CONTEXT_TYPE_DEFAULT) as ctx:
        batch = L.llama_batch_init(len(TOKENS), 0, 1)
        try:
            for i, token in enumerate(TOKENS):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, i, 1, 0
                batch.logits[i] = i == len(TOKENS) - 1
            batch.n_tokens = len(TOKENS)
            assert L.llama_decode(ctx, batch) == 0
        finally:
            L.llama_batch_free(batch)
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(_vocab(model),)).copy()


def test_the_package_keeps_the_nextn_layer_as_its_own_artifact(tiny: Tiny) -> None:
    m = tiny.manifest
    (mtp,) = m.mtp_layers
    assert (mtp.path, mtp.layer_index) == ("layers/mtp-00000.gguf", m.layer_count)
    assert mtp in m.artifacts()
    validate_package(tiny.package)  # verifies it with the rest
    reader = open_gguf(tiny.package / mtp.path)
    assert {t.name.split(".")[1] for t in reader.tensors} == {str(m.layer_count)}  # the source's names
    entries = {kv.key: kv.value for kv in metadata_of(reader)}
    assert entries[f"{m.architecture}.attention.head_count"] == [4]  # its entry of the per-layer array
    meta = open_gguf(tiny.package / m.shared["metadata"].path)
    assert field_value(meta, f"{m.architecture}.block_count") == m.layer_count  # the main stack, as before
    assert field_value(meta, f"{m.architecture}.nextn_predict_layers") == 0


@pytest.mark.parametrize("whole", [False, True], ids=["final-of-2", "whole"])
def test_a_stage_with_mtp_drafts_as_the_unsplit_model(tiny: Tiny, whole: bool, tmp_path: Path) -> None:
    start, end = 0 if whole else tiny.cut, tiny.manifest.layer_count
    if mtp_refusal(tiny.manifest.architecture, start):  # glm4moe: MTP_FROM_LAYER_0
        with pytest.raises(PackageError, match="MTP on a single stage only"):
            materialize_stage(tiny.package, tiny.manifest, tiny.sha, start, end, tmp_path, mtp=True)
        return
    stage = materialize_stage(tiny.package, tiny.manifest, tiny.sha, start, end, tmp_path, mtp=True)
    assert stage == stage_path(tmp_path, tiny.sha, start, end, mtp=True)
    reader = open_gguf(stage)
    arch, own = tiny.manifest.architecture, end - start
    assert field_value(reader, f"{arch}.block_count") == own + 1
    assert field_value(reader, f"{arch}.nextn_predict_layers") == 1
    assert len(field_value(reader, f"{arch}.attention.head_count")) == own + 1
    embeddings = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embeddings.data.any()  # real: the MTP graph embeds the drafted token
    assert np.array_equal(mtp_logits(stage), mtp_logits(tiny.gguf))
    with _model(stage, load_mtp=False) as model:  # the nextn tensors skipped (TENSOR_SKIP)
        assert L.llama_model_n_layer(model) == own  # n_layer(): the main stack
        assert L.llama_model_n_layer_nextn(model) == 1


def test_a_stage_that_carries_the_nextn_layer_loads_and_decodes_without_it(tiny: Tiny, tmp_path: Path) -> None:
    """llama.cpp skips the nextn tensors without `load_mtp` (TENSOR_SKIP): the stage decodes as
    the one built without them."""
    end = tiny.manifest.layer_count
    with_mtp = materialize_stage(tiny.package, tiny.manifest, tiny.sha, 0, end, tmp_path, mtp=True)
    plain = materialize_stage(tiny.package, tiny.manifest, tiny.sha, 0, end, tmp_path)
    assert with_mtp != plain
    assert np.array_equal(decode_logits(with_mtp, load_mtp=False), decode_logits(plain, load_mtp=False))


def test_mtp_is_refused_where_it_cannot_run(tiny: Tiny, dense: Tiny, tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="final stage only"):
        materialize_stage(tiny.package, tiny.manifest, tiny.sha, 0, tiny.cut, tmp_path, mtp=True)
    end = dense.manifest.layer_count
    with pytest.raises(PackageError, match="no MTP"):
        materialize_stage(dense.package, dense.manifest, dense.sha, 0, end, tmp_path, mtp=True)
    assert not list(tmp_path.rglob("*.gguf"))


# The stage GGUF of glm4moe's final stage [4, 8), and the manifest of the tiny llama (created_at 0),
# as the code before MTP layers were kept wrote them (the stage recorded again when tiny MoE models
# took Q8_0 routers; the writer of stage GGUFs did not change).
GLM4MOE_FINAL_STAGE_SHA = "75fab001cf439f9a9e862b82a4ca8d685a77b4d2cad8aa1d119cfc8ad37c01f2"
LLAMA_MANIFEST_SHA = "540db5faff301779d01754596c9e101f15e1353c42f7ae5bc3cb9ca0ec71354b"


def test_without_mtp_nothing_changes(dense: Tiny, tmp_path: Path) -> None:
    doc = json.loads((dense.package / MANIFEST_NAME).read_bytes())
    assert "mtp_layers" not in doc
    assert dense.sha == LLAMA_MANIFEST_SHA
    assert dense.manifest.to_json() == (dense.package / MANIFEST_NAME).read_bytes()
    glm = _tiny(tmp_path, "glm4moe")
    assert glm.cut == 4
    stage = materialize_stage(glm.package, glm.manifest, glm.sha, 4, 8, tmp_path / "cache")
    assert sha256_file(stage) == GLM4MOE_FINAL_STAGE_SHA


def _doc(tiny: Tiny) -> dict:
    return json.loads((tiny.package / MANIFEST_NAME).read_bytes())


@pytest.mark.parametrize(("change", "error"), [
    (lambda d: d.update(mtp_layers=[]), "'mtp_layers' is empty"),
    (lambda d: d.update(mtp_layers=None), "'mtp_layers' must be list"),
    (lambda d: d["mtp_layers"][0].update(layer_index=3), r"'mtp_layers\[0\].layer_index' is 3, expected"),
    (lambda d: d["mtp_layers"][0].update(extra=1), r"unknown field 'mtp_layers\[0\].extra'"),
    (lambda d: d["mtp_layers"][0].update(path="../x.gguf"), "escapes the package"),
    (lambda d: d["mtp_layers"][0].update(sha256="ab"), "not a sha256"),
    (lambda d: d["mtp_layers"][0].pop("tensor_bytes"), r"missing field 'mtp_layers\[0\].tensor_bytes'"),
])
def test_the_manifest_checks_mtp_layers_strictly(dense: Tiny, change, error) -> None:
    doc = _doc(dense)
    doc["mtp_layers"] = [dict(doc["layers"][-1], path="layers/mtp-00000.gguf", layer_index=doc["layer_count"])]
    assert parse_manifest(doc).mtp_layers[0].layer_index == doc["layer_count"]
    change(doc)
    with pytest.raises(PackageError, match=error):
        parse_manifest(doc)


def test_the_final_range_fetches_its_mtp_layers_only_when_asked(tiny: Tiny, tmp_path: Path) -> None:
    m, start, end = tiny.manifest, tiny.mtp_start, tiny.manifest.layer_count
    assert m.range_artifacts(start, end) == [*m.shared.values(), *m.layers[start:]]
    assert m.range_artifacts(start, end, mtp=True) == [*m.shared.values(), *m.layers[start:], *m.mtp_layers]

    async def fetch(path: str, offset: int) -> AsyncIterator[bytes]:
        yield (tiny.package / path).read_bytes()[offset:]

    def prepare(mtp: bool, cache: Path) -> tuple[PreparedStage, Progress]:
        progress = Progress()
        wanted = Wanted(str(cache / "absent"), tiny.sha, start, end, mtp=mtp)
        return asyncio.run(prepare_stage(wanted, cache, fetch, progress)), progress

    prepared, progress = prepare(False, tmp_path / "plain")
    assert not (tmp_path / "plain" / "packages" / tiny.sha / m.mtp_layers[0].path).exists()
    assert not prepared.mtp
    plain_bytes = progress.bytes_total
    prepared, progress = prepare(True, tmp_path / "mtp")
    assert (tmp_path / "mtp" / "packages" / tiny.sha / m.mtp_layers[0].path).is_file()
    assert progress.bytes_done == progress.bytes_total == plain_bytes + m.mtp_layers[0].artifact_bytes
    assert prepared.mtp
    assert prepared.gguf == stage_path(tmp_path / "mtp", tiny.sha, start, end, mtp=True)


def test_the_memory_mtp_adds_to_the_final_stage_is_said(tiny: Tiny, dense: Tiny, tmp_path: Path) -> None:
    """The tensor bytes a final stage after others gains with `mtp`: its nextn layer's, and its
    real token embeddings' over their placeholder (these tiny heads are untied)."""
    cost = mtp_cost(tiny.package, tiny.manifest)
    assert cost is not None
    assert cost.layers == 1
    assert cost.nextn_bytes == tiny.manifest.mtp_layers[0].tensor_bytes
    end = tiny.manifest.layer_count
    stages = [materialize_stage(tiny.package, tiny.manifest, tiny.sha, tiny.cut, end, tmp_path, mtp=mtp)
              for mtp in (False, True)] if tiny.mtp_start else []
    held = [sum(int(t.n_bytes) for t in open_gguf(stage).tensors) for stage in stages]
    assert not held or held[1] - held[0] == cost.total == cost.nextn_bytes + cost.embedding_bytes
    assert (cost.embedding_bytes > 0) == (tiny.mtp_start > 0)  # glm4moe: a single stage holds them anyway
    assert mtp_cost(tiny.package, tiny.manifest, start=0) == replace(cost, embedding_bytes=0)
    assert mtp_cost(dense.package, dense.manifest) is None
    assert "MTP" in dict(describe(tiny.package))
    assert "MTP" not in dict(describe(dense.package))


def test_the_mtp_layers_travel_with_the_final_range_through_the_hub(tiny: Tiny, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Publish uploads them, a coordinator's download and a final range asked with `mtp` fetch
    them, and a range without `mtp` does not need them."""
    m, start, end = tiny.manifest, tiny.mtp_start, tiny.manifest.layer_count
    planned = {f.path for f in plan_publish(tiny.package, "org/tiny").artifacts}
    assert m.mtp_layers[0].path in planned
    hub_cache = use_hf_home(tmp_path / "hf", monkeypatch, offline=True)
    ref = parse_hub_ref("hf://org/tiny")
    add_files(hub_cache, "org/tiny", COMMIT, package_files(tiny.package, range(start, end)))
    assert hub.cached_range(ref, start, end, tiny.sha) is not None
    assert hub.cached_range(ref, start, end, tiny.sha, mtp=True) is None  # not in the cache yet
    add_files(hub_cache, "org/tiny", COMMIT, {m.mtp_layers[0].path: tiny.package / m.mtp_layers[0].path})
    pkg = hub.fetch_range(ref, start, end, tiny.sha, mtp=True)
    assert (pkg.root / m.mtp_layers[0].path).read_bytes() == (tiny.package / m.mtp_layers[0].path).read_bytes()
    with pytest.raises(PackageError, match="final stage only"):
        hub.fetch_range(ref, 0, tiny.cut, tiny.sha, mtp=True)
