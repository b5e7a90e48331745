"""Admission and each request's generation on the live route (DESIGN.md §2).

Admission (mesh/serving/admission.py) gives a request one of `--lanes`, or a place in the bounded
queue before them, or a refusal; its record (mesh/serving/request_state.py) lives for its
whole life here, and the generate loop (mesh/serving/generate.py) runs it on the route's
pipeline. When the route breaks under it, the request waits for the rebuilt route
(mesh/routing/healing.py), its record falls back to what the new route holds, and the same loop
goes on: a resume is the loop's own rule, feed from what is computed. `--request-timeout`
bounds the whole of it, waits included: past it the request ends, its session freed on
every stage as when its client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeVar

import anyio

from common.errors import EngineError
from common.ids import SessionId
from common.sampling import Sampled
from config.errors import MeshpipeError
from mesh.backend import (
    Account,
    Generation,
    GenerationEvent,
    GenerationRequest,
    MeshUnavailableError,
    PromptLogprobs,
    RequestRejectedError,
    RequestTimeoutError,
    Resumed,
    WindowChoice,
)
from mesh.reports.failures import Failures, InternalError
from mesh.reports.recovery import Recoveries
from mesh.serving.admission import Admission
from mesh.serving.generate import generate
from mesh.serving.pipeline import Lease, Pipeline, StageFailedError, unrestored
from mesh.serving.proposals import Proposing, Windows
from mesh.serving.request_state import Live, RequestState
from mesh.serving.settings import ServingSettings
from mesh.speculative.plan import FRAMES_IN_FLIGHT, PRICED_FRAMES_IN_FLIGHT, SpecPlan
from mesh.speculative.proposers import windows as proposer_windows
from mesh.speculative.speculation import Speculation
from mesh.speculative.window import Controller, controller_for
from stage.engine import RangeEngine

log = logging.getLogger("meshpipe.requests")
END_S = 10.0  # freeing a lane on every stage: an END frame and the trim behind it
T = TypeVar("T")


class Stage0(Protocol):
    """Stage 0's engine on the current route (mesh/routing/keeper.py's), which a request's
    sampling is checked against before it is admitted."""

    engine: RangeEngine | None


class LiveRoute(Protocol):
    """Where requests get a pipeline to run on: the healer (mesh/routing/healing.py), which
    keeps the route serving. Serving never builds or repairs a route itself."""

    async def live_pipeline(self) -> Pipeline:
        """The route's pipeline; during a rebuild, the next one."""
        ...

    async def next_pipeline(self, cause: str) -> Pipeline:
        """The rebuilt route's pipeline, after `cause` broke this one."""
        ...


