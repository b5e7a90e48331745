"""The target/draft pairs the peers scenario measures: the package's own, and a cost-realistic one.

The embedded package's draft is its target requantized to Q4_0, so a draft step costs about
what a target step does: the hardest case for speculation. A real pair has a target several
times the draft's cost. The cost-realistic pair keeps the same model, so acceptance stays
as high, and makes the target expensive instead: the package's target dequantized to F32
(llama.cpp's quantizer with requantizing allowed), packaged with the package's draft and
window policy. On one core of this VM a SmolLM2 F32 token costs 3.3x a Q4_0 one (F16: 2.1x),
so F32 it is. Both files are made once and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.harness.harness import Setup
from packages.errors import PackageError
from packages.gguf_files import open_gguf
from packages.requantize import requantize
from packages.speculative import DraftStrategy, declared, verify_draft
from packages.validate import validate_package
from packages.writer import quantization_of, write_package

COSTLY_QUANT = "F32"


@dataclass(frozen=True)
class Pair:
    """A target and its draft: what meshpipe serves (`setup`) and the files llama-server loads."""

    label: str  # "same-cost pair: Q4_1 target, Q4_0 draft"
    setup: Setup  # --model and model id for `mesh serve`; its gguf is the whole target
    draft: Path
    costly: bool = False  # the target costs several times the draft

    @property
    def target(self) -> Path:
        return self.setup.gguf


def quant_name(gguf: Path) -> str:
    return quantization_of(open_gguf(gguf)).removeprefix("ALL_")


def package_draft(setup: Setup) -> DraftStrategy | None:
    """The package's default draft model shipped inside it, if it has one."""
    default, strategies = declared(setup.manifest.generation)
    chosen = strategies.get(default) if default else next(iter(strategies.values()), None)
    return chosen if isinstance(chosen, DraftStrategy) and chosen.in_package else None


def same_cost_pair(setup: Setup, draft: DraftStrategy) -> Pair:
    path = verify_draft(setup.package, draft)
    return Pair(f"same-cost pair: {setup.quant} target, {quant_name(path)} draft", setup, path)


def cost_realistic_pair(setup: Setup, draft: DraftStrategy, say: Callable[[str], None]) -> Pair:
    """The target in F32 with the same draft, as a package of its own under the cache."""
    draft_path = verify_draft(setup.package, draft)
    name = f"{setup.model_id}-{COSTLY_QUANT.lower()}"
    target = setup.cache / "targets" / f"{name}.gguf"
    if not target.is_file():
        say(f"making the cost-realistic target: {setup.model_id} dequantized to {COSTLY_QUANT} (first run only)")
        target.parent.mkdir(parents=True, exist_ok=True)
        requantize(setup.gguf, target, COSTLY_QUANT)
    package = setup.cache / "packages" / f"bench-{name}-v1"
    if not (package / "model-package.json").is_file():
        say(f"writing the {name} package with the draft {draft_path.name} (first run only)")
        write_package(target, package, model_id=name, progress=lambda _: None, draft=str(draft_path),
                      window=draft.window)
    manifest, _ = validate_package(package)
    if manifest.model_id != name:
        raise PackageError(f"{package} holds {manifest.model_id}, not {name}: remove it to rebuild")
    costly = replace(setup, model=str(package), model_id=name, quant=COSTLY_QUANT, package=package,
                     gguf=target, manifest=manifest)
    return Pair(f"cost-realistic pair: {COSTLY_QUANT} target, {quant_name(draft_path)} draft", costly, draft_path,
                costly=True)
