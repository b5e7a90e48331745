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


def hop_parts(hop: pb.Hop) -> dict[str, float]:
    """A hop's parts in seconds: each PARTS name has a `<name>_us` field in pb.Hop."""
    return {part: getattr(hop, f"{part}_us") / 1e6 for part in PARTS}


@dataclass
class HopTotals:
    frames: int = 0
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)  # (stage, part) -> s
    batch_rows: dict[str, int] = field(default_factory=dict)  # stage -> rows of the decodes, summed

    def record(self, own: pb.Hop, downstream: Iterable[pb.Hop] = (), round_trip_s: float = 0.0) -> None:
        """Add one frame: stage 0's hop, the hops its reply carried, and the round trip."""
        self.frames += 1
        self._add(own)
        spent = 0.0
        for hop in downstream:
            spent += self._add(hop)
        if round_trip_s:
            self._bump(WIRE, max(round_trip_s - spent, 0.0))

    def _add(self, hop: pb.Hop) -> float:
        stage = str(hop.stage_index)
        self.batch_rows[stage] = self.batch_rows.get(stage, 0) + hop.batch_rows
        parts = hop_parts(hop)
        for part, seconds in parts.items():
            self._bump((stage, part), seconds)
        return sum(parts.values())

    def _bump(self, key: tuple[str, str], seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
