"""`mesh bench --scenarios numerics`: is a verify window computed as plain decoding computes it?

For each model and kernel setting (flash attention, the KV cache's types), one lane decodes
a window of rows in one pass and another lane decodes the same rows one at a time, both
after the same prefill past 512 KV cells, where llama.cpp's f16 cache splits a one-row
decode's attention across threads. The largest logit difference says whether speculation can
change greedy output (0 means bit for bit). Where they differ, the comparison runs again with
every graph node recorded, and the first node where some row differs names the kernel
responsible. Decode cost is timed at 1, 5 and 9 rows. Logits and timings come from an engine
without the recorder: asking for every node makes ggml compute the graph node by node,
unfused and slower. Last, one-row decode speed at long contexts, the project's cache against
llama.cpp's default, interleaved (issue 52's cost).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from bench.harness.harness import Asked, Outcome, Row, Setup
from bench.harness.prompts import PROMPTS
from mesh.model.tokenizer import Tokenizer
from packages.speculative import declared, verify_draft
from stage.engine import Step
from stage.ggml_lib import ggml
from stage.llama_engine import EngineConfig, LlamaRangeEngine, set_threads
from stage.llama_model import LLAMA_KV, KvCache, kv_cache_for

POSITION = 700  # where the window starts: past 512 cells (a lane's KV view is padded to 256)
WINDOW = 9
TIMED_ROWS = (1, 5, 9)
CONTEXTS = (512, 2048, 8192)  # one-row decode speed at these positions
SPEED_REPEATS = 15


@dataclass(frozen=True)
class Numerics:
    model: str
    flash_attn: bool
    kv: KvCache
    max_diff: float  # largest |batched - single| logit over the window's rows
    row0_diff: float  # the same, row 0 only
    first_node: str  # the first graph node where some row differs, "" when none does
    decode_ms: Mapping[int, float]  # rows -> median ms of one decode at POSITION


def measure(name: str, gguf: Path, tokens: list[int], threads: int, setting: tuple[bool, KvCache],
            repeats: int = 15) -> Numerics:
    """Window-versus-rows logits and decode cost for one model and setting (flash attention, KV types)."""
    need = POSITION + WINDOW
    if len(tokens) < need:
        raise ValueError(f"numerics needs {need} tokens of text, got {len(tokens)}")
    ids = np.asarray(tokens[:need], dtype=np.int32)
    flash, kv = setting
    cfg = EngineConfig(first=True, final=True, lanes=2, ctx_per_lane=need + 8, threads=threads, flash_attn=flash,
                       kv_cache=kv)
    engine = LlamaRangeEngine(gguf, cfg)
    try:
        batched, single = _window_and_rows(engine, ids)
        timed = {rows: _time(engine, ids, rows, repeats) for rows in TIMED_ROWS}
    finally:
        engine.close()
    diff = np.abs(batched - single)
    first_node = _first_differing_node(gguf, cfg, ids) if diff.max() > 0 else ""
    return Numerics(name, flash, kv, float(diff.max()), float(diff[0].max()), first_node, MappingProxyType(timed))


def _window_and_rows(engine: LlamaRangeEngine, ids: np.ndarray, recorder: NodeRecorder | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Logits of the window in one decode (lane 0) and row by row (lane 1), after one prefill."""
    record = recorder.recording if recorder else _not_recording
    for lane in (0, 1):
        engine.step([Step(lane, 0, tokens=ids[:POSITION])])
    with record("window"):
        batched = engine.step([Step(0, POSITION, tokens=ids[POSITION:], all_logits=True)])[0]
    rows = []
    for i in range(WINDOW):
        with record(f"row {i}"):
            rows.append(engine.step([Step(1, POSITION + i, tokens=ids[POSITION + i : POSITION + i + 1])])[0][0])
    return batched, np.stack(rows)


def _first_differing_node(gguf: Path, cfg: EngineConfig, ids: np.ndarray) -> str:
    recorder = NodeRecorder()
    engine = LlamaRangeEngine(gguf, cfg, observe=recorder.callback)
    try:
        _window_and_rows(engine, ids, recorder)
    finally:
        engine.close()
    return first_differing_node(recorder.runs["window"], [recorder.runs[f"row {i}"] for i in range(WINDOW)])


