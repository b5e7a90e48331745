"""Where frames spend their time on the way through the mesh, summed since start.

Each stage stamps a Hop on the frames it runs (queue, compute, codec, sample, on its own
clock). Stage 0 adds its own and times the round trip; what the round trip holds beyond
the downstream stages' sums is wire: sockets, framing, relaying replies, and the event
loops between them. `/metrics` exports the sums; `mesh bench --breakdown` divides them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from proto import meshpipe_pb2 as pb

PARTS = ("queue", "compute", "codec", "sample")
WIRE = ("links", "wire")
KINDS: dict[int, str] = {pb.PREFILL: "prefill", pb.DECODE: "decode", pb.VERIFY: "verify"}  # a frame's last chunk


def hop_parts(hop: pb.Hop) -> dict[str, float]:
    """A hop's parts in seconds: each PARTS name has a `<name>_us` field in pb.Hop."""
    return {part: getattr(hop, f"{part}_us") / 1e6 for part in PARTS}


@dataclass
class HopTotals:
    """Sums per frame kind: a verify window and a plain decode cost differently."""

    frames: dict[str, int] = field(default_factory=dict)  # kind -> frames
    seconds: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (kind, stage, part) -> s
    batch_rows: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, stage) -> rows, summed
    # what stage 0 sent: rows fed in frames, those of frames voided before their reply counted
    # (sent ahead past a rejected draft, or out when a request ended: stale work), and the
    # activation bytes down its link, which every later link carries as well
    rows_sent: int = 0
    rows_voided: int = 0
    bytes_sent: int = 0
    late_replies: int = 0  # frames still unanswered at their deadline while the stages worked on

    def record(self, kind: int, own: pb.Hop, downstream: Iterable[pb.Hop] = (), round_trip_s: float = 0.0) -> None:
        """Add one frame: stage 0's hop, the hops its reply carried, and the round trip."""
        name = KINDS.get(kind, "other")
        self.frames[name] = self.frames.get(name, 0) + 1
        self._add(name, own)
        spent = 0.0
        for hop in downstream:
            spent += self._add(name, hop)
        if round_trip_s:
            self._bump((name, *WIRE), max(round_trip_s - spent, 0.0))

    def _add(self, kind: str, hop: pb.Hop) -> float:
        key = (kind, str(hop.stage_index))
        self.batch_rows[key] = self.batch_rows.get(key, 0) + hop.batch_rows
        parts = hop_parts(hop)
        for part, seconds in parts.items():
            self._bump((*key, part), seconds)
        return sum(parts.values())

    def _bump(self, key: tuple[str, str, str], seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
