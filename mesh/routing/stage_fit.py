"""Whether a planned range fits its stage: its engine reads the range's tensors, and its
machine has the memory the range costs on that engine. Checked before any stage prepares.

Weights: the range's tensors as the package stores them. Both engines keep Q4_0, Q4_1 and
Q8_0 quantized (llama.cpp maps the file, MLX reads it into memory); a final stage whose
model ties its head to the token embeddings holds the embeddings too.

KV: each layer keeps, per position, keys and values as wide as its `attn_k` and `attn_v`
outputs. llama.cpp allocates f16 for every lane's whole context at Load. MLX keeps them in
its activations' dtype, f32, and grows a lane's buffer as it fills (stage/mlx_models/cache.py),
so its worst case is what is counted: every lane full. Measured against RSS in DESIGN.md §3.

Recurrent state: a Mamba-2, gated delta-net or short-convolution layer keeps, per lane, a
convolution window ((kernel - 1) x channels) and a state matrix (`ssm.state_size` x its
inner width), F32, whatever the context; the engine keeps DEPTH checkpoints of it per lane
besides (stage/checkpoints.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mesh.routing.planner import StageRange
from packages.gguf_files import open_gguf
from packages.gguf_infos import TensorInfo
from packages.manifest import Manifest
from stage.checkpoints import DEPTH
from stage.engine_choice import EngineKind


@dataclass(frozen=True)
class PackageSizes:  # what the fit checks read once from a package
    layer_weights: tuple[int, ...]  # tensor bytes of each layer
    layer_kv: tuple[int, ...]  # key + value elements each layer keeps per position
    layer_state: tuple[int, ...]  # recurrent-state elements (F32) each layer keeps per lane
    layer_types: tuple[tuple[tuple[str, str], ...], ...]  # (tensor, GGUF type) of each layer
    embeddings: int  # the token embeddings: stage 0's, and a tied head's
    head: int  # the final norm and output matrix; the embeddings are added when tied
    tied: bool
    mtp_weights: int = 0  # a final stage drafting with the MTP layers: their tensors (issue 56)
    mtp_kv: int = 0  # and the key + value elements their own KV keeps per position


@dataclass(frozen=True)
class Footprint:
    weights: int
    kv: int
    overhead: int
    state: int = 0  # recurrent state, live and checkpointed

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead + self.state


def package_sizes(package_dir: Path, manifest: Manifest, mtp: bool = False) -> PackageSizes:
    """Read from the package's tensor headers; raises PackageError when one cannot be read.
    `mtp`: the final stage drafts with the package's MTP layers, which it then holds too."""
    layers = [[TensorInfo.of(t) for t in open_gguf(package_dir / layer.path).tensors] for layer in manifest.layers]
    shared = manifest.shared
    output = shared.get("output")
    tied = output is None or not any(t.name == "output.weight"
                                     for t in open_gguf(package_dir / output.path).tensors)
    sizes = sizes_of(layers, embeddings=shared["embeddings"].tensor_bytes if "embeddings" in shared else 0,
                     head=output.tensor_bytes if output else 0, tied=tied,
                     d_state=_state_size(package_dir, manifest))
    if not mtp or not manifest.mtp_layers:
        return sizes
    nextn = [TensorInfo.of(t) for art in manifest.mtp_layers for t in open_gguf(package_dir / art.path).tensors]
    return replace(sizes, mtp_weights=sum(t.n_bytes for t in nextn), mtp_kv=sum(_kv_elements(t) for t in nextn))


def sizes_of(layers: Sequence[Sequence[TensorInfo]], embeddings: int, head: int, tied: bool,
             d_state: int) -> PackageSizes:
    """What the fit checks count, from each layer's tensor infos: a package's or a GGUF
    header's (`mesh plan`, mesh/routing/header_plan.py), by the same arithmetic."""
    kv, types, state = [], [], []
    for tensors in layers:
        kv.append(sum(_kv_elements(t) for t in tensors))
        types.append(tuple((t.name, t.type_name) for t in tensors))
        state.append(sum(_state_elements(t.name, list(t.shape), d_state) for t in tensors))
    return PackageSizes(layer_weights=tuple(sum(t.n_bytes for t in tensors) for tensors in layers),
                        layer_kv=tuple(kv), layer_state=tuple(state), layer_types=tuple(types),
                        embeddings=embeddings, head=head, tied=tied)


