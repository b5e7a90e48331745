"""`mesh bench --scenarios chat`: time to first token over a multi-turn chat, with the prefix cache and without.

A chat client resends the whole conversation every turn. Without the cache every stage
prefills all of it again; with it, only what follows the longest prefix a lane still holds.
Two split-2 servers without the draft (so only the prefill differs), one as is and one with
`--no-prefix-cache`, hold the same greedy conversation in lockstep, turn by turn, so their
TTFTs are interleaved and their replies can be compared: the cache must not change a single
token. Each turn's history is the previous
turns' real replies (EOS ends them), so that is what the cache has to match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.client import stream_messages
from bench.harness.harness import Asked, Outcome, Row, ServeOptions, Setup, serve
from mesh.model.tokenizer import Tokenizer

TURNS = 4
HISTORY_TOKENS = 1000  # the floor for the last turn's prompt
DOCUMENT_TOKENS = 960  # turn 1 alone nearly reaches the floor, however short the replies
STATIONS = ("Alder Point", "Birch Hollow", "Cedar Ridge", "Dune Harbor", "Elm Crossing")
WINDS = ("north", "east", "south", "west", "northwest", "southwest")
QUESTIONS = (
    "Summarize the main trends in a few sentences.",
    "Which station was the warmest, and on which day?",
    "Now list the days with more than 10 mm of rain.",
    "Suggest a short title for this log and explain your choice.",
)
MODES = {"cache": True, "no cache": False}  # mode -> prefix cache on


def weather_log(count: Callable[[str], int], tokens: int = DOCUMENT_TOKENS) -> str:
    """A station log of at least `tokens` tokens as `count` counts them; the numbers vary by
    formula, so the text is the same every run."""
    lines: list[str] = []
    day = 0
    while count("\n".join(lines)) < tokens:
        station = STATIONS[day % len(STATIONS)]
        high, rain = 12 + (day * 7) % 15, (day * 5) % 17
        lines.append(f"Day {day + 1}: {station} recorded a high of {high} C and a low of {high - 4 - day % 5} C, "
                     f"with {rain} mm of rain and wind from the {WINDS[day % len(WINDS)]} at "
                     f"{8 + (day * 3) % 20} km/h.")
        day += 1
    return "\n".join(lines)


def opening(repeat: int) -> list[dict[str, str]]:
    """Each repeat's own system message: no repeat finds the previous one's turns in a lane."""
    return [{"role": "system", "content": f"You are a helpful assistant. This is conversation {repeat + 1}."}]


def question(turn: int, document: str) -> dict[str, str]:
    text = QUESTIONS[turn]
    if turn == 0:
        text = f"Here is the log of our weather stations:\n\n{document}\n\n{text}"
    return {"role": "user", "content": text}


def chat_ctx(tokens: int) -> int:
    """A context that holds the last turn: the document, every reply of up to `tokens`, and slack
    for the questions and the template; never below `mesh serve`'s default."""
    need = DOCUMENT_TOKENS + TURNS * (tokens + 64) + 256
    return max(2048, -(-need // 256) * 256)


@dataclass
class ChatRecord:
    """Per mode and turn, one entry per repeat."""

    ttft: dict[str, list[list[float]]] = field(default_factory=lambda: {m: [[] for _ in range(TURNS)] for m in MODES})
    replies: dict[str, list[str]] = field(default_factory=lambda: {m: [] for m in MODES})
    prompt_tokens: list[list[int]] = field(default_factory=lambda: [[] for _ in range(TURNS)])
    cached: list[list[int]] = field(default_factory=lambda: [[] for _ in range(TURNS)])


def chat_rows(setup: Setup, repeats: int) -> list[Row]:
    """Both servers at once, and nothing else: the other scenarios' servers are gone by now."""
    setup = dataclasses.replace(setup, ctx=chat_ctx(setup.tokens))
    tokenizer = Tokenizer(setup.gguf, setup.model_id)
    document = weather_log(lambda text: len(tokenizer.tokenize(text, False)))
    record = ChatRecord()
    with tempfile.TemporaryDirectory(prefix="mesh-bench-chat-") as tmp, contextlib.ExitStack() as stack:
        urls = {mode: stack.enter_context(serve(setup, Path(tmp), 2, ServeOptions(prefix_cache=on))).url
                for mode, on in MODES.items()}
        for rep in range(repeats):
            _converse(setup, tokenizer, urls, rep, document, record)
    return chat_table("chat split-2", record)


def _converse(setup: Setup, tokenizer: Tokenizer, urls: dict[str, str], rep: int, document: str,
              record: ChatRecord) -> None:
    """One conversation on every server, turn by turn; who goes first alternates by repeat."""
    order = list(MODES)[rep % 2:] + list(MODES)[: rep % 2]
    history = {mode: opening(rep) for mode in MODES}
    for turn in range(TURNS):
        for mode in order:
            messages = [*history[mode], question(turn, document)]
            timing = stream_messages(urls[mode], setup.model_id, messages, setup.tokens, ignore_eos=False)
            history[mode] = [*messages, {"role": "assistant", "content": timing.text}]
            record.ttft[mode][turn].append(timing.ttft)
            record.replies[mode].append(timing.text)
            if mode == "cache":
                record.prompt_tokens[turn].append(len(tokenizer.tokenize(tokenizer.render_chat(messages))))
                if timing.cached_tokens is not None:
                    record.cached[turn].append(timing.cached_tokens)


def chat_table(scenario: str, record: ChatRecord) -> list[Row]:
    rows = []
    for turn in range(TURNS):
        tokens = statistics.median(record.prompt_tokens[turn])
        none, cache = record.ttft["no cache"][turn], record.ttft["cache"][turn]
        last = turn == TURNS - 1
        rows += [Row(scenario, f"turn {turn + 1} prompt tokens", tokens, goal=f">= {HISTORY_TOKENS}" if last else ""),
                 Row(scenario, f"turn {turn + 1} TTFT, --no-prefix-cache (s)", statistics.median(none),
                     samples=none),
                 Row(scenario, f"turn {turn + 1} TTFT, prefix cache (s) (vs none)", statistics.median(cache),
                     statistics.median(none), "<= 0.15" if last else "", cache)]
        if record.cached[turn]:  # servers that do not report it leave the row out
            rows.append(Row(scenario, f"turn {turn + 1} cached tokens", statistics.median(record.cached[turn]),
                            samples=[float(c) for c in record.cached[turn]]))
    same = record.replies["cache"] == record.replies["no cache"]
    return [*rows, Row(scenario, "greedy outputs identical, cache vs none (1 = yes)", float(same), goal="1"),
            Row(scenario, "first turn whose reply differs (0: none)", first_difference(record.replies))]


def first_difference(replies: dict[str, list[str]]) -> int:
    """The turn (1 to TURNS) of the earliest reply the cache changed, in any repeat; every later
    turn differs anyway, since its history does."""
    turns = [i % TURNS + 1 for i, (a, b) in enumerate(zip(replies["cache"], replies["no cache"], strict=True))
             if a != b]
    return min(turns, default=0)


def run(asked: Asked) -> Outcome:
    return Outcome(chat_rows(asked.setup, asked.args.repeats))
