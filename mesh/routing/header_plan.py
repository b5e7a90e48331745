"""Plan a model on machines of given sizes from its GGUF header alone (`mesh plan`).

Nothing here is a second planner: the cut is `plan_ranges` on parameters, each machine
weighted by its memory as `mesh serve` weighs each stage's free memory (mesh/routing/route.py),
at the cuts the package writer would allow (`package_metadata`, `allowed_cuts`), and the fit
is `misfits` and `footprint` of mesh/routing/stage_fit.py, over the sizes `sizes_of` counts
from tensor infos as it does from a package. So a plan that fits here is the plan `mesh serve`
starts on the same memory, before calibration may re-cut it on measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.routing.planner import PlanError, StageRange, plan_ranges
from mesh.routing.stage_fit import PackageSizes, StageNeed, footprint, misfits, sizes_of
from packages.architectures import allowed_cuts, describe_rule, require_servable, split_refusal
from packages.errors import PackageError
from packages.gguf_infos import GGUFInfo, TensorInfo
from packages.parameters import LayerParameters, parameters_of, used_per_layer
from packages.stage_metadata import package_metadata
from packages.writer import block_index
from stage.engine_choice import LLAMA, EngineKind


@dataclass(frozen=True)
class PlanAsk:
    """What the plan is for: the machines' memory (bytes each), and what `mesh serve` would run."""

    machines: tuple[int, ...]
    lanes: int = 4
    ctx: int = 2048
    engine: EngineKind = LLAMA


@dataclass(frozen=True)
class StagePlan:
    machine: int  # which --machine, from 0
    memory: int
    start: int
    end: int
    weights: int  # bytes
    kv_per_lane: int  # bytes at the context asked
    state_per_lane: int  # recurrent state, with the engine's checkpoints of it
    total: int  # weights, KV and state for every lane, and the engine's own
    parameters: float
    active: float
    short: int  # bytes more than the machine has; 0 when it fits


@dataclass(frozen=True)
class ModelPlan:
    architecture: str
    layers: int  # the main stack; nextn (MTP) layers are dropped, as a package drops them
    dropped_layers: int
    splits: bool
    split_rule: str  # where it may be cut and why, or why not
    serves: str | None  # why `mesh serve` refuses it even on one node; None when it serves
    parameters: float  # every tensor a package keeps
    active: float  # what a token multiplies: experts_used of experts_total in MoE layers
    experts_total: int
    experts_used: int
    lanes: int
    ctx: int
    engine: str
    header_bytes: int
    stages: tuple[StagePlan, ...]
    fits: bool
    problems: tuple[str, ...]  # the fit check's words, as `mesh serve` would refuse the plan


@dataclass(frozen=True)
class _Model:
    arch: str
    layers: int
    cuts: list[int]
    rule: str
    sizes: PackageSizes
    params: LayerParameters
    globals_: float  # parameters outside the layers: embeddings, head, norms


def plan_model(info: GGUFInfo, ask: PlanAsk) -> ModelPlan:
    """The cut, each stage's memory and whether it fits. Raises PackageError for a header
    that is not a model's, PlanError for more machines than the allowed cuts can serve."""
    if not ask.machines:
        raise PlanError("no machines to plan for")
    m = _model(info)
    ranges, used = _ranges(m, ask)
    stages = tuple(_stage(m, ask, i, rng) for i, rng in zip(used, ranges, strict=True))
    needs = [StageNeed(f"stage {n} (machine {i}, {_gib(ask.machines[i])})", rng, ask.engine, ask.machines[i],
                       f"machine {i}") for n, (i, rng) in enumerate(zip(used, ranges, strict=True))]
    problems = misfits(m.sizes, needs, ask.lanes, ask.ctx)
    experts = info.value(f"{m.arch}.expert_count")
    used_experts = info.value(f"{m.arch}.expert_used_count")
    return ModelPlan(
        architecture=m.arch, layers=m.layers, dropped_layers=_blocks(info, m.arch) - m.layers,
        splits=bool(m.cuts), split_rule=m.rule, serves=_serve_refusal(m.arch),
        parameters=sum(m.params.total) + m.globals_, active=sum(m.params.active) + m.globals_,
        experts_total=int(experts or 0),
        experts_used=int(max(used_experts) if isinstance(used_experts, list) else used_experts or 0),
        lanes=ask.lanes, ctx=ask.ctx, engine=ask.engine.name, header_bytes=info.header_bytes, stages=stages,
        fits=not problems, problems=tuple(problems))


