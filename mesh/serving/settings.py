"""What serving reads of `mesh serve`'s settings: admission, a request's limits, resuming after
a break, the prefix cache, forced drafts and the warm-up. Routing's are in
mesh/routing/route.py (`RouteSettings`); `mesh serve` makes both from the same flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServingSettings:
    lanes: int  # sessions at once; more wait for a lane (mesh/serving/admission.py)
    ctx_size: int  # each session's context: prompt + max_tokens must fit
    max_queue: int | None = None  # requests that may wait for a lane; beyond them, 429 (None: any number)
    request_timeout_s: float | None = None  # a request's whole life, waits included (None: no limit)
    resume_s: float = 60.0  # how long a generation waits for a new route after a break (0: it fails)
    prefix_cache: bool = True  # a finished request's tokens stay in its lane for the next (DESIGN.md §2)
    forced_drafts: bool = True  # a grammar's forced tokens are proposed as drafts (mesh/speculative/forced.py)
    warm_up: bool = True  # a first generation at start when a cost-aware window chooses (mesh/serving/warm_up.py)
    cpu_lock: Path | None = None  # local stages take turns on shared cores: frames in flight cannot overlap
