"""`mesh bench --scenarios ngram`: the prompt-lookup (n-gram) proposer on copy-heavy and novel text.

A prompt-lookup proposal costs nothing to make, so it should pay wherever the reply copies
its context and cost nothing where it does not. Two workloads show both sides: rewriting a
given function with one identifier renamed (the reply copies most of the prompt), and a
story with nothing to copy. At each per-hop delay, four split-2 servers decode both,
interleaved: no speculation, `--strategy ngram`, `--strategy ngram+draft` (the n-gram first,
the package's draft where it has no match) and the package's draft alone. Replies end at
EOS, as a real client's would: a copy ends where the function does, and a story decoded past
its end would be the model repeating itself, which n-gram lookup predicts and novel text
does not. Speculation must not change the reply (greedy, and sampled with a seed), so all four decode the same tokens.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness.client import StreamTiming, stream_messages
from bench.harness.harness import Asked, Outcome, Row, Setup, split2_per_delay
from bench.harness.report import proposer_totals
from bench.harness.workloads import COPY_FUNCTION, COPY_PROMPT, RENAME
from mesh.model.tokenizer import Tokenizer
from mesh.speculative.ngram import lookup

WORKLOADS = {
    "copy-heavy": COPY_PROMPT,
    # Of the prompts tried, the one SmolLM2 answers longest without repeating itself (a 3-gram
    # lookup predicts 1% of its first 192 tokens, 11% of 256): a looping story is not novel text.
    "novel": "Describe a day in the life of a beekeeper in the mountains, in the first person.",
}
# Greedy, SmolLM2's story soon repeats itself: 45% of a 192-token reply, 66% of 320, was
# predictable by a 3-gram lookup, and prompt lookup on "novel" text must not be measured on
# that. Sampled with a seed it stays novel, and every mode still draws the same tokens (the
# final stage keys its draws by seed and position, DESIGN.md §9).
SAMPLING = {"novel": {"temperature": 0.8, "top_p": 0.95, "seed": 7}}
MOST_TOKENS = {"novel": 192}  # whatever --tokens says
# mode -> serve() keywords; "none" first: every other mode is measured against it
LOOKUP_MODES: dict[str, dict[str, Any]] = {"none": {}, "ngram": {"strategy": "ngram"},
                                           "ngram+draft": {"strategy": "ngram+draft"}, "draft": {"draft": True}}
LOOKUP_N = 3  # n-gram length of the predictability row: the proposer's own is the package's to choose


def ngram_goal(workload: str, delay: float) -> str:
    """The issue's goals for n-gram over no speculation."""
    if workload == "copy-heavy":
        return ">= 3.0" if delay >= 20 else ">= 1.5" if delay == 0 else ""
    return ">= 0.97" if delay == 0 else ""


def lookup_share(context: list[int], output: list[int], n: int = LOOKUP_N) -> float:
    """Share of `output` that prompt lookup would have guessed: tokens equal to the one that
    followed the latest earlier occurrence of the n tokens before them (prompt and output)."""
    seq = np.asarray([*context, *output], dtype=np.int64)
    # the proposer's own matcher, at one length and one token
    hits = sum(lookup(seq[:i], n, n, 1) == [seq[i]] for i in range(len(context), len(seq)))
    return hits / len(output) if output else 0.0


def copied_lines(function: str, reply: str) -> float:
    """Share of the function's lines found whole in the reply, renamed or not."""
    wanted = [line.strip() for line in function.splitlines() if line.strip()]
    got = {line.strip() for line in reply.splitlines()}
    return sum(line in got or line.replace(*RENAME) in got for line in wanted) / len(wanted)


@dataclass
class LookupRecord:
    """Per (mode, workload): every request's timing, over all repeats."""

    timings: dict[tuple[str, str], list[StreamTiming]] = field(default_factory=lambda: defaultdict(list))

    def tps(self, mode: str, workload: str) -> list[float]:
        return [t.decode_tps for t in self.timings[(mode, workload)]]

    def identical(self) -> bool:
        return all(t.text == ref.text for (mode, wl), ts in self.timings.items()
                   for t, ref in zip(ts, self.timings[("none", wl)], strict=True))