@contextmanager
def _not_recording(_: str) -> Iterator[None]:
    yield


def _time(engine: LlamaRangeEngine, ids: np.ndarray, rows: int, repeats: int) -> float:
    window = ids[POSITION : POSITION + rows]
    samples = []
    for _ in range(repeats):
        engine.trim(0, POSITION)
        began = time.perf_counter()
        engine.step([Step(0, POSITION, tokens=window, all_logits=True)])
        samples.append((time.perf_counter() - began) * 1e3)
    return statistics.median(samples)


# -- which kernel: compare every node, row by row -------------------------------------------------

@dataclass(frozen=True)
class Node:
    name: str
    op: str
    ne: tuple[int, int, int, int]
    data: np.ndarray | None  # f32 contents of contiguous nodes


class _Tensor(ctypes.Structure):
    # The head of ggml's struct ggml_tensor, stable across ggml versions.
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10)]


class NodeRecorder:
    """A ggml eval callback that, while recording a named run, copies out every graph node."""

    def __init__(self) -> None:
        self.runs: dict[str, list[Node]] = {}
        self.nodes: list[Node] | None = None

        def on_eval(tensor: int, ask: bool, _user: int) -> bool:
            if self.nodes is not None and not ask:
                self.nodes.append(_read(tensor))
            return self.nodes is not None  # not recording: let ggml compute the graph in one go

        self.callback = ggml.callback_type(on_eval)

    @contextmanager
    def recording(self, run: str) -> Iterator[None]:
        self.nodes = self.runs[run] = []
        try:
            yield
        finally:
            self.nodes = None


def _read(tensor: int) -> Node:
    head = _Tensor.from_address(tensor)
    ne = tuple(int(n) for n in head.ne)
    contiguous = head.type == 0 and head.nb[0] == 4 and all(
        head.nb[i] == head.nb[i - 1] * ne[i - 1] for i in range(1, 4))
    data = None
    if contiguous:
        data = np.empty(int(np.prod(ne)), dtype=np.float32)
        ggml.lib.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
    # "MUL_MAT of blk.0.ffn_up.weight (q5_0)": the inputs say which kernel ran
    sources = [f"{ggml.name(src) or '?'} ({ggml.type_name(src)})" for src in head.src[:2] if src]
    op = f"{ggml.op(tensor)} of {' x '.join(sources)}" if sources else ggml.op(tensor)
    return Node(ggml.name(tensor), op, ne, data)  # type: ignore[arg-type]


def first_differing_node(batched: list[Node], singles: list[list[Node]]) -> str:
    """'name (op), row r' of the first node, in graph order, where some row's values differ."""
    keyed = [dict(_keyed(nodes)) for nodes in singles]
    for key, b in _keyed(batched):
        for r, single in enumerate(keyed):
            s = single.get(key)
            if s is None or b.data is None or s.data is None:
                continue
            row = _row(b, s, len(singles), r)
            if row is not None and not np.array_equal(row.ravel(), s.data):
                return f"{b.name}: {b.op}, row {r}"
    return ""


def _keyed(nodes: list[Node]) -> Iterator[tuple[tuple[str, str, int], Node]]:
    """Nodes keyed by (name, op, occurrence): in-place ops reuse their input's name."""
    seen: dict[tuple[str, str], int] = {}
    for n in nodes:
        k = seen[(n.name, n.op)] = seen.get((n.name, n.op), -1) + 1
        yield (n.name, n.op, k), n


def _row(node: Node, single: Node, rows: int, r: int) -> np.ndarray | None:
    """Row r's values: the slice at index r of the one axis that holds `rows` tokens."""
    assert node.data is not None
    axes = [d for d in range(4) if node.ne[d] == rows and single.ne[d] == 1
            and all(node.ne[e] == single.ne[e] for e in range(4) if e != d)]
    if not axes:
        return None
    grid = node.data.reshape(node.ne[::-1])  # numpy order: ne3, ne2, ne1, ne0
    return np.take(grid, r, axis=3 - axes[-1])


