"""Which range engine a stage runs (`--engine auto|llama|mlx`), and opening it.

`auto` is MLX on Apple silicon with `mlx` installed, where it is the fast path, and
llama.cpp everywhere else: on a Linux CPU MLX decodes many times slower than llama.cpp
(BENCHMARKS.md, "Figures behind the code's choices"), so there it is for tests and mixed meshes, never a default.
Both engines take the same stage GGUF and speak the same wire format, so one mesh may mix them.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from config.errors import MeshpipeError
from stage.engine import EngineConfig, RangeEngine
from stage.mlx_tensors import MLX_GGUF_TYPES

Engine = Literal["llama", "mlx"]  # an engine's name; what it is, is its EngineKind


@dataclass(frozen=True)
class EngineKind:
    """Everything outside an engine's own module needs to know of it, so that no other module
    compares engine names (tests/test_engine_kinds.py holds that)."""

    name: Engine
    label: str  # how messages name it
    # A KV element, as the planner's fit check (mesh/routing/stage_fit.py) and a stage's own
    # memory check (stage/hosted.py) count it: MLX's f32; llama.cpp's the most its cache types
    # take (stage.llama_model: f16, or a bf16 K), though the default q8_0 K beside an f16 V
    # averages 1.53, so the fit check errs safe.
    kv_bytes: int
    # The engine's own: library, compute buffers, MLX's buffer cache. RSS growth past weights +
    # KV, SmolLM2 with every lane filled (DESIGN.md §3): llama.cpp -9..+17 MiB, MLX +43..+49 MiB.
    overhead: int
    # Its loader requires tensors a stage never reads (llama.cpp): the stage GGUF holds zeros for
    # them (packages/materialize.py).
    placeholders: bool
    # The GGUF tensor types it reads; () for every type (llama.cpp).
    reads: tuple[str, ...]
    # How it computes a verify window's rows against plain decoding, added to mesh serve's
    # numerics line when a stage runs it ("" where stage.llama_model's promise says it all).
    numerics: str
    # Where its RangeEngine class is, imported only when opened: a llama.cpp stage never imports
    # mlx, and an MLX one never loads llama.cpp's library.
    module: str
    factory: str
    needs: str = ""  # a package it needs that meshpipe's own install leaves out

    def unreadable(self, tensors: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
        """The first (tensor, GGUF type) it cannot read, if any."""
        return next(((name, t) for name, t in tensors if self.reads and t not in self.reads), None)

    def install(self) -> str:
        """How to add what it needs (`needs`) to meshpipe's install."""
        return f"pip install 'meshpipe[{self.needs}]'"

    def open(self, gguf: Path, cfg: EngineConfig) -> RangeEngine:
        engine: RangeEngine = getattr(importlib.import_module(self.module), self.factory)(gguf, cfg)
        return engine


LLAMA = EngineKind("llama", "llama.cpp", kv_bytes=2, overhead=32 << 20, placeholders=True, reads=(),
                   numerics="", module="stage.llama_engine", factory="LlamaRangeEngine")
MLX = EngineKind("mlx", "MLX", kv_bytes=4, overhead=64 << 20, placeholders=False, reads=MLX_GGUF_TYPES,
                 numerics="MLX stages compute a window's rows as row by row too (mlx[cpu] measured past 512 "
                          "positions; Metal not measured)", module="stage.mlx_engine", factory="MlxRangeEngine",
                 needs="mlx")
ENGINES: dict[str, EngineKind] = {k.name: k for k in (LLAMA, MLX)}
ENGINE_CHOICES = ("auto", *ENGINES)
MLX_INSTALL = MLX.install()


def engine_kind(name: str | None) -> EngineKind:
    """The engine a name says; None or "" (a stage that has not yet answered Status, or one older
    than engine names in Status) is llama.cpp, which every stage ran before MLX; EngineChoiceError
    for a name this version does not know."""
    if not name:
        return LLAMA
    if name not in ENGINES:
        raise EngineChoiceError(f"unknown engine {name!r}: this meshpipe knows {', '.join(ENGINES)}")
    return ENGINES[name]


class EngineChoiceError(MeshpipeError):
    """An engine name that is unknown, or one this machine cannot run."""


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def mlx_installed() -> bool:
    return package_installed(MLX.needs)


def resolve(choice: str) -> Engine:
    """The engine `choice` names on this machine; EngineChoiceError when it cannot run here,
    so a stage refuses at start and not at its first Load."""
    if choice == "auto":
        return MLX.name if apple_silicon() and mlx_installed() else LLAMA.name
    if choice not in ENGINES:
        raise EngineChoiceError(f"unknown engine {choice!r}: choose one of {', '.join(ENGINE_CHOICES)}")
    kind = ENGINES[choice]
    if kind.needs and not package_installed(kind.needs):
        raise EngineChoiceError(f"--engine {choice} needs the {kind.needs} package: {kind.install()}")
    return kind.name


def open_engine(engine: Engine, gguf: Path, cfg: EngineConfig) -> RangeEngine:
    """Load layers of `gguf` on `engine`."""
    return engine_kind(engine).open(gguf, cfg)