class Requests:
    """Every request's generation, admitted up to the lanes and resumed across breaks."""

    def __init__(self, speculation: Speculation, stage0: Stage0, healer: LiveRoute, settings: ServingSettings,
                 recoveries: Recoveries) -> None:
        # speculation: what it proposes with; the plan may change once, at start (mesh/speculative/speculation.py)
        self.speculation, self.stage0 = speculation, stage0
        self.healer, self.settings, self.recoveries = healer, settings, recoveries
        self.admission = Admission(settings.lanes, settings.max_queue)
        self.ids = itertools.count(1)  # session ids, one per request
        self.shared_windows: dict[str, Controller] = {}  # cost-aware controllers, one per proposer
        self.failures = Failures()  # internal errors: /metrics by cause, /health on a run of them
        self.generated = 0  # tokens handed on, counted as they go: the web page's tok/s (mesh/observe/sampler.py)
        self.tier_misses = 0  # requests prefilled again because a stage lost what the KV tier was to restore

    def generate(self, req: GenerationRequest) -> Generation:
        """`Backend.generate`: the HTTP API calls this one directly (the coordinator binds it)."""
        live = Live(RequestState(req, speculative=self.speculation.spec is not None or self._forced(req)))
        return Generation(self._guarded(live), lambda: self._account(live))

    def _account(self, live: Live) -> Account:
        """The record's account, with what the shared cost-aware controllers chose."""
        account = live.state.account()
        if account.speculative is None:
            return account
        return replace(account, choices=self.choices())

    def choices(self) -> tuple[tuple[str, WindowChoice], ...]:
        """Each cost-aware controller's choice, by proposer, once it has made one."""
        made = ((name, w.choice) for name, w in sorted(self.shared_windows.items()))
        return tuple((name, choice) for name, choice in made if choice is not None)

    def _refusal(self, req: GenerationRequest) -> str | None:
        if len(req.prompt) == 0:
            return "the prompt is empty"
        if len(req.prompt) + req.max_tokens > self.settings.ctx_size:
            return (f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds the context of "
                    f"{self.settings.ctx_size} tokens")
        # the final stage checks these too, but a refusal there could only be a 503
        return req.sampling.problem(self.stage0.engine.n_vocab) if self.stage0.engine is not None else None

    async def _guarded(self, live: Live) -> AsyncGenerator[GenerationEvent, None]:
        """One request, resumed on a rebuilt route as often as the route breaks under it. An
        internal error (a bug, a broken state) is logged with its traceback and the request
        id, counted, and raised as `InternalError`, whose message names the id."""
        try:
            # closed here when the caller closes this one: the session is freed on every stage
            # before the caller goes on, not whenever the garbage collector gets to it
            async with contextlib.aclosing(self._resumed(live)) as events:
                async for event in events:
                    yield event
        except MeshpipeError:
            raise
        except Exception as exc:
            rid = live.state.req.request_id or "-"
            log.exception("request %s: internal error on lane %s", rid, live.state.lane)
            self.failures.failed(rid, exc)
            raise InternalError(f"internal error (request {rid}, logged with its traceback): "
                                f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc
        self.failures.succeeded()

    async def _resumed(self, live: Live) -> AsyncGenerator[GenerationEvent, None]:
        if (problem := self._refusal(live.state.req)) is not None:
            raise RequestRejectedError(problem)
        timeout = self.settings.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        async with self.admission.lane(deadline):
            pipeline = await _until(deadline, self.healer.live_pipeline())
            session = SessionId(next(self.ids))
            try:
                while True:
                    try:
                        # closed here, not left to the garbage collector: a client that leaves
                        # must free the session on every stage before the next request comes
                        async with contextlib.aclosing(self._attempt(pipeline, session, live)) as tokens:
                            while (event := await _until(deadline, anext(tokens, None))) is not None:
                                self.generated += isinstance(event, Sampled)
                                yield event
                        return
                    except MeshUnavailableError:
                        if pipeline.broken is None or self.settings.resume_s <= 0:
                            raise
                    paused, cause = time.monotonic(), pipeline.broken
                    log.info("session %d: paused after %d tokens: %s", session, len(live.state.output), cause)
                    pipeline = await _until(deadline, self.healer.next_pipeline(cause))
                    log.info("session %d: resuming after %.1fs", session, time.monotonic() - paused)
                    live.state = live.state.resume()
                    self.recoveries.sessions += 1
                    yield Resumed(cause, time.monotonic() - paused)
            finally:
                self._ended(session, live.state)

    def _ended(self, session: SessionId, state: RequestState) -> None:
        if self.speculation.proposer is not None and self.speculation.spec is not None and state.lane is not None:
            if not self.settings.prefix_cache:  # with it, the draft's KV serves the lane's next request too
                self.speculation.proposer.forget(state.lane)
            log.info("session %d: %s", session, _outcome(state.account()))

    async def _attempt(self, pipeline: Pipeline, session: SessionId, live: Live
                       ) -> AsyncGenerator[Sampled | PromptLogprobs, None]:
        """One run of the generate loop on one route; a resumed one asks for its old lane,
        where the draft's KV still holds its tokens. The session ends there with it, and
        what every stage's KV holds of it stays in the lane (the prefix cache). A prompt to
        score matches no lane's tokens: it is fed whole, and a lane that holds some of it is
        better left to a request that can use them."""
        lease = pipeline.lease(session, () if live.state.scoring else live.state.tokens, live.state.lane)
        failed = False
        try:
            in_flight = frames_in_flight(self.speculation.spec, pipeline.link is not None, self.settings.cpu_lock)
            in_flight = min(in_flight, pipeline.most_in_flight or in_flight)
            draft = self.speculation.proposer if self.speculation.spec is not None else None
            req = live.state.req
            proposing = Proposing(draft, self._window(), in_flight, self._forced(req), bounded=not req.explore)
            async for sampled in self._generated(pipeline, lease, live, proposing):
                yield sampled
        except StageFailedError as exc:
            raise MeshUnavailableError(f"a stage failed this request: {exc}") from None
        except Exception as exc:
            failed = not isinstance(exc, MeshpipeError)
            raise
        finally:
            # the request's own cleanup: shielded from its cancellation (a client gone), and bounded.
            # A lane whose request raised is emptied on every stage and in the draft: nothing it
            # holds can be trusted by the next request (the prefix cache)
            held = live.state.tokens[: live.state.computed] if live.state.req.keep and not failed else ()
            with anyio.move_on_after(END_S, shield=True), contextlib.suppress(Exception):
                await pipeline.end(lease.session, held)
            if failed and self.speculation.proposer is not None:
                self.speculation.proposer.forget(lease.lane)

    async def _generated(self, pipeline: Pipeline, lease: Lease, live: Live, proposing: Proposing
                         ) -> AsyncGenerator[Sampled | PromptLogprobs, None]:
        """The generate loop; a lease whose cached tokens the KV tier was to restore, and some
        stage could not (it dropped the entry, its file was bad, or it is a new process since a
        rebuild), is prefilled again from position 0 on the same lane: the lease's first frame
        failed, so nothing it computed was applied. A request resumed after a route break has
        handed out tokens already; they are prefilled again with its prompt, as a resume does."""
        try:
            async for sampled in generate(pipeline, lease, live, self.settings.ctx_size, proposing):
                yield sampled
            return
        except (StageFailedError, EngineError) as exc:
            if not lease.restored or live.state.computed > lease.cached or pipeline.broken:
                raise
            log.warning("session %d: a stage could not restore its cached tokens (%s): prefilled again",
                        lease.session, exc)
        live.state = live.state.resume(rebuilt=False)
        unrestored(pipeline, lease.lane, lease.restored)
        self.tier_misses += 1
        async for sampled in generate(pipeline, replace(lease, cached=0, restored=""), live,
                                      self.settings.ctx_size, proposing):
            yield sampled

    def _forced(self, req: GenerationRequest) -> bool:
        """A constrained request's forced tokens are drafts, a proposer of their own (usage counts them)."""
        return self.settings.forced_drafts and req.constraint is not None

    def _window(self) -> Windows | None:
        """Window controllers for a new session, one per proposer. Cost-aware is shared by
        every session: step and verify costs are the machine's, and short requests cannot
        learn them alone; the others follow the session's own acceptance."""
        if self.speculation.spec is None:
            return None
        windows = {}
        for name, policy in proposer_windows(self.speculation.spec).items():
            if policy.policy != "cost-aware":
                windows[name] = controller_for(policy)
            else:
                windows[name] = self.shared_windows.setdefault(name, controller_for(policy))
        return windows


async def _until(deadline: float | None, step: Awaitable[T]) -> T:
    """`step`, cancelled at `deadline` (the event loop's clock): a cancelled step of the
    generate loop unwinds as for a client gone, which ends the session on every stage."""
    if deadline is None:
        return await step
    limit = asyncio.timeout_at(deadline)
    try:
        async with limit:
            return await step
    except TimeoutError:
        if not limit.expired():
            raise  # the step's own, not the limit's
        raise RequestTimeoutError("the request ran past its time limit (mesh serve --request-timeout) "
                                  "and was stopped") from None


def frames_in_flight(spec: SpecPlan | None, downstream: bool, cpu_lock: Path | None) -> int:
    """The verify frames a session may keep out: the configured number, else (auto) 1 where
    frames sent ahead cannot overlap anything, with no stage past stage 0; FRAMES_IN_FLIGHT
    where local stages take turns on shared cores (a CPU lock), since their computing cannot
    overlap but a frame on a link can overlap the next one's
    (BENCHMARKS.md, "Figures behind the code's choices"); elsewhere
    PRICED_FRAMES_IN_FLIGHT for cost-aware windows to price, and FRAMES_IN_FLIGHT for fixed
    and adaptive ones, which keep the bound out."""
    if spec is None:
        return 1
    if spec.in_flight is not None:
        return spec.in_flight
    if not downstream:
        return 1
    if cpu_lock is not None:
        return FRAMES_IN_FLIGHT
    return PRICED_FRAMES_IN_FLIGHT if spec.priced() else FRAMES_IN_FLIGHT


def _outcome(account: Account) -> str:
    if account.finish_reason is not None:
        return f"{account.completion_tokens} tokens ({account.finish_reason}), speculative {account.speculative}"
    return f"ended early, speculative {account.speculative}"  # a stop string, a client gone or an error closed it

