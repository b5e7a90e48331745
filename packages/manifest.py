"""model-package.json, schema v1: typed, frozen, and strict about what it accepts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from packages.architectures import mtp_refusal
from packages.errors import PackageError
from packages.integrity import sha256_bytes

MANIFEST_NAME = "model-package.json"
SCHEMA_VERSION = 1
FORMAT = "layer-package"


@dataclass(frozen=True)
class Artifact:
    path: str
    sha256: str
    artifact_bytes: int
    tensor_count: int
    tensor_bytes: int


@dataclass(frozen=True)
class LayerArtifact(Artifact):
    layer_index: int = 0


@dataclass(frozen=True)
class SourceModel:
    path: str | None
    repo: str | None
    revision: str | None
    sha256: str
    files: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    model_id: str
    source_model: SourceModel
    architecture: str
    layer_count: int
    activation_width: int
    quantization: str
    allowed_cuts: tuple[int, ...]
    shared: Mapping[str, Artifact]
    layers: tuple[LayerArtifact, ...]
    # raw JSON, read by packages/speculative.py `declared`; read-only at the top level
    generation: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    created_at_unix_secs: int = 0
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT
    # Multi-token-prediction (nextn) layers past the main stack, by their source index
    # (layer_count + i); only a final stage run with MTP reads them (packages/materialize.py).
    mtp_layers: tuple[LayerArtifact, ...] = ()

    def artifacts(self) -> list[Artifact]:
        """Every artifact: what validate checks, publish uploads and a coordinator serves."""
        return [*self.shared.values(), *self.layers, *self.mtp_layers]

    def range_artifacts(self, start: int, end: int, mtp: bool = False) -> list[Artifact]:
        """What a stage of layers [start, end) needs; with `mtp`, the MTP layers too, which only
        a final range of a package that has them may ask for."""
        if mtp:
            check_mtp(self, start, end)
        return [*self.shared.values(), *self.layers[start:end], *(self.mtp_layers if mtp else ())]

    def to_json(self) -> bytes:
        doc = _plain(self)
        if not self.mtp_layers:
            del doc["mtp_layers"]  # a package without them keeps the manifest, and its sha256, it had before
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def check_mtp(manifest: Manifest, start: int, end: int) -> None:
    """Raise PackageError unless layers [start, end) may run the package's MTP layers."""
    if not manifest.mtp_layers:
        raise PackageError(f"{manifest.model_id} has no MTP (nextn) layers: its source model has none, "
                           "or the package was written before packages kept them")
    if end != manifest.layer_count:
        raise PackageError(f"MTP layers run on the final stage only: layers [{start},{end}) do not end at "
                           f"layer {manifest.layer_count}")
    refusal = mtp_refusal(manifest.architecture, start)
    if refusal is not None:
        raise PackageError(refusal)


def _plain(value: Any) -> Any:
    """JSON-ready copy: dataclasses and read-only mappings become dicts, tuples lists."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclass_fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


SHARED_KEYS = ("metadata", "embeddings", "output")
_ARTIFACT_KEYS = {"path", "sha256", "artifact_bytes", "tensor_count", "tensor_bytes"}


def load_manifest(package_dir: Path) -> tuple[Manifest, str]:
    """Parse and schema-check a package's manifest; return it with the manifest's sha256."""
    path = package_dir / MANIFEST_NAME
    if not path.is_file():
        raise PackageError(f"missing file: {MANIFEST_NAME} in {package_dir}")
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackageError(f"{MANIFEST_NAME} is not valid JSON: {exc}") from None
    return parse_manifest(doc), sha256_bytes(raw)


def parse_manifest(doc: Any) -> Manifest:
    fields = _Fields(doc, "")
    if fields.get("schema_version", int) != SCHEMA_VERSION:
        raise PackageError(f"{MANIFEST_NAME}: unsupported schema_version (expected {SCHEMA_VERSION})")
    if fields.get("format", str) != FORMAT:
        raise PackageError(f"{MANIFEST_NAME}: field 'format' must be '{FORMAT}'")
    layer_count = fields.get("layer_count", int)
    manifest = Manifest(
        model_id=fields.get("model_id", str),
        source_model=_source(fields.sub("source_model")),
        architecture=fields.get("architecture", str),
        layer_count=layer_count,
        activation_width=fields.get("activation_width", int),
        quantization=fields.get("quantization", str),
        allowed_cuts=_cuts(fields.get("allowed_cuts", list), layer_count),
        shared=_shared(fields.sub("shared")),
        layers=_layers(fields.get("layers", list), layer_count),
        generation=MappingProxyType(fields.get("generation", dict)),
        created_at_unix_secs=fields.get("created_at_unix_secs", int),
        # optional, but never null: absent is the one way to say "none"
        mtp_layers=_mtp_layers(fields.get("mtp_layers", list) if "mtp_layers" in doc else None, layer_count),
    )
    fields.reject_unknown()
    return manifest


class _Fields:
    """Typed access to one JSON object that remembers which keys were read."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise PackageError(f"{MANIFEST_NAME}: {where or 'document'} must be an object")
        self.doc, self.where = doc, where
        self.seen: set[str] = set()

    def get(self, key: str, kind: type, optional: bool = False) -> Any:
        self.seen.add(key)
        name = f"{self.where}{key}"
        if key not in self.doc:
            if optional:
                return None
            raise PackageError(f"{MANIFEST_NAME}: missing field '{name}'")
        value = self.doc[key]
        if optional and value is None:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PackageError(f"{MANIFEST_NAME}: field '{name}' must be {kind.__name__}")
        if isinstance(value, int) and value < 0:
            raise PackageError(f"{MANIFEST_NAME}: field '{name}' must not be negative")
        return value

    def sub(self, key: str) -> _Fields:
        return _Fields(self.get(key, dict), f"{self.where}{key}.")

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.doc) - self.seen)
        if unknown:
            raise PackageError(f"{MANIFEST_NAME}: unknown field '{self.where}{unknown[0]}'")


