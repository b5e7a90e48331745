"""`mesh package inspect`: a human summary of a package directory or a raw GGUF."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from packages.architectures import MTP_FROM_LAYER_0, allowed_cuts, describe_rule, package_verdict
from packages.gguf_files import architecture_of, field_value, metadata_of, open_gguf
from packages.manifest import load_manifest
from packages.materialize import MtpCost, mtp_cost
from packages.stage_metadata import package_metadata
from packages.writer import block_index, quantization_of


def describe(target: Path) -> list[tuple[str, str]]:
    """Rows of (field, value) for a package directory or a GGUF file."""
    if target.is_dir():
        return _describe_package(target)
    return _describe_gguf(target)


def _describe_package(package_dir: Path) -> list[tuple[str, str]]:
    m, sha = load_manifest(package_dir)
    layer_bytes = sum(layer.artifact_bytes for layer in m.layers)
    rows = [
        ("model_id", m.model_id),
        ("manifest sha256", sha),
        ("architecture", m.architecture),
        ("layers", str(m.layer_count)),
        ("width", str(m.activation_width)),
        ("quantization", m.quantization),
        ("allowed cuts", _cuts_text(m.allowed_cuts, m.layer_count)),
        ("splitting", package_verdict(m.architecture, m.allowed_cuts, m.layer_count)),
    ]
    rows += [(f"shared/{k}", human_bytes(a.artifact_bytes)) for k, a in m.shared.items()]
    rows.append(("layer artifacts", f"{human_bytes(layer_bytes)} in {len(m.layers)} files"))
    spec = m.generation.get("speculative_decoding")
    rows.append(("speculative", spec["default"] if spec else "none declared"))
    cost = mtp_cost(package_dir, m)
    if cost is not None:
        rows.append(("MTP", _mtp_text(cost, m.architecture)))
    return rows


def _mtp_text(cost: MtpCost, arch: str) -> str:
    """"1 nextn layer, +X MiB at the final stage (nextn Y MiB, token embeddings Z MiB)"."""
    parts = [f"nextn {human_bytes(cost.nextn_bytes)}"]
    parts += [f"token embeddings {human_bytes(cost.embedding_bytes)}"] if cost.embedding_bytes else []
    where = "on a single stage only" if arch in MTP_FROM_LAYER_0 else "at the final stage"
    layers = f"{cost.layers} nextn layer{'s' if cost.layers > 1 else ''}"
    return f"{layers}, +{human_bytes(cost.total)} {where} ({', '.join(parts)})"


def _describe_gguf(path: Path) -> list[tuple[str, str]]:
    reader = open_gguf(path)
    arch = architecture_of(reader)
    layers = int(field_value(reader, f"{arch}.block_count"))
    layer_bytes = sum(int(t.n_bytes) for t in reader.tensors if block_index(t.name) is not None)
    metadata, main = package_metadata(arch, metadata_of(reader))
    values = {kv.key: kv.value for kv in metadata}
    return [
        ("file", str(path)),
        ("architecture", arch),
        ("layers", str(layers)),
        ("width", str(field_value(reader, f"{arch}.embedding_length"))),
        ("quantization", quantization_of(reader)),
        ("allowed cuts", _cuts_text(allowed_cuts(arch, main, values), main)),
        ("splitting", describe_rule(arch, values)),
        ("file size", human_bytes(path.stat().st_size)),
        ("layer tensors", human_bytes(layer_bytes)),
    ]


def _cuts_text(cuts: Sequence[int], layers: int) -> str:
    if list(cuts) == list(range(1, layers)):
        return f"any (1..{layers - 1})"
    return ", ".join(map(str, cuts)) or "none"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def human_count(n: float) -> str:
    """A parameter count: 135M, 1.2B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{0 if n >= 100 * size else 1}f}{unit}"
    return f"{n:.0f}"


def human_parameters(total: int | None, active: int | None) -> str:
    """"1.2B (active 0.3B)" for a mixture of experts, "135M" when every parameter is active."""
    if total is None:
        return ""
    text = human_count(total)
    return text if active is None or active >= total else f"{text} (active {human_count(active)})"


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
