"""Every llama.cpp load makes the same extra-buffer-type, flash-attention and KV cache choice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stage.llama_model as lm

# llama.cpp's load log when weights were repacked: into CPU_REPACK, or on a CPU with AMX
# (Sapphire Rapids and later) into AMX, which it prefers there
REPACKED = re.compile(r"(CPU_REPACK|AMX) model buffer size")


@pytest.mark.parametrize(("offered", "expected"), [(("AMX", "CPU_REPACK"), False), (("CPU_REPACK",), True), ((), True)])
def test_auto_turns_extra_buffer_types_off_only_where_amx_is_offered(monkeypatch, offered, expected):
    monkeypatch.delenv(lm.EXTRA_BUFTS_ENV, raising=False)
    monkeypatch.setattr(lm, "offered_extra_bufts", lambda: offered)
    assert lm.use_extra_bufts() is expected
    assert lm.model_params().use_extra_bufts is expected


def test_operators_override_both_choices(monkeypatch):
    monkeypatch.setattr(lm, "offered_extra_bufts", lambda: ("AMX",))
    monkeypatch.setenv(lm.EXTRA_BUFTS_ENV, "on")
    assert lm.use_extra_bufts()
    monkeypatch.setenv(lm.FLASH_ATTN_ENV, "off")
    assert not lm.flash_attn()
    monkeypatch.setenv(lm.EXTRA_BUFTS_ENV, "sometimes")
    with pytest.raises(lm.LoadSettingError, match="MESHPIPE_EXTRA_BUFTS='sometimes': choose auto, on or off"):
        lm.use_extra_bufts()


@pytest.mark.parametrize(("bufts", "env", "mapped"), [("on", None, False), ("off", None, True), ("on", "on", True),
                                                      ("off", "off", False)])
def test_models_are_mapped_unless_repacked(monkeypatch, bufts, env, mapped):
    """A repacked model would keep its mapped file resident beside the repacked copy."""
    monkeypatch.setenv(lm.EXTRA_BUFTS_ENV, bufts)
    if env is None:
        monkeypatch.delenv(lm.MMAP_ENV, raising=False)
    else:
        monkeypatch.setenv(lm.MMAP_ENV, env)
    assert lm.use_mmap() is mapped
    assert lm.model_params().load_mode == (lm.L.LLAMA_LOAD_MODE_MMAP if mapped else lm.L.LLAMA_LOAD_MODE_NONE)


def test_this_library_offers_its_extra_buffer_types():
    assert "CPU_REPACK" in lm.offered_extra_bufts()  # every x86/ARM CPU build has the repack type


_LOAD_BOTH_WAYS = """
import sys
from pathlib import Path
import stage.llama_model as lm
if sys.argv[2] == "amx":  # what the loaded library reports on a Sapphire Rapids host
    lm.offered_extra_bufts = lambda: ("AMX", "CPU_REPACK")
else:  # and elsewhere, whichever host runs the test
    lm.offered_extra_bufts = lambda: ("CPU_REPACK",)
