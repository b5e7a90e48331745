"""The error a range engine raises, caught on both sides: by the stages that run engines and by
stage 0 (mesh/), which runs its own range in-process and must tell a refused step from a bug."""

from __future__ import annotations

from config.errors import MeshpipeError


class EngineError(MeshpipeError):
    """A request the engine cannot run (bad lane, position, shape, or a decode failure)."""
