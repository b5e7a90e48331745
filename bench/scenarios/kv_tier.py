"""`mesh bench --scenarios kvtier`: many conversations on few lanes, with the KV tier and without (issue 57).

Sixteen chat sessions of four turns each go round robin (every session's turn 1, then every
session's turn 2, ...) to servers of `--lanes 4`, so each turn finds its session's lane taken by
another. Each session opens with its own ~600-token system prompt (a generated ledger whose first
word differs from every other session's), asks short questions, and keeps the real greedy replies
(EOS ends them, `--tokens` bounds them, 16 alone) in its history. TTFT is a streaming client's.

1. Split-2 without a draft, two servers, interleaved request by request: one with the tier
   (`--cache-ram 2GiB --cache-disk 4GiB`, its own cache dir) and one with lanes only
   (`--cache-ram 0 --cache-disk 0`, what serving did before issue 57). Mean TTFT of turns 2-4 ÷
   mean turn-1 TTFT (goal for the tier: <= 0.25); every tier reply must equal lanes-only's.
2. The tier server is stopped (SIGTERM to every process) and started again with the same flags,
   cache dir and port, and each session asks a 5th turn of it and of the lanes-only server: its
   TTFT ÷ that session's turn-1 TTFT (goal: <= 0.35), the replies again equal.
3. On one node, in the same loop: meshpipe (`--local-stages 1 --lanes 4 --cache-ram 2GiB`)
   against llama-server (`-np 4 --cache-ram 2048`, its host-memory prompt cache) on the same
   whole-model GGUF: meshpipe's mean TTFT of turns 2-4 ÷ llama-server's (goal: <= 1.2). Without
   llama-server (`--llama-cpp-bin`, else MESH_LLAMA_CPP_BIN) this part says it was skipped.

Both split-2 servers cut on parameters, so the restarted one cuts where it did before: the tier's
files are named by the range each stage holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import llama_cpp
from bench.harness.client import mesh_cuts, stream_messages
from bench.harness.harness import Asked, Outcome, Row, ServeOptions, Setup, serve
from bench.harness.llama_cpp import Binaries, ServerSpec
from bench.harness.local_server import LocalServer, free_port
from bench.harness.report import met
from mesh.cli.bearer import auth_headers
from mesh.model.tokenizer import Tokenizer

SESSIONS, TURNS, LANES = 16, 4, 4  # turns before the restart; one more after it
SYSTEM_TOKENS = 600
TIER2, LANES2 = "meshpipe split-2, tier", "meshpipe split-2, lanes only"
MESH1, LLAMA1 = "meshpipe 1 node, tier", "llama-server 1 node"
SERVERS = (TIER2, LANES2, MESH1, LLAMA1)
SPLIT, RESTART, ONE_NODE = "kvtier split-2", "kvtier restart", "kvtier 1 node"
GOAL_LATER, GOAL_RESTART, GOAL_PEER = "<= 0.25", "<= 0.35", "<= 1.2"
SPLIT_FLAGS = ("--cut-on", "parameters")  # a restart cuts where the first start did
FLAGS = {TIER2: ("--cache-ram", "2GiB", "--cache-disk", "4GiB"), LANES2: ("--cache-ram", "0", "--cache-disk", "0"),
         MESH1: ("--cache-ram", "2GiB")}
LLAMA_FLAGS = ("--cache-ram", "2048")  # MiB: llama-server's host-memory prompt cache
TOPICS = ("Harbor", "Forest", "Desert", "Mountain", "River", "Island", "Valley", "Canyon", "Glacier", "Meadow",
          "Prairie", "Tundra", "Marsh", "Coast", "Plateau", "Lagoon")
PLACES = ("north gate", "east dock", "south field", "west mill", "old bridge", "upper road", "lower yard")
GOODS = ("crates of apples", "barrels of oil", "sacks of flour", "bundles of wool", "baskets of fish", "boxes of nails")
SKIES = ("clear", "cloudy", "rainy", "windy", "foggy")
QUESTIONS = ("What is this ledger about?", "Which place appears most often?", "What goods were logged?",
             "Was the weather mostly good?", "Give the ledger a short title.")
Key = tuple[int, int, int]  # (repeat, session, turn), turn from 0


def ledger(repeat: int, session: int, count: Callable[[str], int], tokens: int = SYSTEM_TOKENS) -> str:
    """Session `session`'s system prompt in repeat `repeat`: at least `tokens` as `count` counts,
    its first word its own (TOPICS), its numbers by formula, so a run is the same every time."""
    lines = [f"{TOPICS[session % len(TOPICS)]} station ledger, volume {repeat + 1}, kept by clerk {session + 1}."]
    n = 0
    while count("\n".join(lines)) < tokens:
        k = n + 7 * session + 13 * repeat
        amount, kept = 10 + (k * 7) % 90, 1 + (k * 3) % 9
        lines.append(f"Entry {n + 1}: the {PLACES[k % len(PLACES)]} logged {amount} {GOODS[k % len(GOODS)]} at "
                     f"{6 + k % 12:02d}:{(k * 11) % 60:02d}, {kept} kept and {amount - kept} sent on; the sky was "
                     f"{SKIES[k % len(SKIES)]}.")
        n += 1
    return "\n".join(lines)


def openings(repeat: int, count: Callable[[str], int], sessions: int = SESSIONS) -> list[list[dict[str, str]]]:
    """Each session's opening: its own ledger as the system message."""
    return [[{"role": "system", "content": f"{ledger(repeat, s, count)}\n\nAnswer questions about this ledger "
                                           "briefly."}] for s in range(sessions)]


