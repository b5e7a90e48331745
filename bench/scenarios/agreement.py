"""`mesh bench --scenarios agreement`: how often would a cheaper proposer name the target's token?

Issue 26 asked for two proposers to be measured before either is built: a draft's top-2 as
extra rows at uncertain positions, and a self-speculative draft (the target's own first
layers and its head). Both are settled by one teacher-forced pass: the target decodes
greedily one row at a time; the package's drafts are fed the same tokens; and at every
generated position the target's residual after each layer (llama.cpp's `l_out-i` nodes,
read by an eval callback) goes through the target's final norm and head in numpy. The rate
of each is how often its top-1 (and its top 2) hold the target's token. An exit after all
the layers is the method's own check: it must agree at about 1.0, short of it only where
numpy's float32 head and llama.cpp's quantized one break a near tie differently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from bench.harness.harness import Asked, Outcome, Row, Setup
from mesh.model.tokenizer import Tokenizer
from packages.speculative import declared, verify_draft
from stage.engine import EngineConfig, Step
from stage.ggml_lib import ggml
from stage.llama_engine import LlamaRangeEngine


@dataclass(frozen=True)
class Rates:
    top1: float  # the proposer's first choice is the target's token
    top2: float  # the target's token is among its first two


@dataclass(frozen=True)
class Agreement:
    positions: int
    drafts: Mapping[str, Rates]
    exits: Mapping[int, Rates]  # layers run -> rates of their early exit
    exit_cost: Mapping[int, float]  # layers run -> share of the target's multiply-adds a token


class Head:
    """The target's final RMS norm and output head, dequantized once to float32."""

    def __init__(self, reader: GGUFReader) -> None:
        tensors = {t.name: t for t in reader.tensors}
        self.norm = _weights(tensors["output_norm.weight"]).reshape(-1)
        self.head = _weights(tensors[head_name(tensors)]).reshape(-1, self.norm.shape[0])
        self.eps = _arch_scalar(reader, "attention.layer_norm_rms_epsilon")

    def logits(self, residual: np.ndarray) -> np.ndarray:
        x = residual / np.sqrt(np.mean(residual * residual) + self.eps) * self.norm
        return self.head @ x


