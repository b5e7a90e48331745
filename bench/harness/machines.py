"""`mesh bench --machines`: every local stage on its own CPU set, as if on its own machine.

Each stage process is pinned to one set (`mesh serve --stage-cpus`), runs one engine thread
per CPU of it and takes no CPU lock; the baseline runs on the first set. With more stages
than sets, stages share sets round-robin, and the bench says so: stages on shared cores
measure contention, not a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage.cpus import available_cpus, parse_cpus


@dataclass(frozen=True)
class Machines:
    sets: tuple[str, ...]  # CPU lists such as "0" or "2-3", one per emulated machine

    @classmethod
    def parse(cls, sets: list[str] | None) -> Machines:
        """The sets given, checked; by default each CPU this process may use is a machine."""
        chosen = tuple(sets) if sets else tuple(str(c) for c in sorted(available_cpus()))
        for cpus in chosen:
            parse_cpus(cpus)
        return cls(chosen)

    @property
    def threads(self) -> int:
        """Engine threads of the baseline: one per CPU of the first set, as each stage runs."""
        return len(parse_cpus(self.sets[0]))

    def for_stages(self, n: int) -> list[str]:
        return [self.sets[i % len(self.sets)] for i in range(n)]

    def sharing(self, n: int) -> str:
        """Which stages of a split-n share a CPU set ("" when none do)."""
        notes = []
        for k, cpus in enumerate(self.sets):
            stages = list(range(k, n, len(self.sets)))
            if len(stages) > 1:
                notes.append(f"stages {', '.join(map(str, stages))} share CPUs {cpus}")
        return "; ".join(notes)

    def describe(self, stages: list[int]) -> str:
        text = " | ".join(f"machine {k}: CPUs {cpus}" for k, cpus in enumerate(self.sets))
        shared = [f"split-{n}: {self.sharing(n)}" for n in stages if self.sharing(n)]
        return text + ("; SHARED CORES (contention, not a mesh): " + "; ".join(shared) if shared else "")
