"""How much decode work each layer of a package is, counted in parameters.

A CPU decode of a few rows costs about in proportion to the parameters it multiplies,
whatever their quantization: on SmolLM2-135M the output head (49152 x 576, 8 layers'
parameters) measured 8 layers' time. The planner uses this to give the final stage fewer
layers (mesh/planner.py).
"""

from __future__ import annotations

from pathlib import Path

from packages.gguf_files import open_gguf
from packages.manifest import Manifest


def layer_parameters(package_dir: Path, manifest: Manifest) -> tuple[list[float], float]:
    """(parameters of each layer, of the output head); the head is the token embeddings when
    the model ties them. Raises PackageError when an artifact cannot be read."""
    layers = [float(_parameters(package_dir / a.path)) for a in manifest.layers]
    head = 0.0
    for name, tensor in (("output", "output.weight"), ("embeddings", "token_embd.weight")):
        if name in manifest.shared:
            head = float(_parameters(package_dir / manifest.shared[name].path, tensor))
        if head:
            break
    return layers, head


def _parameters(path: Path, only: str | None = None) -> int:
    tensors = open_gguf(path).tensors  # a PackageError names the file
    return sum(int(t.n_elements) for t in tensors if only is None or t.name == only)
