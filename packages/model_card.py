"""The README.md (Hub model card) that `mesh package publish` writes beside a layer package."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from packages.describe import human_bytes
from packages.manifest import Manifest
from packages.speculative import DraftStrategy, declared

CARD_NAME = "README.md"


def model_card(m: Manifest, repo_id: str, revision: str | None) -> str:
    ref = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    total = sum(a.artifact_bytes for a in m.artifacts())
    rows = [
        ("architecture", m.architecture),
        ("layers", str(m.layer_count)),
        ("activation width", str(m.activation_width)),
        ("quantization", m.quantization),
        ("allowed cuts", _cuts(m.allowed_cuts, m.layer_count)),
        ("artifacts", f"{len(m.artifacts())} files, {human_bytes(total)}"),
        ("source", m.source_model.repo or m.source_model.path or "unknown"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""---
tags:
- meshpipe
- layer-package
- gguf
---

# {m.model_id}: meshpipe layer package

A meshpipe layer package: `{m.model_id}` split into one GGUF per layer
plus shared metadata, embeddings and output, described by `model-package.json`. Each stage of
a pipeline downloads only the manifest and the layers of its own range, and checks every file
against the manifest's sha256.

| field | value |
|---|---|
{table}

## Speculative decoding

{_speculative(m.generation)}

## Serve it

Pin the commit that `mesh package publish` printed (`hf://{repo_id}@<commit>`), so every
machine serves the same bytes; `{ref}` follows the branch.

```sh
# one machine, split across 2 local stages
mesh serve --model {ref} --local-stages 2

# several machines sharing a token ($MESHPIPE_TOKEN): a stage daemon on each, then the coordinator
mesh stage --listen 0.0.0.0:7070                                  # on every stage machine
mesh serve --model {ref} --peer HOST1:7070 --peer HOST2:7070      # on the coordinator

# machines without Hub access: pre-fetch a package, or only a layer range, into the HF cache
mesh package pull {ref} --range 0:{m.layer_count}
```

Stages pull their artifacts from the coordinator by default, so they need no Hub access or
token; they fall back to the Hub only when the coordinator cannot supply the files.
"""


def _cuts(cuts: Sequence[int], layers: int) -> str:
    if list(cuts) == list(range(1, layers)):
        return f"any layer (1..{layers - 1})"
    return ", ".join(map(str, cuts)) or "none (one stage only)"


def _speculative(generation: Mapping[str, Any]) -> str:
    default, strategies = declared(generation)
    if not strategies:
        return "None declared: the package serves without a draft model."
    lines = []
    for s in strategies.values():
        mark = " (default)" if s.name == default else ""
        w = s.window
        if isinstance(s, DraftStrategy):
            where = "shipped in the package" if s.in_package else "resolved from the Hub"
            what = f"draft model `{s.draft_model}` ({where})"
        else:
            what = f"prompt lookup, {s.ngram_min}- to {s.ngram_max}-token matches"
        lines.append(f"- `{s.name}`{mark}: {what}, {w.policy} window "
                     f"starting at {w.initial} tokens, between {w.min} and {w.max}")
    return "\n".join(lines)
