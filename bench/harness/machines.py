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

    def shared(self, n: int) -> list[tuple[str, list[int]]]:
        """The CPU sets that run more than one stage of a split-n, each with its stages."""
        groups = [(cpus, list(range(k, n, len(self.sets)))) for k, cpus in enumerate(self.sets)]
        return [(cpus, stages) for cpus, stages in groups if len(stages) > 1]

    def sharing(self, n: int) -> str:
        """Which stages of a split-n share a CPU set ("" when none do)."""
        return "; ".join(f"stages {', '.join(map(str, stages))} share CPUs {cpus}" for cpus, stages in self.shared(n))

    def describe(self, stages: list[int]) -> str:
        text = " | ".join(f"machine {k}: CPUs {cpus}" for k, cpus in enumerate(self.sets))
        shared = [f"split-{n}: {self.sharing(n)}" for n in stages if self.sharing(n)]
        return text + ("; SHARED CORES (contention, not a mesh): " + "; ".join(shared) if shared else "")
