"""Every proposer meshpipe speculates with, listed once (issue 56).

Each entry says what the rest of the mesh reads of a proposer: its name (how usage, /metrics
and the page count its windows), where it runs, what it needs, and its window under a plan
(None where the plan leaves it out). Serving builds a session's window controllers from the
list, observe counts the proposers on it, and nothing outside mesh/speculative/ names one:
a new proposer is an entry here, its own module, its plan and the stage that hosts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh.speculative.draft import DRAFT
from mesh.speculative.forced import FORCED
from mesh.speculative.mtp import MTP
from mesh.speculative.ngram import NGRAM
from mesh.speculative.plan import SpecPlan
from packages.speculative import WindowPolicy


@dataclass(frozen=True)
class ProposerKind:
    name: str  # in usage.speculative.by_proposer, /metrics and the page
    runs: str  # where it proposes
    needs: str  # what it proposes from
    window: Callable[[SpecPlan], WindowPolicy | None]  # its window controller's policy; None: not in the plan
    windowed: bool = True  # a window controller sizes its proposals (forced tokens are as many as the grammar forces)


def _ngram_window(plan: SpecPlan) -> WindowPolicy | None:
    return plan.ngram.window if plan.ngram is not None else None


def _draft_window(plan: SpecPlan) -> WindowPolicy | None:
    return plan.window if plan.draft_model is not None else None


def _mtp_window(plan: SpecPlan) -> WindowPolicy | None:
    return plan.mtp


def _no_window(_: SpecPlan) -> WindowPolicy | None:
    return None


# The page lists them in this order. They are asked forced tokens first, then prompt lookup,
# then the draft model (mesh/serving/proposals.py, mesh/speculative/proposer.py `Combined`).
PROPOSERS: tuple[ProposerKind, ...] = (
    ProposerKind(DRAFT, "stage 0", "a draft model with the target's vocabulary", _draft_window),
    ProposerKind(MTP, "the final stage", "the model's own MTP (nextn) layers and the trunk's last hidden state",
                 _mtp_window),
    ProposerKind(NGRAM, "stage 0", "the request's own tokens (prompt lookup)", _ngram_window),
    ProposerKind(FORCED, "stage 0", "a constrained request's grammar, where it allows one continuation", _no_window,
                 windowed=False),
)
BY_NAME = {kind.name: kind for kind in PROPOSERS}


def windows(plan: SpecPlan) -> dict[str, WindowPolicy]:
    """Each windowed proposer the plan uses, with its window's policy."""
    return {k.name: w for k in PROPOSERS if k.windowed and (w := k.window(plan)) is not None}


def counted() -> tuple[str, ...]:
    """The proposers whose windows /metrics and the page count, by name."""
    return tuple(k.name for k in PROPOSERS if k.windowed)


def windowed(name: str) -> bool:
    """Whether a window controller sized this proposer's drafts (unknown names: no)."""
    kind = BY_NAME.get(name)
    return kind is not None and kind.windowed
