"""How much memory and decode work each layer of a package is, counted in parameters.

A CPU decode of a few rows costs about in proportion to the parameters it multiplies,
whatever their quantization: on SmolLM2-135M the output head (49152 x 576, 8 layers'
parameters) measured 8 layers' time. The planner uses this to give the final stage fewer
layers (mesh/routing/planner.py).

A mixture-of-experts layer holds every expert but a decode row multiplies only the ones its
router picks: of an expert tensor (`ffn_{gate,up,down,gate_up}_exps`, GroveMoE's `_chexps`,
their biases) `expert_used_count` of its experts are active. The router (`ffn_gate_inp`) and
shared experts (`_shexp`) always are. So each layer has two figures: total parameters, which
a stage holds, and active ones, which a decode costs. A dense layer's are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import TENSOR_NAMES

from packages.gguf_files import open_gguf
from packages.gguf_infos import TensorInfo
from packages.manifest import Manifest

# Per-expert tensors, by the name after `blk.N.`: gguf.constants' `..._exps` and `..._chexps`.
# Arctic's `ffn_norm_exps` is one norm vector, not one per expert.
EXPERT_TENSORS = frozenset(
    name.split(".", 2)[2] for name in TENSOR_NAMES.values()
    if name.startswith("blk.") and name.endswith("exps") and "norm" not in name
)


@dataclass(frozen=True)
class LayerParameters:
    """Each layer's parameters: `total` (what a stage holds), `active` (what a decode
    multiplies); and the output head's (the token embeddings when the model ties them)."""

    total: tuple[float, ...]
    active: tuple[float, ...]
    head: float


def package_parameters(package_dir: Path, manifest: Manifest) -> LayerParameters:
    """Raises PackageError when an artifact cannot be read."""
    used = _experts_used(package_dir, manifest)
    layers = [[TensorInfo.of(t) for t in open_gguf(package_dir / a.path).tensors] for a in manifest.layers]
    head = 0.0
    for name, tensor in (("output", "output.weight"), ("embeddings", "token_embd.weight")):
        if name in manifest.shared:
            head = float(_parameters(package_dir / manifest.shared[name].path, tensor))
        if head:
            break
    return parameters_of(layers, used, head)


def parameters_of(layers: Sequence[Sequence[TensorInfo]], used: Sequence[int] | None, head: float) -> LayerParameters:
    """From each layer's tensor infos (a package's or a GGUF header's, for `mesh plan`) and
    `expert_used_count` per layer (None: dense)."""
    counted = [_layer(tensors, used[i] if used else None) for i, tensors in enumerate(layers)]
    return LayerParameters(tuple(float(t) for t, _ in counted), tuple(a for _, a in counted), head)


def layer_parameters(package_dir: Path, manifest: Manifest) -> tuple[list[float], float]:
    """(the decode work of each layer in active parameters, of the output head). Raises
    PackageError when an artifact cannot be read."""
    p = package_parameters(package_dir, manifest)
    return list(p.active), p.head


def _experts_used(package_dir: Path, manifest: Manifest) -> list[int] | None:
    """`{arch}.expert_used_count` per layer (a scalar repeated, or the per-layer array);
    None for a dense model or a package without shared metadata."""
    if "metadata" not in manifest.shared:
        return None
    field = open_gguf(package_dir / manifest.shared["metadata"].path).fields.get(
        f"{manifest.architecture}.expert_used_count")
    return used_per_layer(field.contents() if field is not None else None, manifest.layer_count)


def used_per_layer(value: Any, layer_count: int) -> list[int] | None:
    """`expert_used_count`'s value (a scalar, or one per layer) for each of the layers; None
    without one (a dense model)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [int(v) for v in value[:layer_count]]
    return [int(value)] * layer_count


def _layer(tensors: Iterable[TensorInfo], used: int | None) -> tuple[int, float]:
    """(all parameters, active ones) of one layer's tensors. An expert tensor's expert axis is
    its last (ggml order), `{arch}.expert_count` long for `_exps`."""
    total, active = 0, 0.0
    for t in tensors:
        n = t.n_elements
        total += n
        parts = t.name.split(".")
        experts = int(t.shape[-1]) if len(parts) > 3 and parts[2] in EXPERT_TENSORS else 0
        active += n * min(used, experts) / experts if used is not None and experts else n
    return total, active


def _parameters(path: Path, only: str | None = None) -> int:
    tensors = open_gguf(path).tensors  # a PackageError names the file
    return sum(int(t.n_elements) for t in tensors if only is None or t.name == only)