def _kv_elements(tensor: TensorInfo) -> int:
    """What a layer's tensor says it keeps per position: the output widths of `attn_k` and
    `attn_v`; with multi-head latent attention (DeepSeek, GLM-5), the compressed latent and its
    RoPE part, `attn_kv_a_mqa`'s output, and no V (llama_kv_cache: `has_v = !is_mla`); and a
    sparse-attention indexer's keys (`indexer.attn_k`), which its own cache keeps."""
    role = tensor.name.split(".", 2)[-1].removesuffix(".weight")
    return tensor.shape[-1] if role in ("attn_k", "attn_v", "attn_kv_a_mqa", "indexer.attn_k") else 0


def footprint(sizes: PackageSizes, rng: StageRange, engine: EngineKind, lanes: int, ctx: int) -> Footprint:
    final = rng.end == len(sizes.layer_weights)
    weights = sum(sizes.layer_weights[rng.start:rng.end])
    weights += sizes.embeddings if rng.start == 0 else 0
    weights += (sizes.head + (sizes.embeddings if sizes.tied else 0)) if final else 0
    mtp = final and sizes.mtp_weights > 0  # its block, and the token embeddings it reads
    weights += (sizes.mtp_weights + (sizes.embeddings if rng.start > 0 and not sizes.tied else 0)) if mtp else 0
    kv = lanes * ctx * engine.kv_bytes * (sum(sizes.layer_kv[rng.start:rng.end]) + (sizes.mtp_kv if mtp else 0))
    state = lanes * (1 + DEPTH) * 4 * sum(sizes.layer_state[rng.start:rng.end])
    return Footprint(weights, kv, engine.overhead, state)


def _state_size(package_dir: Path, manifest: Manifest) -> int:
    """The model's `ssm.state_size` (0 without one), from the package's metadata."""
    meta = manifest.shared.get("metadata")
    if meta is None:
        return 0
    field = open_gguf(package_dir / meta.path).fields.get(f"{manifest.architecture}.ssm.state_size")
    return int(field.contents()) if field is not None else 0


def _state_elements(name: str, shape: list[int], d_state: int) -> int:
    """What a layer's tensor says of its recurrent state per lane (GGUF shapes: input dim first)."""
    if name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight")):
        return (shape[0] - 1) * shape[1]  # the convolution's window of past inputs
    if name.endswith("ssm_out.weight"):
        return d_state * shape[0]  # the state matrix, d_state x the mixer's inner width
    return 0


@dataclass(frozen=True)
class StageNeed:
    name: str  # how the operator knows the stage: "stage 0 (this process)", an endpoint
    rng: StageRange
    engine: EngineKind
    free: int  # bytes the stage's machine reports available
    machine: str  # stages on one machine share its free memory


def misfits(sizes: PackageSizes, needs: Sequence[StageNeed], lanes: int, ctx: int) -> list[str]:
    """Why the plan does not fit: a range its engine cannot read, a machine short of memory;
    empty when it fits."""
    problems = [p for n in needs if (p := _unreadable(sizes, n))]
    for machine in dict.fromkeys(n.machine for n in needs):
        here = [n for n in needs if n.machine == machine]
        prints = [footprint(sizes, n.rng, n.engine, lanes, ctx) for n in here]
        total, free = sum(p.total for p in prints), min(n.free for n in here)
        if total <= free:
            continue
        parts = ", ".join(f"{n.name} [{n.rng.start},{n.rng.end}) on {n.engine.name}: {_mib(p.weights)} weights "
                          f"+ {_mib(p.kv)} KV{_state_part(p)} + {_mib(p.overhead)} engine"
                          for n, p in zip(here, prints, strict=True))
        problems.append(f"{parts} need {_mib(total)} at {lanes} lanes of {ctx} tokens and the machine has "
                        f"{_mib(free)} free (lower --lanes or --ctx-size, or add a stage)")
    return problems


def _unreadable(sizes: PackageSizes, need: StageNeed) -> str | None:
    for layer in range(need.rng.start, need.rng.end):
        if bad := need.engine.unreadable(sizes.layer_types[layer]):
            return (f"{need.name} runs {need.engine.label}, which cannot read tensor {bad[0]} of type {bad[1]} "
                    f"in layer {layer} (it reads {', '.join(need.engine.reads)}); run that stage with --engine "
                    "llama")
    return None


def _state_part(p: Footprint) -> str:
    return f" + {_mib(p.state)} recurrent state ({1 + DEPTH} copies a lane)" if p.state else ""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
