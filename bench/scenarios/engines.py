"""`mesh bench --scenarios engines`: the decode rate of each range engine, and of meshes that mix them.

Every stage of a mesh runs llama.cpp or MLX (`mesh serve --engine`), and both read the same
stage GGUF, so a mesh may mix them. Six meshes, all without the draft so the rate is the
engines' and not speculation's: the whole model on one stage, on llama.cpp and on MLX, and
each of the four two-stage pairs. Each is measured next to single-node llama.cpp: per repeat,
in an order that rotates to spread drift, every mesh decodes the prompts right after the
baseline does, so each mesh's ratio is to the baseline runs beside it. Time to first token is
the decode requests' own, on their short chat prompts: MLX on a CPU prefills about as fast as
it decodes, and a 512-token prompt would take it a minute a request.

Greedy replies are checked token by token against the baseline's. MLX's numbers differ from
llama.cpp's in the last bits (DESIGN.md §3), so at a near-tie it may pick the other token;
that is reported as the token where the reply parts, not treated as a failure.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.client import stream_chat
from bench.harness.harness import Asked, Baseline, Outcome, Row, ServeOptions, Setup, baseline_worker, serve
from stage.engine_choice import MLX_INSTALL, mlx_installed

# name -> the engine of each stage, stage 0 first
CONFIGS: dict[str, tuple[str, ...]] = {
    "llama": ("llama",), "mlx": ("mlx",),
    "llama→llama": ("llama", "llama"), "llama→mlx": ("llama", "mlx"),
    "mlx→llama": ("mlx", "llama"), "mlx→mlx": ("mlx", "mlx"),
}
SKIPPED = f"MLX rows skipped: mlx is not installed ({MLX_INSTALL})"


def runnable(mlx: bool) -> dict[str, tuple[str, ...]]:
    """The configurations this machine can run: without mlx, the llama.cpp ones only."""
    return {name: engines for name, engines in CONFIGS.items() if mlx or "mlx" not in engines}


def parting_token(expected: list[bytes], reply: str) -> int:
    """The 1-based index of the first of the baseline's tokens (their text, one piece each) the
    reply does not carry in its place; 0 when the reply is exactly those tokens. Compared as
    bytes, since a token may hold half a character."""
    got, at = reply.encode(), 0
    for i, piece in enumerate(expected, 1):
        if got[at : at + len(piece)] != piece:
            return i
        at += len(piece)
    return 0 if at == len(got) else len(expected) + 1  # longer than the baseline's: parts after its last


def first_parting(partings: list[int]) -> int:
    """The earliest token where any reply parts from the baseline's; 0 when every one is equal."""
    return min((p for p in partings if p), default=0)


def verdict(partings: list[int]) -> str:
    """"equal", or the earliest parting and how many of the replies part at all."""
    first, parted = first_parting(partings), sum(1 for p in partings if p)
    return f"parts at token {first} ({parted} of {len(partings)} replies part)" if first else "equal"


@dataclass
class Measured:
    """One mesh's samples, and the baseline's taken beside them."""

    tps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    base_tps: list[float] = field(default_factory=list)
    base_ttft: list[float] = field(default_factory=list)
    partings: list[int] = field(default_factory=list)  # per reply: 0, or the token where it parts


def engine_rows(setup: Setup, prompts: list[str], repeats: int) -> list[Row]:
    """Every mesh loaded at once (each is small, and an idle one takes no CPU), one request at a
    time across them all."""
    mlx = mlx_installed()
    if not mlx:
        print(f"bench: engines: {SKIPPED}", file=sys.stderr)
    configs = runnable(mlx)
    with tempfile.TemporaryDirectory(prefix="mesh-bench-engines-") as tmp, contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_worker(setup))
        # one lane: one stream at a time; no prefix cache: every TTFT prefills the whole prompt
        urls = {name: stack.enter_context(serve(setup, Path(tmp), len(engines),
                                                    ServeOptions(lanes=1, prefix_cache=False, engines=engines))).url
                for name, engines in configs.items()}
        record = _measure(setup, base, urls, prompts, repeats)
        chat = [base.tokenizer.render_chat([{"role": "user", "content": p}]) for p in prompts]
        prompt_tokens = statistics.median(len(base.tokenizer.tokenize(text)) for text in chat)
    return engine_table(record, setup.tokens, prompt_tokens) + ([] if mlx else [Row("engines", SKIPPED, 0.0)])


def _measure(setup: Setup, base: Baseline, urls: dict[str, str], prompts: list[str],
             repeats: int) -> dict[str, Measured]:
    expected = [[base.tokenizer.detokenize([t]) for t in base.chat(p, setup.tokens)["tokens"]] for p in prompts]
    for url in urls.values():  # a first request pays for lazy loading, on either engine
        stream_chat(url, setup.model_id, prompts[0], 2)
    record: dict[str, Measured] = defaultdict(Measured)
    names = list(urls)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            _beside_baseline(setup, base, urls[name], prompts, expected, record[name])
    return dict(record)


def _beside_baseline(setup: Setup, base: Baseline, url: str, prompts: list[str], expected: list[list[bytes]],
                     out: Measured) -> None:
    """Each prompt on the baseline and then on the mesh."""
    for prompt, pieces in zip(prompts, expected, strict=True):
        reply = base.chat(prompt, setup.tokens, fresh=True)
        out.base_tps.append(reply["decode_tps"])
        out.base_ttft.append(reply["ttft"])
        timing = stream_chat(url, setup.model_id, prompt, setup.tokens)
        out.tps.append(timing.decode_tps)
        out.ttft.append(timing.ttft)
        out.partings.append(parting_token(pieces, timing.text))


def engine_table(record: dict[str, Measured], tokens: int, prompt_tokens: float) -> list[Row]:
    every_base = [t for m in record.values() for t in m.base_tps]
    base = statistics.median(every_base)
    rows = [Row("engines baseline", "single-node llama.cpp decode tok/s", base, base, samples=every_base)]
    for name, m in record.items():
        sc = f"engines {name}"
        rows += [Row(sc, "decode tok/s (vs single-node llama.cpp beside it)", statistics.median(m.tps),
                     statistics.median(m.base_tps), samples=m.tps),
                 Row(sc, f"TTFT {prompt_tokens:g}-token chat prompt (s) (vs single-node llama.cpp)",
                     statistics.median(m.ttft), statistics.median(m.base_ttft), samples=m.ttft),
                 Row(sc, f"greedy reply of {tokens} tokens vs single-node llama.cpp's: {verdict(m.partings)} "
                         "(first parting token, 0: equal)", float(first_parting(m.partings)))]
    if "mlx" in record and "llama" in record:  # the engines alone, each running the whole model in a mesh
        rows.append(Row("engines mlx vs llama", "whole model on one stage, MLX decode tok/s (vs llama.cpp)",
                        statistics.median(record["mlx"].tps), statistics.median(record["llama"].tps)))
    return rows


def run(asked: Asked) -> Outcome:
    return Outcome(engine_rows(asked.setup, asked.prompts, asked.args.repeats))
