"""The single-node baseline for `mesh bench`: plain llama-cpp-python in a process of its own.

It reads one JSON request per line on stdin and answers one JSON line on stdout, so the
bench can interleave it with the mesh runs and read this process's own peak RSS.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

from mesh.reports.proc_memory import peak_rss
from stage.cpus import parse_cpus, pin
from stage.llama_model import open_llama


def _generate(llm: llama_cpp.Llama, tokens: list[int], n: int) -> dict[str, Any]:
    """Timings, and the reply's token ids so a mesh's reply can be checked against them."""
    start = time.perf_counter()
    times, reply = [], []
    for token in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter() - start)
        reply.append(int(token))
        if len(times) == n:
            break
    span = times[-1] - times[0]
    return {"ttft": times[0], "decode_tps": (len(times) - 1) / span if span > 0 else 0.0, "tokens": reply}


def main() -> None:
    gguf, ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:  # emulated machines: the baseline gets one stage's CPU set
        pin(parse_cpus(sys.argv[4]))
    # The same loader as the mesh: same extra buffer types, same attention kernels.
    llm = open_llama(Path(gguf), n_ctx=ctx, n_threads=threads, n_batch=256)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("fresh"):  # prefill the whole prompt: generate() reuses a common prefix, reset or not
            llm.reset()
        reply = {"peak_rss": peak_rss()} if req.get("memory") else _generate(llm, req["tokens"], req["n"])
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