def _source(f: _Fields) -> SourceModel:
    src = SourceModel(
        path=f.get("path", str, optional=True),
        repo=f.get("repo", str, optional=True),
        revision=f.get("revision", str, optional=True),
        sha256=f.get("sha256", str),
        files=tuple(f.get("files", list)),
    )
    f.reject_unknown()
    return src


def _artifact(f: _Fields, extra: dict[str, int] | None = None) -> dict[str, Any]:
    values = {key: f.get(key, str if key in ("path", "sha256") else int) for key in _ARTIFACT_KEYS}
    _check_relpath(values["path"], f.where)
    if len(values["sha256"]) != 64:
        raise PackageError(f"{MANIFEST_NAME}: field '{f.where}sha256' is not a sha256 digest")
    return values | (extra or {})


def _check_relpath(path: str, where: str) -> None:
    # A manifest comes from the network: it must never name a file outside its package.
    parts = Path(path).parts
    if Path(path).is_absolute() or ".." in parts or not parts:
        raise PackageError(f"{MANIFEST_NAME}: field '{where}path' escapes the package: {path!r}")


def _shared(f: _Fields) -> Mapping[str, Artifact]:
    shared = {}
    for key in SHARED_KEYS:
        sub = f.sub(key)
        shared[key] = Artifact(**_artifact(sub))
        sub.reject_unknown()
    f.reject_unknown()
    return MappingProxyType(shared)


def _layers(items: list[Any], layer_count: int) -> tuple[LayerArtifact, ...]:
    layers = _indexed("layers", items, 0)
    if len(layers) != layer_count:
        raise PackageError(
            f"{MANIFEST_NAME}: lists {len(layers)} layers but layer_count is {layer_count}"
        )
    return tuple(layers)


def _mtp_layers(items: list[Any] | None, layer_count: int) -> tuple[LayerArtifact, ...]:
    if items is None:
        return ()
    if not items:  # the writer leaves the field out instead: one package, one manifest
        raise PackageError(f"{MANIFEST_NAME}: field 'mtp_layers' is empty: leave it out")
    return _indexed("mtp_layers", items, layer_count)


def _indexed(name: str, items: list[Any], first: int) -> tuple[LayerArtifact, ...]:
    """Layer artifacts numbered `first`, `first + 1`, ... in order."""
    layers = []
    for i, item in enumerate(items):
        f = _Fields(item, f"{name}[{i}].")
        index = f.get("layer_index", int)
        if index != first + i:
            raise PackageError(f"{MANIFEST_NAME}: field '{name}[{i}].layer_index' is {index}, expected {first + i}")
        layers.append(LayerArtifact(**_artifact(f, {"layer_index": index})))
        f.reject_unknown()
    return tuple(layers)


def _cuts(cuts: list[Any], layer_count: int) -> tuple[int, ...]:
    if any(not isinstance(c, int) or isinstance(c, bool) or not 0 < c < layer_count for c in cuts):
        raise PackageError(f"{MANIFEST_NAME}: 'allowed_cuts' must hold layers in (0,{layer_count})")
    return tuple(sorted(cuts))