def run(asked: Asked) -> Outcome:
    return Outcome(numerics_rows(asked.setup, asked.args.numerics_gguf))


def numerics_rows(setup: Setup, extra: list[Path]) -> list[Row]:
    """The package's target and in-package drafts, and any GGUF given: the project's kernels,
    then llama.cpp's default cache, then flash attention off; and the target's decode speed."""
    models = [(f"{setup.model_id} {setup.quant}", setup.gguf)]
    _, strategies = declared(setup.manifest.generation)
    models += [(f"draft {s.name}", verify_draft(setup.package, s)) for s in strategies.values() if s.in_package]
    models += [(gguf.stem, gguf) for gguf in extra]
    text = " ".join(PROMPTS * 16)
    rows = []
    tokenized = {gguf: Tokenizer(gguf, name).tokenize(text, False) for name, gguf in models}
    for name, gguf in models:
        for setting in ((True, kv_cache_for(gguf)), (True, LLAMA_KV), (False, LLAMA_KV)):
            rows += _window_rows(measure(name, gguf, tokenized[gguf], setup.threads, setting))
    return rows + speed_rows(models[0][0], setup.gguf, tokenized[setup.gguf], setup.threads)


def _setting(flash: bool, kv: KvCache) -> str:
    return f"flash attn {'on' if flash else 'off'}, {'/'.join(kv)} KV"


def _window_rows(n: Numerics) -> list[Row]:
    label = _setting(n.flash_attn, n.kv)
    culprit = f"; first differing node {n.first_node}" if n.first_node else ""
    rows = [Row(f"numerics {n.model}", f"{label}: max logit diff, {WINDOW}-row window vs row by row at "
                                       f"position {POSITION}{culprit}", n.max_diff),
            Row(f"numerics {n.model}", f"{label}: max logit diff, row 0", n.row0_diff)]
    return rows + [Row(f"numerics {n.model}", f"{label}: ms per decode of {k} rows at position {POSITION}", ms)
                   for k, ms in n.decode_ms.items()]


def speed_rows(name: str, gguf: Path, tokens: list[int], threads: int) -> list[Row]:
    """One-row decode tok/s at each of CONTEXTS, the project's cache against llama.cpp's default,
    at one thread and at `threads`: both engines loaded, their decodes interleaved."""
    ids = np.resize(np.asarray(tokens, dtype=np.int32), CONTEXTS[-1] + 1)
    kvs = {"project": kv_cache_for(gguf), "llama.cpp default": LLAMA_KV}
    engines = {k: LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=CONTEXTS[-1] + 8,
                                                      threads=threads, batch=48, kv_cache=kv)) for k, kv in kvs.items()}
    rows, done = [], 0
    try:
        for context in CONTEXTS:
            for e in engines.values():
                e.step([Step(0, done, tokens=ids[done:context])])
            done = context
            for t in sorted({1, threads}):
                rates = _interleaved_rates(engines, ids, context, t)
                rows += [Row(f"numerics {name}", f"tok/s of one-row decodes at {context} tokens, {t} thread(s), "
                                                 f"{'/'.join(kvs[k])} KV ({k})", rate) for k, rate in rates.items()]
                rows.append(Row(f"numerics {name}", f"project ÷ llama.cpp default at {context} tokens, {t} thread(s)",
                                rates["project"] / rates["llama.cpp default"]))
    finally:
        for e in engines.values():
            e.close()
    return rows


def _interleaved_rates(engines: dict[str, LlamaRangeEngine], ids: np.ndarray, at: int, threads: int
                       ) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in engines}
    for e in engines.values():
        set_threads(e, threads)
    for _ in range(SPEED_REPEATS):
        for k, e in engines.items():
            began = time.perf_counter()
            e.step([Step(0, at, tokens=ids[at : at + 1])])
            samples[k].append(time.perf_counter() - began)
            e.trim(0, at)
    return {k: 1 / statistics.median(v) for k, v in samples.items()}