def ngram_rows(setup: Setup, delays: list[float], repeats: int) -> list[Row]:
    """One delay at a time: four servers per delay is what fits beside nothing else."""
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    rows = []
    for d, urls in split2_per_delay(setup, "mesh-bench-ngram-", delays, LOOKUP_MODES):
        record = _measure(setup, urls, repeats)
        group = lookup_table(f"ngram split-2 {d:g} ms", d, record)
        group += _workload_rows(f"ngram split-2 {d:g} ms", tokenizer, record)
        rows += sorted(group, key=lambda r: r.scenario)  # stable: each workload's rows together, in order
    return rows


def _measure(setup: Setup, urls: dict[str, str], repeats: int) -> LookupRecord:
    """Every mode on every workload per repeat; the mode order rotates to spread drift."""
    record = LookupRecord()
    modes = list(urls)
    for rep in range(repeats):
        for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
            for workload, prompt in WORKLOADS.items():
                messages = [{"role": "user", "content": prompt}]
                record.timings[(mode, workload)].append(
                    stream_messages(urls[mode], setup.model_id, messages,
                                    min(setup.tokens, MOST_TOKENS.get(workload, setup.tokens)), ignore_eos=False,
                                    sampling=SAMPLING.get(workload)))
    return record


def lookup_table(scenario: str, delay: float, record: LookupRecord) -> list[Row]:
    rows = []
    for workload in WORKLOADS:
        sc = f"{scenario} {workload}"
        tps = {mode: record.tps(mode, workload) for mode in LOOKUP_MODES}
        med = {mode: statistics.median(values) for mode, values in tps.items()}
        rows += [Row(sc, "no speculation decode tok/s", med["none"], samples=tps["none"]),
                 Row(sc, "n-gram tok/s (vs none)", med["ngram"], med["none"], ngram_goal(workload, delay),
                     tps["ngram"]),
                 Row(sc, "n-gram + draft tok/s (vs none)", med["ngram+draft"], med["none"],
                     samples=tps["ngram+draft"]),
                 Row(sc, "draft tok/s (vs none)", med["draft"], med["none"], samples=tps["draft"]),
                 Row(sc, "n-gram + draft (vs the better alone)", med["ngram+draft"], max(med["ngram"], med["draft"]))]
        for mode in ("ngram", "ngram+draft", "draft"):
            rows += _accept_rows(sc, mode, record.timings[(mode, workload)])
    same = "outputs identical to no speculation (greedy; novel: seeded sampling) (1 = yes)"
    return [*rows, Row(scenario, same, float(record.identical()), goal="1")]


def _accept_rows(scenario: str, mode: str, timings: list[StreamTiming]) -> list[Row]:
    """The accept rate; for a combined mode, each proposer's, and its share of what was accepted."""
    stats = [t.speculative for t in timings if t.speculative]
    proposed, accepted = sum(s.proposed for s in stats), sum(s.accepted for s in stats)
    if not proposed:  # a rate of nothing: say so rather than print a 0 that reads as all refused
        return [Row(scenario, f"{mode}: accept rate (nothing proposed)", 0.0)]
    rows = [Row(scenario, f"{mode}: accept rate", accepted / proposed)]
    if "+" not in mode:  # one proposer: its breakdown is the line above
        return rows
    for name, (p, a) in sorted(proposer_totals([t.by_proposer for t in timings]).items()):
        rows += [Row(scenario, f"{mode}: {name} accept rate", a / p if p else 0.0),
                 Row(scenario, f"{mode}: {name} share of accepted tokens", a / accepted if accepted else 0.0)]
    return rows


def _workload_rows(scenario: str, tokenizer: Tokenizer, record: LookupRecord) -> list[Row]:
    """What the workloads were, from the first reply without speculation: a copy-heavy reply
    that does not copy, or a novel one that repeats itself, would make its row meaningless."""
    rows = []
    for workload, prompt in WORKLOADS.items():
        reply = record.timings[("none", workload)][0]
        context = tokenizer.tokenize(tokenizer.render_chat([{"role": "user", "content": prompt}]))
        share = lookup_share(context, tokenizer.tokenize(reply.text, False, add_bos=False))
        rows.append(Row(f"{scenario} {workload}", f"reply tokens a {LOOKUP_N}-gram lookup predicts (share)", share))
        rows.append(Row(f"{scenario} {workload}", "reply tokens", float(reply.completion_tokens)))
    copy = record.timings[("none", "copy-heavy")][0].text
    return [*rows, Row(f"{scenario} copy-heavy", "function lines copied whole (share)",
                       copied_lines(COPY_FUNCTION, copy))]


def run(asked: Asked) -> Outcome:
    return Outcome(ngram_rows(asked.setup, asked.delays, asked.args.repeats))