def _model(info: GGUFInfo) -> _Model:
    arch = info.architecture
    metadata, layer_count = package_metadata(arch, info.metadata)
    values = {kv.key: kv.value for kv in metadata}
    cuts = allowed_cuts(arch, layer_count, values)
    layers, globals_ = _grouped(info.tensors, layer_count)
    by_name = {t.name: t for t in globals_}
    embd, out = by_name.get("token_embd.weight"), by_name.get("output.weight")
    head = sum(t.n_bytes for t in globals_ if t is not embd)
    sizes = sizes_of(layers, embeddings=embd.n_bytes if embd else 0, head=head, tied=out is None,
                     d_state=int(values.get(f"{arch}.ssm.state_size") or 0))
    head_tensor = out or embd  # a tied head multiplies the embeddings (packages/parameters.py)
    head_params = float(head_tensor.n_elements) if head_tensor is not None else 0.0
    params = parameters_of(layers, used_per_layer(values.get(f"{arch}.expert_used_count"), layer_count),
                           head_params)
    refusal = split_refusal(arch, values) or (None if cuts else f"no cut of its {layer_count} layers is allowed")
    rule = describe_rule(arch, values) if refusal is None else refusal
    return _Model(arch, layer_count, cuts, rule, sizes, params, float(sum(t.n_elements for t in globals_)))


def _grouped(tensors: Sequence[TensorInfo], layer_count: int) -> tuple[list[list[TensorInfo]], list[TensorInfo]]:
    """(each main-stack layer's tensors, the tensors outside the layers); nextn layers' dropped."""
    layers: list[list[TensorInfo]] = [[] for _ in range(layer_count)]
    globals_ = []
    for t in tensors:
        index = block_index(t.name)
        if index is None:
            globals_.append(t)
        elif index < layer_count:
            layers[index].append(t)
    if empty := [i for i, layer in enumerate(layers) if not layer]:
        raise PackageError(f"the GGUF has no tensors for layer {empty[0]}")
    return layers, globals_


def _ranges(m: _Model, ask: PlanAsk) -> tuple[list[StageRange], list[int]]:
    """(the ranges, the machine each runs on): a model that does not split runs on the
    largest machine alone."""
    if len(ask.machines) == 1 or not m.cuts:
        return [StageRange(0, m.layers)], [max(range(len(ask.machines)), key=lambda i: ask.machines[i])]
    weights = [float(b) for b in ask.machines]
    return plan_ranges(m.layers, m.cuts, weights, m.params.active, m.params.head), list(range(len(weights)))


def _stage(m: _Model, ask: PlanAsk, machine: int, rng: StageRange) -> StagePlan:
    one = footprint(m.sizes, rng, ask.engine, 1, ask.ctx)
    full = footprint(m.sizes, rng, ask.engine, ask.lanes, ask.ctx)
    head = m.params.head if rng.end == m.layers else 0.0
    return StagePlan(machine=machine, memory=ask.machines[machine], start=rng.start, end=rng.end,
                     weights=one.weights, kv_per_lane=one.kv, state_per_lane=one.state, total=full.total,
                     parameters=sum(m.params.total[rng.start:rng.end]) + head,
                     active=sum(m.params.active[rng.start:rng.end]) + head,
                     short=max(0, full.total - ask.machines[machine]))


def _blocks(info: GGUFInfo, arch: str) -> int:
    return int(info.value(f"{arch}.block_count") or 0)


def _serve_refusal(arch: str) -> str | None:
    try:
        require_servable(arch)
    except PackageError as exc:
        return str(exc)
    return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
