"""The coordinator: stage 0 of the pipeline and the `Backend` the HTTP API talks to.

It keeps the lifecycle and nothing else: it wires the route (mesh/routing/keeper.py, which
builds, re-cuts and drops it, with stage 0's layers on it), speculation (mesh/speculative/
speculation.py: the plan, the draft, the proposer), healing (mesh/routing/healing.py) and
requests (mesh/serving/requests.py), starts them in order, stops them in reverse, and
answers `/health` from what they hold.

Healing keeps the route serving: it rebuilds a broken route, and an in-flight generation
pauses, prefills its prompt and the tokens generated so far through the new route, and goes on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from mesh.backend import Generation, GenerationRequest
from mesh.model.tokenizer import Tokenizer
from mesh.reports.health import Health
from mesh.reports.recovery import Recoveries
from mesh.routing.healing import Healer
from mesh.routing.keeper import RouteKeeper, ServedModel, Topology
from mesh.routing.route import RouteSettings
from mesh.routing.route_rows import describe, stage_rows
from mesh.serving.requests import Requests
from mesh.serving.settings import ServingSettings
from mesh.serving.warm_up import chooses, warm_up
from mesh.speculative.speculation import DraftRoom, Speculation
from packages.architectures import keeps_state, package_verdict
from stage.checkpoints import DEPTH
from stage.llama_model import numerics_promise

__all__ = ["Coordinator", "ServedModel", "Topology"]


class Coordinator:
    def __init__(self, model: ServedModel, settings: RouteSettings, serving: ServingSettings, topology: Topology,
                 speculation: Speculation, coordinator_id: str | None = None,
                 say: Callable[[str], None] = print) -> None:
        self.model_id, self.settings, self.serving, self.say = model.model_id, settings, serving, say
        self.ctx_per_session = serving.ctx_size
        self.speculation = speculation
        # its claims' name on every stage, route after route (mesh.cli.serve.coordinator_id)
        self.routes = RouteKeeper(model, settings, topology, coordinator_id or uuid.uuid4().hex[:12], say)
        self.routes.other_busy_s = lambda: speculation.draft_busy_s
        self.recoveries = Recoveries()
        self.healer = Healer(self.routes, serving.resume_s, topology.spares, self.recoveries, say)
        self.routes.on_break = self.healer.route_broken
        self.requests = Requests(speculation, self.routes, self.healer, serving, self.recoveries)
        # `Backend.generate` is the request path's own, bound here rather than wrapped
        self.generate: Callable[[GenerationRequest], Generation] = self.requests.generate

    async def start(self) -> None:
        self.healer.start()  # first: a route that breaks while the draft loads is rebuilt at once
        await self.routes.start_artifact_server()
        m = self.routes.model.manifest
        self.say(f"model {self.model_id}: {package_verdict(m.architecture, m.allowed_cuts, m.layer_count)}")
        if keeps_state(m.architecture):
            self.say(f"model {self.model_id}: recurrent state rolls back by checkpoint ({DEPTH} a lane): at most "
                     f"{DEPTH - 1} frames in flight, and a free lane is reused only by a prompt that extends it")
        await self.routes.build_route()
        s, spec = self.settings, self.speculation
        await spec.load(self.routes.model.package_dir, self.tok(),
                        DraftRoom(s.lanes, s.ctx_size, s.own_threads, s.cpu_lock))
        if spec.proposer is not None:
            self.say(f"numerics: {numerics_promise(s.own_threads, s.engines)}")
        if self.serving.warm_up and chooses(spec.spec, spec.proposer):
            await warm_up(self.requests, self.tok(), self.say)
        self.healer.watch()

    async def stop(self) -> None:
        await self.healer.stop()  # the watcher and any rebuild; its build tears down what it spawned
        await self.speculation.stop()
        await self.routes.stop()

    # -- Backend -------------------------------------------------------------------------

    @property
    def speculative_acceptance(self) -> str:
        return self.speculation.acceptance

    def tok(self) -> Tokenizer:
        assert self.routes.tokenizer is not None, "coordinator not started"
        return self.routes.tokenizer

    async def health(self) -> Health:
        await self.routes.refresh_stages()
        pipeline, route = self.routes.pipeline, self.routes.route
        broken = pipeline is None or pipeline.broken is not None
        failures = self.requests.failures
        failing = failures.failing()  # a route that serves, but whose generations fail
        return Health(ok=not broken and failing is None, model=self.model_id, route=describe(route),
                      stages=stage_rows(route, pipeline, self.settings.engine(0), self.routes.hops),
                      error=self.healer.last_error or failing or None,
                      internal_errors=failures.count,
                      last_internal_error=failures.last_line,
                      speculative=self.speculation.describe(),
                      draft_busy_s=self.speculation.draft.busy_s if self.speculation.draft else None,
                      recoveries=self.recoveries.count, sessions_resumed=self.recoveries.sessions,
                      last_recovery=self.recoveries.last)
