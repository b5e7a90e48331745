"""Does watching the mesh slow it? Decode tok/s with and without open web-page event streams.

    python -m bench.ui_streams [--streams 20] [--pairs 5] [-- mesh serve flags...]

One `mesh serve` (three local stages by default); runs alternate between no watcher and
`--streams` clients reading /ui/events, so that a machine shared with other work loads
both alike. Each run is one streamed greedy request; its decode tok/s is the client's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
from pathlib import Path

import httpx

from bench.harness.client import stream_chat
from bench.harness.local_server import local_serve
from mesh.model.source import EMBEDDED_ID

PROMPT = "Write a Python function that returns the sum of a list of numbers, with a docstring and tests."


class Watchers:
    """`n` clients reading the event stream, as open pages do, until `close`."""

    def __init__(self, url: str, n: int) -> None:
        self.stop = threading.Event()
        self.events = 0
        self.threads = [threading.Thread(target=self._read, args=(url,), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, url: str) -> None:
        with httpx.stream("GET", f"{url}/ui/events", timeout=30) as r:
            for line in r.iter_lines():
                self.events += line.startswith("data: ")
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("serve", nargs="*", default=["--local-stages", "3", "--threads", "1"])
    args = p.parse_args()
    runs: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as tmp, local_serve(args.serve, Path(tmp)) as server:
        stream_chat(server.url, EMBEDDED_ID, PROMPT, args.tokens)  # warm: the prefix cache holds the prompt after
        for pair in range(args.pairs):
            for label in ("without", "with") if pair % 2 == 0 else ("with", "without"):
                watchers = Watchers(server.url, args.streams) if label == "with" else None
                tps = stream_chat(server.url, EMBEDDED_ID, PROMPT, args.tokens).decode_tps
                if watchers is not None:
                    watchers.close()
                runs[label].append(tps)
                print(f"{label:8} {args.streams if watchers else 0:3} streams: {tps:6.1f} tok/s"
                      + (f" ({watchers.events} events read)" if watchers else ""), flush=True)
    for label, values in runs.items():
        print(f"{label} streams: median {statistics.median(values):.1f} tok/s, "
              f"runs {', '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