def question(turn: int) -> dict[str, str]:
    return {"role": "user", "content": QUESTIONS[turn]}


def round_robin(sessions: int, turns: Sequence[int]) -> list[tuple[int, int]]:
    """(turn, session) in the order they are asked: every session's turn, then the next turn."""
    return [(turn, s) for turn in turns for s in range(sessions)]


def rotated(names: Sequence[str], step: int) -> list[str]:
    """Who goes first at each step, in turn."""
    k = step % len(names) if names else 0
    return [*names[k:], *names[:k]]


def kv_ctx(tokens: int) -> int:
    """A session's context: its ledger, five questions and replies of up to `tokens`, and slack
    for the template; never below `mesh serve`'s default."""
    need = SYSTEM_TOKENS + (TURNS + 1) * (tokens + 48) + 256
    return max(2048, -(-need // 256) * 256)


@dataclass(frozen=True)
class Reply:
    ttft: float
    text: str
    cached: int | None = None  # prompt tokens the server says it reused


@dataclass
class Record:
    """Every reply by server and key; the tier server's counters before and after its restart."""

    replies: dict[str, dict[Key, Reply]] = field(default_factory=lambda: {s: {} for s in SERVERS})
    counters: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {"before": [], "after": []})
    notes: list[str] = field(default_factory=list)

    def ttfts(self, server: str, turns: Sequence[int]) -> list[float]:
        return [r.ttft for (_, _, t), r in self.replies[server].items() if t in turns]

    def cached(self, server: str, turns: Sequence[int]) -> list[float]:
        return [float(r.cached) for (_, _, t), r in self.replies[server].items() if t in turns and r.cached is not None]


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def restart_ratios(record: Record, server: str, turn: int = TURNS) -> list[float]:
    """Each session's TTFT at `turn` ÷ its own turn-1 TTFT."""
    got = record.replies[server]
    return [reply.ttft / got[(rep, s, 0)].ttft for (rep, s, t), reply in got.items()
            if t == turn and (rep, s, 0) in got and got[(rep, s, 0)].ttft > 0]


def differing(record: Record, a: str, b: str, turns: Sequence[int]) -> tuple[int, int]:
    """(replies that differ, replies compared) between two servers at these turns."""
    ra, rb = record.replies[a], record.replies[b]
    both = [k for k in ra if k in rb and k[2] in turns]
    return sum(ra[k].text != rb[k].text for k in both), len(both)


def tier_counts(metrics: str) -> dict[str, float]:
    """The tier's counters at a coordinator's /metrics, summed over stages: hits by tier
    ("hits ram", "hits disk"), "misses", "saved", "refills", and the seconds restoring and saving
    took, every stage's added up."""
    counts: dict[str, float] = {}
    names = {"meshpipe_kv_tier_hits": "hits", "meshpipe_kv_tier_misses": "misses",
             "meshpipe_kv_tier_saved": "saved", "meshpipe_kv_tier_refills": "refills",
             "meshpipe_kv_tier_restore_seconds": "restore seconds", "meshpipe_kv_tier_save_seconds": "save seconds"}
    for family in text_string_to_metric_families(metrics):
        if (name := names.get(family.name)) is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = f"{name} {sample.labels['tier']}" if "tier" in sample.labels else name
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def later_rows(record: Record) -> list[Row]:
    """Part 1: split-2, tier against lanes only, turns 2-4 against turn 1."""
    rows = []
    for server in (TIER2, LANES2):
        first, later = record.ttfts(server, [0]), record.ttfts(server, range(1, TURNS))
        if not first or not later:
            continue
        rows += [Row(SPLIT, f"turn 1 TTFT, {server} (s)", statistics.fmean(first), samples=first),
                 Row(SPLIT, f"turns 2-{TURNS} TTFT, {server} (s) (vs its turn 1)", statistics.fmean(later),
                     statistics.fmean(first), GOAL_LATER if server == TIER2 else "", later)]
        if cached := record.cached(server, range(1, TURNS)):
            rows.append(Row(SPLIT, f"turns 2-{TURNS} cached prompt tokens, {server}", statistics.fmean(cached)))
    diff, of = differing(record, TIER2, LANES2, range(TURNS))
    if of:
        rows.append(Row(SPLIT, f"replies differing, tier vs lanes only, turns 1-{TURNS} (of {of})", diff,
                        goal="== 0"))
    rows += [Row(SPLIT, f"tier {name}, turns 1-{TURNS}", value)
             for counts in record.counters["before"][-1:] for name, value in sorted(counts.items())]
    return rows


def restart_rows(record: Record) -> list[Row]:
    """Part 2: a 5th turn after the tier server's restart, against each session's turn 1."""
    rows = []
    for server in (TIER2, LANES2):
        ratios = restart_ratios(record, server)
        if not ratios:
            continue
        fifth = record.ttfts(server, [TURNS])
        tier = server == TIER2
        rows += [Row(RESTART, f"turn {TURNS + 1} TTFT, {server}{' after its restart' if tier else ''} (s)",
                     statistics.fmean(fifth), samples=fifth),
                 Row(RESTART, f"turn {TURNS + 1} ÷ its session's turn 1, {server} (mean of sessions)",
                     statistics.fmean(ratios), goal=GOAL_RESTART if tier else "", samples=ratios),
                 Row(RESTART, f"turn {TURNS + 1} ÷ its session's turn 1, {server} (worst session)", max(ratios))]
    if cached := record.cached(TIER2, [TURNS]):
        rows.append(Row(RESTART, f"turn {TURNS + 1} cached prompt tokens, {TIER2}", statistics.fmean(cached)))
    diff, of = differing(record, TIER2, LANES2, [TURNS])
    if of:
        rows.append(Row(RESTART, f"turn {TURNS + 1} replies differing, tier after restart vs lanes only (of {of})",
                        diff, goal="== 0"))
    rows += [Row(RESTART, f"tier {name}, turn {TURNS + 1} after the restart", value)
             for counts in record.counters["after"][-1:] for name, value in sorted(counts.items())]
    return rows


def one_node_rows(record: Record) -> list[Row]:
    """Part 3: meshpipe on one node with the tier against llama-server with its prompt cache."""
    rows = []
    for server in (MESH1, LLAMA1):
        if first := record.ttfts(server, [0]):
            rows.append(Row(ONE_NODE, f"turn 1 TTFT, {server} (s)", statistics.fmean(first), samples=first))
    mesh, llama = record.ttfts(MESH1, range(1, TURNS)), record.ttfts(LLAMA1, range(1, TURNS))
    if llama:
        rows.append(Row(ONE_NODE, f"turns 2-{TURNS} TTFT, {LLAMA1} (s)", statistics.fmean(llama), samples=llama))
    if mesh:
        rows.append(Row(ONE_NODE, f"turns 2-{TURNS} TTFT, {MESH1} (s) (vs llama-server)", statistics.fmean(mesh),
                        mean(llama), GOAL_PEER if llama else "", mesh))
    diff, of = differing(record, MESH1, LLAMA1, range(TURNS))
    if of:  # not a goal: the two render the chat template each their own way
        rows.append(Row(ONE_NODE, f"replies differing, meshpipe vs llama-server (of {of})", diff))
    return rows


def kv_rows(record: Record) -> list[Row]:
    return later_rows(record) + restart_rows(record) + one_node_rows(record)


def kv_table(record: Record, rows: list[Row]) -> str:
    """Mean TTFT per server and turn, then each goal met or not, then the notes."""
    fmt: Callable[[float | None], str] = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
    turns = range(TURNS + 1)
    lines = [f"kvtier: mean TTFT (s) by turn, {SESSIONS} sessions round robin on {LANES} lanes", "",
             "| server | " + " | ".join(f"turn {t + 1}" for t in turns) + " |", "|---" * (len(turns) + 1) + "|"]
    lines += [f"| {server} | " + " | ".join(fmt(mean(record.ttfts(server, [t]))) for t in turns) + " |"
              for server in SERVERS if record.replies[server]]
    lines += ["", "| goal | value | met |", "|---|---|---|"]
    for row in rows:
        if not row.goal:
            continue
        value = row.ratio if row.ratio is not None else row.value
        verdict = met(row.goal, value)
        lines.append(f"| {row.scenario}: {row.metric} {row.goal} | {value:.3f} | "
                     f"{'met' if verdict else 'not met'} |")
    return "\n".join(lines + [f"- {note}" for note in record.notes])


def llama_binaries(given: Binaries | None) -> tuple[Binaries | None, str]:
    """llama-server's directory (--llama-cpp-bin, else MESH_LLAMA_CPP_BIN), or why part 3 is skipped."""
    env = os.environ.get("MESH_LLAMA_CPP_BIN")
    bins = given or (Binaries(Path(env)) if env else None)
    if bins is None:
        return None, f"kvtier: skipped {LLAMA1}: no --llama-cpp-bin given and MESH_LLAMA_CPP_BIN unset " \
                     f"({llama_cpp.BUILD_HINT})"
    if not bins.server.is_file():
        return None, f"kvtier: skipped {LLAMA1}: {bins.server} is missing ({llama_cpp.BUILD_HINT})"
    return bins, ""


@dataclass
class Conversations:
    """What every server has been told so far: per server and session, the messages."""

    openings: list[list[dict[str, str]]]
    history: dict[tuple[str, int], list[dict[str, str]]] = field(default_factory=dict)

    def messages(self, server: str, session: int, turn: int) -> list[dict[str, str]]:
        return [*self.history.get((server, session), self.openings[session]), question(turn)]

    def answered(self, server: str, session: int, messages: list[dict[str, str]], text: str) -> None:
        self.history[(server, session)] = [*messages, {"role": "assistant", "content": text}]


@dataclass
class Restartable:
    """A `mesh serve` that can be stopped and started again at the same port and cache dir."""

    setup: Setup
    tmp: Path
    opts: ServeOptions
    server: LocalServer | None = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def start(self) -> str:
        self.server = self.stack.enter_context(serve(self.setup, self.tmp, 2, self.opts))
        return self.server.url

    def restart(self, grace: float = 300) -> str:
        """SIGTERM to every process, waiting for each to file its lanes and write its tier."""
        assert self.server is not None
        stop_all(self.server.process, grace)
        self.stack.close()
        self.stack = contextlib.ExitStack()
        return self.start()

    def close(self) -> None:
        self.stack.close()


def stop_all(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process group `proc` leads (a coordinator and its stages), then wait until
    every one of them has exited (zombies count as gone); SIGKILL past `grace` seconds."""
    procs = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or any(map(_running, procs))):
        time.sleep(0.2)
    if proc.poll() is None or any(map(_running, procs)):
        print(f"bench: the tier server's processes outlived {grace:g} s of SIGTERM: killed", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tier_cache(real: Path, tmp: Path) -> Path:
    """A cache dir of the tier server's own: links to everything the run's cache holds (packages,
    stage GGUFs) and to its CPU lock, so its stages take turns with the other servers' as they
    do with each other's; and a kv folder that nothing else writes."""
    own = tmp / "tier-cache"
    own.mkdir()
    for name in {entry.name for entry in real.iterdir()} - {"kv"} | {"cpu.lock"}:
        (own / name).symlink_to((real / name).resolve())  # the lock is made through its link if need be
    (own / "kv").mkdir()
    return own


def counters(url: str, settle: float = 2.5) -> dict[str, float]:
    """The tier's counters, once every stage's last Status has come in."""
    time.sleep(settle)
    return tier_counts(httpx.get(f"{url}/metrics", timeout=10, headers=auth_headers()).text)


def warm(url: str, model_id: str) -> None:
    """A first request pays for lazy loading: one short one, on a lane like any other."""
    stream_messages(url, model_id, [{"role": "user", "content": "Say hello."}], 2, ignore_eos=False)


@dataclass
class Servers:
    """Every server's URL by name, and the tier server, to restart."""

    urls: dict[str, str]
    tier: Restartable


def _ask(setup: Setup, urls: dict[str, str], talk: Conversations, at: tuple[int, int, int], record: Record) -> None:
    """One turn of one session on every server, who goes first rotating by step."""
    rep, session, turn = at
    step = session + turn * SESSIONS
    for server in rotated([s for s in SERVERS if s in urls], step):
        messages = talk.messages(server, session, turn)
        timing = stream_messages(urls[server], setup.model_id, messages, setup.tokens, ignore_eos=False)
        talk.answered(server, session, messages, timing.text)
        record.replies[server][(rep, session, turn)] = Reply(timing.ttft, timing.text, timing.cached_tokens)


def _repeat(setup: Setup, tokenizer: Tokenizer, servers: Servers, rep: int, record: Record) -> None:
    """Four turns round robin on every server; the tier server's restart; a 5th turn on split-2."""
    talk = Conversations(openings(rep, lambda text: len(tokenizer.tokenize(text, False))))
    if rep == 0:
        prompts = [tokenizer.tokenize(tokenizer.render_chat(talk.messages("", s, 0))) for s in range(SESSIONS)]
        record.notes.append(f"turn-1 prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; any two "
                            f"sessions share at most their first {shared_prefix(prompts)} (the template's)")
    for turn, session in round_robin(SESSIONS, range(TURNS)):
        if session == 0:
            print(f"bench: kvtier repeat {rep + 1}: turn {turn + 1} of {SESSIONS} sessions", file=sys.stderr)
        _ask(setup, servers.urls, talk, (rep, session, turn), record)
    record.counters["before"].append(counters(servers.urls[TIER2]))
    cuts = mesh_cuts(servers.urls[TIER2])
    servers.urls[TIER2] = servers.tier.restart()
    warm(servers.urls[TIER2], setup.model_id)
    if (again := mesh_cuts(servers.urls[TIER2])) != cuts:
        record.notes.append(f"repeat {rep + 1}: the restarted tier server cut at {again}, not {cuts}")
    split = {s: servers.urls[s] for s in (TIER2, LANES2)}
    print(f"bench: kvtier repeat {rep + 1}: turn {TURNS + 1} after the tier server's restart", file=sys.stderr)
    for session in range(SESSIONS):
        _ask(setup, split, talk, (rep, session, TURNS), record)
    record.counters["after"].append(counters(servers.urls[TIER2]))


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The longest prefix any two of these token lists share."""
    best = 0
    for i, a in enumerate(prompts):
        for b in prompts[i + 1:]:
            n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            best = max(best, n)
    return best


@contextlib.contextmanager
def started(setup: Setup, tmp: Path, bins: Binaries | None) -> Iterator[Servers]:
    """The four servers (three without llama-server), each warmed by one short request."""
    split = ServeOptions(lanes=LANES, extra=SPLIT_FLAGS + FLAGS[LANES2])
    with contextlib.ExitStack() as stack:
        urls = {LANES2: stack.enter_context(serve(setup, tmp, 2, split)).url}  # makes split-2's stage GGUFs
        tier_setup = dataclasses.replace(setup, cache=tier_cache(setup.cache, tmp))
        tier = Restartable(tier_setup, tmp, ServeOptions(lanes=LANES, extra=SPLIT_FLAGS + FLAGS[TIER2],
                                                         port=free_port()))
        stack.callback(tier.close)
        urls[TIER2] = tier.start()
        urls[MESH1] = stack.enter_context(serve(setup, tmp, 1, ServeOptions(lanes=LANES, extra=FLAGS[MESH1]))).url
        if bins is not None:
            spec = ServerSpec(setup.gguf, llama_cpus(setup), setup.ctx * LANES, parallel=LANES, extra=LLAMA_FLAGS)
            urls[LLAMA1] = stack.enter_context(llama_cpp.llama_server(bins, spec, tmp)).url
        for url in urls.values():
            warm(url, setup.model_id)
        yield Servers(urls, tier)


def llama_cpus(setup: Setup) -> str:
    """llama-server's CPUs: meshpipe's one node's set with --machines, else as many as its threads."""
    if setup.machines:
        return setup.machines.sets[0]
    return ",".join(map(str, sorted(os.sched_getaffinity(0))[: setup.threads]))


def run(asked: Asked) -> Outcome:
    setup = dataclasses.replace(asked.setup, ctx=kv_ctx(asked.setup.tokens))
    bins, skip = llama_binaries(asked.bins)
    if skip:
        print(f"bench: {skip}", file=sys.stderr)
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    record = Record()
    with tempfile.TemporaryDirectory(prefix="mesh-bench-kvtier-") as tmp, started(setup, Path(tmp), bins) as servers:
        for rep in range(asked.args.repeats):
            _repeat(setup, tokenizer, servers, rep, record)
    record.notes += [skip] if skip else []
    rows = kv_rows(record)
    return Outcome(rows + ([Row(ONE_NODE, skip, 0.0)] if skip else []), [kv_table(record, rows)])
