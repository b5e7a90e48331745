"""`Requests` in-process over a real pipeline on the tiny random model: stage 0 holds every
layer (no link), with a real draft and prompt lookup when asked. Milliseconds a request, so
the fast tier can drive the coordinator's request path through many histories."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from common.sampling import Sampled
from mesh.backend import GenerationRequest, MeshUnavailableError
from mesh.reports.recovery import Recoveries
from mesh.serving.pipeline import Pipeline, PipelineOptions
from mesh.serving.requests import Requests
from mesh.serving.settings import ServingSettings
from mesh.speculative.draft import Draft
from mesh.speculative.ngram import NgramProposer
from mesh.speculative.plan import NgramPlan, SpecPlan
from mesh.speculative.proposer import Combined, Proposer
from mesh.speculative.speculation import Speculation
from packages.speculative import WindowPolicy
from stage.batcher import close_engine
from stage.engine import EngineConfig, RangeEngine
from stage.llama_engine import LlamaRangeEngine

LANES, CTX = 2, 256
FIXED = WindowPolicy(policy="fixed", initial=3, min=1, max=3)


@dataclass
class Stage0:
    """Stage 0's engine, as `Requests` reads it of the route keeper."""

    engine: RangeEngine | None


class Healer:
    """The one pipeline, never rebuilt."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def live_pipeline(self) -> Pipeline:
        return self.pipeline

    async def next_pipeline(self, cause: str) -> Pipeline:
        raise MeshUnavailableError(cause)


@dataclass(frozen=True)
class Served:
    requests: Requests
    pipeline: Pipeline
    draft: Draft | None


@contextlib.asynccontextmanager
async def serving(gguf: Path, cache_dir: Path, draft: bool, prefix_cache: bool, lookup: bool = False,
                  wrap: type | None = None, window: WindowPolicy = FIXED,
                  draft_gguf: Path | None = None, in_flight: int | None = None) -> AsyncIterator[Served]:
    """Requests over the tiny model; with `draft`, `draft_gguf` (default: the same GGUF) drafts,
    after prompt lookup with `lookup`; `wrap(proposer)` stands between the loop and the proposers;
    `in_flight` verify frames a session may keep out (default: 1, as with no stage downstream)."""
    engine = LlamaRangeEngine(gguf, EngineConfig(first=True, final=True, lanes=LANES, ctx_per_lane=CTX))
    pipeline = Pipeline(engine, None, options=PipelineOptions(prefix_cache=prefix_cache))
    pipeline.start()
    d = Draft(draft_gguf or gguf, LANES, CTX, threads=1) if draft else None
    proposer: Proposer | None = d
    if d is not None:
        d.start()
        proposer = Combined(NgramProposer(1, 3), d) if lookup else d
        proposer = wrap(proposer) if wrap is not None else proposer
    ngram = NgramPlan(1, 3, window, "test") if lookup else None
    spec = SpecPlan("tiny", window, "test", None, ngram=ngram, in_flight=in_flight) if d is not None else None
    settings = ServingSettings(lanes=LANES, ctx_size=CTX, prefix_cache=prefix_cache)
    # a stand-in for the healer (a `LiveRoute`), which only hands out the one pipeline here
    speculation = Speculation(spec, "off: no draft", print)
    speculation.proposer = proposer  # the draft is this block's to stop, not the speculation's
    requests = Requests(speculation, Stage0(engine), Healer(pipeline), settings, Recoveries())
    try:
        yield Served(requests, pipeline, d)
    finally:
        if d is not None:
            await d.stop()
        await pipeline.stop()
        await close_engine(engine)


async def served_tokens(target: Path, draft: Path | None, cache: Path, requests: list[GenerationRequest]
                        ) -> list[list[int]]:
    """Each request's tokens, in turn, through `Requests` on `target` (with `draft` drafting,
    three frames in flight, where given): what speculation must not change."""
    async with serving(target, cache, draft=draft is not None, prefix_cache=True, draft_gguf=draft,
                       in_flight=3) as served:
        out = []
        for req in requests:
            async with contextlib.aclosing(served.requests.generate(req)) as events:
                out.append([event.token async for event in events if isinstance(event, Sampled)])
        return out
