"""The /health answer: built by the coordinator, served as JSON, read back by `mesh status` and the bench.

One model on both sides of the wire, so the server and its readers cannot drift apart: a
key renamed here is renamed everywhere, and a reader never guesses at a shape.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# READY: serving. BROKEN: the pipeline failed a request and the route is being rebuilt.
# UNREACHABLE: the stage did not answer its last Status call (the pipeline may still work).
StageState = Literal["READY", "BROKEN", "UNREACHABLE"]


class _Frozen(BaseModel):
    # strict: no silent coercion of the server's values; forbid: a key the model does not
    # know means the server and this reader are different versions, which should be loud
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class TierHealth(_Frozen):
    """A stage's KV tier (DESIGN.md §2): what it holds and how often it served."""

    hits: int
    misses: int
    ram_bytes: int
    disk_bytes: int
    ram_limit: int
    disk_limit: int


class ClaimHealth(_Frozen):
    """A coordinator's claim on a stage: several coordinators may share one (DESIGN.md §4)."""

    coordinator: str
    this: bool  # the claim of the coordinator that answers
    start: int  # the layer range it runs there
    end: int
    lanes: int  # granted to it on that range's engine
    lanes_in_use: int


class StageHealth(_Frozen):
    """One stage of the route; stage 0 is the coordinator itself."""

    stage: int
    endpoint: str
    start: int | None  # the layer range [start, end)
    end: int | None
    state: StageState
    rss_bytes: int | None  # from the stage's last Status reply; None before the first
    mem_available_bytes: int | None
    status_at: float  # wall time of that reply (0.0 before the first)
    # engine seconds spent computing since the route was built, as of status_at; its growth
    # over a while, divided by that while, is the stage's busy fraction (stage 0: its layers)
    busy_s: float | None = None
    engine: str | None = None  # "llama" or "mlx"; None before the stage's first Status reply
    # time per decode: predicted from the stage's Load calibration for decodes as large as the
    # measured ones (DESIGN.md §3), and measured from the hop timings (compute, codec and
    # sampling per decode frame, no queue); None without a calibration or before any decode
    predicted_ms: float | None = None
    measured_ms: float | None = None
    link_ms: float | None = None  # round trip of the last Status call: the link to this stage
    # parameters of the stage's layers (and the output head at the final stage): all of them,
    # which it holds, and the active ones, which a decode multiplies; fewer only in a mixture
    # of experts (packages/parameters.py). None before the route is planned
    parameters: int | None = None
    active_parameters: int | None = None
    kv_tier: TierHealth | None = None  # None: it keeps none
    claims: tuple[ClaimHealth, ...] = ()  # every coordinator's on the stage, as of status_at


class RecoveryHealth(_Frozen):
    """The last route recovery: what broke it, how long the break went unnoticed, and how
    long until a new route served (DESIGN.md §2, replay-resume)."""

    cause: str
    detect_s: float
    resume_s: float
    at: float  # wall time the new route served


class Health(_Frozen):
    """What the coordinator serves at /health; HTTP 200 when `ok`, else 503."""

    # false while the route is broken, or while generations fail in a row with internal errors
    # (mesh/reports/failures.py); an UNREACHABLE stage alone leaves it true
    ok: bool
    model: str
    route: str
    stages: tuple[StageHealth, ...]
    error: str | None
    speculative: str  # the draft and window policy, or why speculation is off
    draft_busy_s: float | None = None  # the draft's engine seconds, on stage 0's engine thread too
    recoveries: int = 0  # route rebuilds after a break, since start
    sessions_resumed: int = 0  # generations that went on through one
    last_recovery: RecoveryHealth | None = None
    internal_errors: int = 0  # requests that failed inside the server (HTTP 500), since start: /metrics' count
    last_internal_error: str | None = None  # the latest: its request id, cause and message

