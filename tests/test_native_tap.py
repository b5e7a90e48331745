"""The hidden-state tap in C gives the rows the Python tap gives, bit for bit, and a machine
without a C compiler keeps the Python tap (stage/native_tap.py)."""

from __future__ import annotations

import numpy as np
import pytest

from packages.materialize import materialize_stage
from packages.validate import validate_package
from stage import llama_engine, native_tap
from stage.engine import EngineConfig, Step
from stage.hidden_tap import HiddenTap


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """No tap built yet, in this process or on disk."""
    monkeypatch.setenv("MESHPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_tap, "_loaded", [])


@pytest.mark.mesh  # compiles the tap: a process
def test_the_c_tap_gives_the_python_taps_rows(smollm2_package, tmp_path, fresh_cache, monkeypatch):
    manifest, sha = validate_package(smollm2_package)
    stage = materialize_stage(smollm2_package, manifest, sha, 0, 15, tmp_path)
    cfg = EngineConfig(first=True, final=False, lanes=2, ctx_per_lane=512, threads=1)
    native = llama_engine.LlamaRangeEngine(stage, cfg)
    monkeypatch.setattr(llama_engine, "open_tap", lambda last, width, rows: HiddenTap(last, width))
    python = llama_engine.LlamaRangeEngine(stage, cfg)
    try:
        assert isinstance(native.tap, native_tap.NativeTap)
        assert isinstance(python.tap, HiddenTap)
        tokens = np.arange(200, 400, dtype=np.int32)
        start = 0
        for rows in (100, 1, 2, 5, 1):  # a 100-row prefill runs as several ubatches
            step = Step(0, start, tokens=tokens[start : start + rows])
            a, b = native.step([step])[0], python.step([step])[0]
            assert a.shape == (rows, native.width)
            assert np.array_equal(a, b), rows
            start += rows
    finally:
        native.close()
        python.close()


def test_without_a_c_compiler_the_python_tap_serves(fresh_cache, monkeypatch, capsys):
    monkeypatch.setattr(native_tap.shutil, "which", lambda name: None)
    tap = native_tap.open_tap("l_out-14", 576, 32)
    assert isinstance(tap, HiddenTap)
    assert tap.user is None


def test_a_decode_that_failed_partway_leaves_no_rows_for_the_next(tiny_package, tmp_path, monkeypatch):
    """A decode runs in ubatches, each tapped as it ends: one that fails after some of them
    had left their rows in the tap, and the next decode, maybe on another lane, was handed
    them before its own (stage/llama_engine.py clears the tap before each decode)."""
    manifest, sha = validate_package(tiny_package)
    stage = materialize_stage(tiny_package, manifest, sha, 0, 2, tmp_path)
    monkeypatch.setattr(llama_engine, "open_tap", lambda last, width, rows: HiddenTap(last, width))
    engine = llama_engine.LlamaRangeEngine(stage, EngineConfig(first=True, final=False, lanes=2, ctx_per_lane=64))
    real = llama_engine.L.llama_decode
    try:
        step = Step(1, 0, tokens=np.arange(3, 8, dtype=np.int32))
        clean = engine.step([step])[0]
        # the graph ran and the tap took its rows; then llama.cpp reports a failure
        monkeypatch.setattr(llama_engine.L, "llama_decode", lambda ctx, batch: real(ctx, batch) or 1)
        with pytest.raises(Exception, match="llama_decode failed"):
            engine.step([Step(0, 0, tokens=np.arange(10, 14, dtype=np.int32))])
        monkeypatch.setattr(llama_engine.L, "llama_decode", real)
        again = engine.step([step])[0]
        assert again.shape == clean.shape
        assert np.array_equal(again, clean)
    finally:
        engine.close()