from stage.llama_engine import EngineConfig, LlamaRangeEngine
gguf = Path(sys.argv[1])
print("== Llama", file=sys.stderr, flush=True)
lm.open_llama(gguf, verbose=True, n_ctx=64)
print("== engine", file=sys.stderr, flush=True)
LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=64), quiet=False)
"""


@pytest.mark.mesh  # loads the draft model in a subprocess; the tests above are unit-level
@pytest.mark.parametrize(("host", "env", "repacked"), [("amx", "auto", False), ("plain", "auto", True),
                                                         ("plain", "off", False), ("amx", "on", True)])
def test_the_choice_reaches_every_loader(draft_gguf: Path, host, env, repacked):
    """The high-level Llama (tokenizer, bench baseline, test references) and the range engine
    (stages, draft) both load the Q4_0 draft repacked, or both not, as the choice says."""
    done = subprocess.run([sys.executable, "-c", _LOAD_BOTH_WAYS, str(draft_gguf), host],
                          env={**_env(), lm.EXTRA_BUFTS_ENV: env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    llama_log, engine_log = done.stderr.split("== Llama", 1)[1].split("== engine", 1)
    assert bool(REPACKED.search(llama_log)) is repacked
    assert bool(REPACKED.search(engine_log)) is repacked
    for log in (llama_log, engine_log):  # mapped exactly when not repacked (MESHPIPE_MMAP unset)
        assert ("(load_mode = mmap)" in log) is not repacked, log[-2000:]
        assert re.search(r"K \(q8_0\): .*V \(f16\)", log), log[-2000:]  # the row-invariant cache


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MESHPIPE_")}


def test_the_kv_cache_setting_reads_a_type_or_a_pair(monkeypatch):
    monkeypatch.delenv(lm.KV_CACHE_ENV, raising=False)
    assert lm.kv_cache_setting() is None
    for value, pair in (("f16", ("f16", "f16")), ("q8_0/f16", ("q8_0", "f16")), (" BF16 ", ("bf16", "bf16"))):
        monkeypatch.setenv(lm.KV_CACHE_ENV, value)
        assert lm.kv_cache_setting() == pair
    monkeypatch.setenv(lm.KV_CACHE_ENV, "q4_0")
    with pytest.raises(lm.LoadSettingError, match="'q4_0': choose auto, or a type or K/V pair of f32, f16, q8_0, bf16"):
        lm.kv_cache_setting()


def _header(path: Path, arch: str, **lengths: int) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_embedding_length(1024)
    writer.add_head_count(8)
    for key, value in lengths.items():
        writer.add_uint32(f"{arch}.attention.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_auto_keeps_every_model_off_the_split_kv_path(monkeypatch, tmp_path):
    """q8_0 K beside f16 V; bf16 K where q8_0's block does not divide a head; K and V alike
    where llama.cpp refuses unlike types (MLA). Every one of them is row-invariant."""
    monkeypatch.delenv(lm.KV_CACHE_ENV, raising=False)
    monkeypatch.delenv(lm.FLASH_ATTN_ENV, raising=False)
    cases = {
        _header(tmp_path / "llama.gguf", "llama"): ("q8_0", "f16"),  # 1024 / 8 = 128
        _header(tmp_path / "odd.gguf", "llama", key_length=80, value_length=80): ("bf16", "f16"),
        _header(tmp_path / "mla.gguf", "deepseek2", key_length=192, value_length=128, key_length_mla=576):
            ("q8_0", "q8_0"),
        _header(tmp_path / "v4.gguf", "deepseek4", key_length=512): ("q8_0", "q8_0"),
    }
    for gguf, pair in cases.items():
        assert lm.kv_cache_for(gguf) == pair, gguf.name
        assert lm.kv_row_invariant(pair)
    monkeypatch.setenv(lm.KV_CACHE_ENV, "f16")
    assert lm.kv_cache_for(tmp_path / "llama.gguf") == lm.LLAMA_KV


def test_only_an_f16_cache_with_k_and_v_alike_or_flash_attention_off_is_row_dependent(monkeypatch):
    monkeypatch.delenv(lm.FLASH_ATTN_ENV, raising=False)
    assert not lm.kv_row_invariant(("f16", "f16"))
    assert not lm.kv_row_invariant(("f32", "f32"))
    assert lm.kv_row_invariant(("q8_0", "f16"))
    assert lm.kv_row_invariant(("bf16", "bf16"))
    monkeypatch.setenv(lm.FLASH_ATTN_ENV, "off")
    assert not lm.kv_row_invariant(("q8_0", "f16"))


def test_mesh_serve_states_the_promise_its_settings_keep(monkeypatch):
    monkeypatch.delenv(lm.KV_CACHE_ENV, raising=False)
    monkeypatch.delenv(lm.FLASH_ATTN_ENV, raising=False)
    assert "equals --no-draft bit for bit" in lm.numerics_promise(2)
    assert "MLX stages" in lm.numerics_promise(2, ("llama", "mlx"))
    monkeypatch.setenv(lm.KV_CACHE_ENV, "f16")
    assert "bit for bit" in lm.numerics_promise(1)  # one thread: the split path has one part
    assert lm.numerics_promise(2).startswith("WARNING: the f16 KV cache splits a one-row decode's attention")
    monkeypatch.setenv(lm.FLASH_ATTN_ENV, "off")
    assert lm.numerics_promise(1).startswith("WARNING: flash attention is off")