def head_name(tensors: Mapping[str, object]) -> str:
    """The output head's tensor: its own, or the token embedding where it is tied (SmolLM2)."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def shown_exits(n_layer: int) -> list[int]:
    """The exits the table shows: after every sixth of the layers, the last but one and all."""
    step = max(1, n_layer // 6)
    return sorted({*range(step, n_layer, step), max(1, n_layer - 1), n_layer})


class LayerOutputs:
    """An eval callback that keeps the last row of the output of each of `layers` (0-based)
    of one decode. Only those are asked for: ggml stops the graph at every node asked."""

    def __init__(self, width: int, layers: Collection[int]) -> None:
        self.width = width
        self.rows: dict[int, np.ndarray] = {}

        def on_eval(tensor: int, ask: bool, _user: int) -> bool:
            name = ggml.lib.ggml_get_name(tensor)
            if not name.startswith(b"l_out-") or int(name[len(b"l_out-"):]) not in layers:
                return not ask  # not wanted; asked about nothing, so never here when computed
            if not ask:
                self.rows[int(name[len(b"l_out-"):])] = ggml.rows(tensor, self.width)[-1]
            return True  # go on: the graph must finish for the target's own logits

        self.callback = ggml.callback_type(on_eval)  # llama.cpp holds only the pointer


def measure(target: Path, drafts: Mapping[str, Path], prompts: list[list[int]], tokens: int,
            threads: int) -> Agreement:
    """Greedy target tokens after each prompt, and who else would have proposed them: the
    drafts, and the exits `shown_exits` names: each exit is a product with the whole head at
    every position, so exits the table does not show are not computed."""
    reader = GGUFReader(target)
    head = Head(reader)
    n_layer = int(_arch_scalar(reader, "block_count"))
    exits = shown_exits(n_layer)
    taps = LayerOutputs(head.norm.shape[0], {layers - 1 for layers in exits})
    ctx = max(len(p) for p in prompts) + tokens + 8
    cfg = EngineConfig(first=True, final=True, lanes=1, ctx_per_lane=ctx, threads=threads)
    engines = [LlamaRangeEngine(target, cfg, observe=taps.callback)]
    engines += [LlamaRangeEngine(path, cfg) for path in drafts.values()]
    counts = np.zeros((len(drafts) + len(exits), 2), dtype=np.int64)
    try:
        for prompt in prompts:
            _follow(engines, taps, head, exits, prompt, tokens, counts)
    finally:
        for engine in engines:
            engine.close()
    positions = len(prompts) * tokens
    rates = [Rates(float(c[0]) / positions, float(c[1]) / positions) for c in counts]
    return Agreement(positions, MappingProxyType(dict(zip(drafts, rates[:len(drafts)], strict=True))),
                     MappingProxyType(dict(zip(exits, rates[len(drafts):], strict=True))),
                     MappingProxyType(_exit_cost(reader, n_layer)))


def agreement_rows(setup: Setup, prompts: list[str]) -> list[Row]:
    """The package's in-package drafts and the target's early exits, over the built-in prompts."""
    _, strategies = declared(setup.manifest.generation)
    drafts = {s.name: verify_draft(setup.package, s) for s in strategies.values() if s.in_package}
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    chats = [tokenizer.tokenize(tokenizer.render_chat([{"role": "user", "content": p}])) for p in prompts]
    return rows_of(measure(setup.gguf, drafts, chats, setup.tokens, setup.threads))


def rows_of(a: Agreement) -> list[Row]:
    """Each draft, and each exit measured."""
    rows = []
    for name, r in a.drafts.items():
        rows += _rates_rows(f"agreement draft {name}", r)
    n_layer = max(a.exits)
    for layers in sorted(a.exits):
        check = " (all layers: the method's check)" if layers == n_layer else ""
        rows += _rates_rows(f"agreement exit after {layers} layers, {a.exit_cost[layers]:.2f} of the "
                            f"target's multiply-adds{check}", a.exits[layers])
    return [*rows, Row("agreement", "positions, greedy target tokens", a.positions)]


def _rates_rows(scenario: str, r: Rates) -> list[Row]:
    return [Row(scenario, "top-1 is the target's token", r.top1),
            Row(scenario, "top-2 holds it where top-1 missed", _second(r))]


def _second(r: Rates) -> float:
    return (r.top2 - r.top1) / (1 - r.top1) if r.top1 < 1 else 0.0


def _follow(engines: list[LlamaRangeEngine], taps: LayerOutputs, head: Head, exits: list[int],
            prompt: list[int], tokens: int, counts: np.ndarray) -> None:
    """One prompt: every engine fed the target's greedy tokens; `counts` rows are drafts, then
    `exits` (layers run: the output of layer L - 1)."""
    last = [e.step([Step(lane=0, start=0, tokens=np.asarray(prompt, dtype=np.int32))])[0][-1] for e in engines]
    for position in range(len(prompt), len(prompt) + tokens):
        token = np.asarray([int(np.argmax(last[0]))], dtype=np.int32)
        last = [e.step([Step(lane=0, start=position, tokens=token)])[0][-1] for e in engines]
        wanted = int(np.argmax(last[0]))
        guesses = [*last[1:], *(head.logits(taps.rows[layers - 1]) for layers in exits)]
        for row, logits in zip(counts, guesses, strict=True):
            row += (int(np.argmax(logits)) == wanted, wanted in np.argpartition(logits, -2)[-2:])


def _exit_cost(reader: GGUFReader, n_layer: int) -> dict[int, float]:
    """Multiply-adds of the first L layers and the head, as a share of the whole target's.

    A matrix's multiply-adds a token are its elements; the token embedding is a lookup and
    counts only when it doubles as the head.
    """
    sizes = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) > 1}
    head = sizes[head_name(sizes)]
    layer = [sum(v for k, v in sizes.items() if k.startswith(f"blk.{i}.")) for i in range(n_layer)]
    whole = sum(layer) + head
    return {n: (sum(layer[:n]) + head) / whole for n in range(1, n_layer + 1)}


def _arch_scalar(reader: GGUFReader, name: str) -> float:
    """A number the target's metadata keys by its architecture, as `llama.block_count`."""
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return float(reader.fields[f"{arch}.{name}"].parts[-1][0])


def _weights(tensor: object) -> np.ndarray:
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # type: ignore[attr-defined]


def run(asked: Asked) -> Outcome:
    return Outcome(agreement_rows(asked.setup, asked.prompts))
