"""Which range engine a stage runs (`--engine auto|llama|mlx`), and opening it.

`auto` is MLX on Apple silicon with `mlx` installed, where it is the fast path, and
llama.cpp everywhere else: on a Linux CPU MLX decodes SmolLM2 at 7.4 tok/s against
llama.cpp's 120 (DESIGN.md §3), so there it is for tests and mixed meshes, never a default.
Both engines take the same stage GGUF and speak the same wire format, so one mesh may mix them.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path
from typing import Literal

from config.errors import MeshpipeError
from stage.engine import EngineConfig, RangeEngine

Engine = Literal["llama", "mlx"]
ENGINE_CHOICES = ("auto", "llama", "mlx")
# What a range costs each engine besides its weights, as the planner's fit check
# (mesh/routing/stage_fit.py) and a stage's own memory check (stage/hosted.py) count it:
# A KV element: MLX's f32; llama.cpp's the most its cache types take (stage.llama_model: f16, or
# a bf16 K), though the default q8_0 K beside an f16 V averages 1.53, so the fit check errs safe.
KV_BYTES: dict[Engine, int] = {"llama": 2, "mlx": 4}
# The engine's own: library, compute buffers, MLX's buffer cache. RSS growth past weights + KV,
# SmolLM2 with every lane filled (DESIGN.md §3): llama.cpp -9..+17 MiB, MLX +43..+49 MiB.
OVERHEAD: dict[Engine, int] = {"llama": 32 << 20, "mlx": 64 << 20}
MLX_INSTALL = "pip install 'meshpipe[mlx]'"


class EngineChoiceError(MeshpipeError):
    """An engine name that is unknown, or one this machine cannot run."""


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_installed() -> bool:
    return importlib.util.find_spec("mlx") is not None


def resolve(choice: str) -> Engine:
    """The engine `choice` names on this machine; EngineChoiceError when it cannot run here,
    so a stage refuses at start and not at its first Load."""
    if choice == "auto":
        return "mlx" if apple_silicon() and mlx_installed() else "llama"
    if choice == "llama":
        return "llama"
    if choice == "mlx":
        if not mlx_installed():
            raise EngineChoiceError(f"--engine mlx needs the mlx package: {MLX_INSTALL}")
        return "mlx"
    raise EngineChoiceError(f"unknown engine {choice!r}: choose one of {', '.join(ENGINE_CHOICES)}")


def open_engine(engine: Engine, gguf: Path, cfg: EngineConfig) -> RangeEngine:
    """Load layers of `gguf` on `engine`; the import is here so that a llama.cpp stage never
    imports mlx, and an MLX one never loads llama.cpp's library."""
    if engine == "mlx":
        from stage.mlx_engine import MlxRangeEngine

        return MlxRangeEngine(gguf, cfg)
    from stage.llama_engine import LlamaRangeEngine

    return LlamaRangeEngine(gguf, cfg)
