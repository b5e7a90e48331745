"""A held-out corpus of chat requests, drawn from templates with a seed (issue 58).

The bench's own workloads (workloads.py: the word_statistics rename, the recipe schema) are
what speculation was tuned on, and a figure measured on one case says little about the next
one a user sends: issue 58 found prompt lookup at 0.78 of no speculation on a copy-heavy
request that was not the bench's. So this corpus holds none of those cases, and many of each
kind, so that a kind's median and worst ratio describe the kind rather than one prompt:
- copy-heavy: a given text the reply rewrites with one small change (an identifier renamed
  in a generated function, a typo fixed in a paragraph, a JSON object echoed with one field
  changed, a configuration file with one value changed); the text is 100-300 tokens;
- free: open-ended prose, sampled (temperature 0.8, top_p 0.95) with a seed of its own, so
  the reply stays novel and every server draws the same tokens;
- code: a small function written from a description;
- nested-schema: `response_format` json_schema, objects holding lists of objects;
- flat-schema: json_schema of scalars and enums;
- tool-call: 1-3 generated functions offered as `tools`, a user message that calls one,
  `tool_choice` "required" or "auto".
Each kind draws from a `random.Random` seeded by the corpus seed and the kind's name, so a seed
is one corpus on every machine and run (and a kind does not change when another does); another
seed is another sample of the same templates. Vocabulary, sizes and structure vary within a
kind. Prompts stay modest for SmolLM2-135M, the package's model.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

SEED = 58  # issue 58's corpus; another seed draws another one from the same templates
PER_KIND = 12  # the least: fewer, and one prompt moves a kind's median
FREE_SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # with a per-request seed
T = TypeVar("T")


@dataclass(frozen=True)
class CorpusRequest:
    """One request: its kind, a name unique in its corpus ("<kind>/<nn>-<template>"), the chat
    messages, and the body fields beside them (`response_format`, `tools`, `tool_choice`,
    sampling), which `stream_messages` takes as `sampling`."""

    kind: str
    name: str
    messages: list[dict[str, str]]
    body: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # copy-heavy: the text, as the prompt quotes it, that the reply should copy


def _cycle(rng: random.Random, items: Sequence[T], n: int) -> list[T]:
    """n of `items`, every one before any comes again, in an order the seed picks."""
    out: list[T] = []
    while len(out) < n:
        out += rng.sample(list(items), len(items))
    return out[:n]


def _user(kind: str, i: int, label: str, prompt: str, body: dict[str, Any] | None = None,
          source: str = "") -> CorpusRequest:
    return CorpusRequest(kind, f"{kind}/{i:02d}-{label}", [{"role": "user", "content": prompt}], body or {}, source)


# -- copy-heavy ----------------------------------------------------------------------------------
# Four function bodies, their identifiers drawn per request: rename one of the roles.
FUNCTIONS = {
    "group": ('''def {fn}({rows}, {key}="{field}"):
    """Group the {rows} by their {field} and total their {amount}."""
    {groups} = {{}}
    {total} = 0
    for {row} in {rows}:
        label = {row}.get({key})
        if label is None:
            continue
        {groups}.setdefault(label, []).append({row})
        {total} += {row}.get("{amount}", 0)
    {summary} = []
    for label, members in sorted({groups}.items()):
        subtotal = sum(member.get("{amount}", 0) for member in members)
        {summary}.append((label, len(members), subtotal))
    return {summary}, {total}
''', ("groups", "total", "summary", "row")),
    "parse": ('''def {fn}({rows}, {key}="{level}"):
    """Keep the lines of a {field} log at one level, with their line numbers."""
    {groups} = []
    {total} = 0
    for number, line in enumerate({rows}, start=1):
        parts = line.strip().split("{sep}")
        if len(parts) < 3:
            {total} += 1
            continue
        stamp, kind, message = parts[0], parts[1].upper(), "{sep}".join(parts[2:])
        if kind != {key}:
            continue
        {groups}.append({{"line": number, "time": stamp, "{amount}": message.strip()}})
    {summary} = {{"matches": {groups}, "skipped": {total}}}
    return {summary}
''', ("groups", "total", "summary", "key")),
    "validate": ('''def {fn}({rows}, {key}={limit}):
    """Split {field} records into the valid ones and a list of errors."""
    {groups} = []
    {summary} = []
    for index, {row} in enumerate({rows}):
        if not {row}.get("id"):
            {summary}.append(f"{{index}}: missing id")
            continue
        if len({row}.get("{amount}", "")) > {key}:
            {summary}.append(f"{{index}}: {amount} longer than {{{key}}}")
            continue
        if {row}.get("{total}", 0) < 0:
            {summary}.append(f"{{index}}: negative {total}")
            continue
        {groups}.append({row})
    return {groups}, {summary}
''', ("groups", "summary", "row", "key")),
    "window": ('''def {fn}({rows}, {key}={limit}):
    """Moving averages of {field} readings over a window, and the highest of them."""
    if {key} <= 0:
        raise ValueError("{key} must be positive")
    {groups} = []
    {summary} = []
    {total} = None
    for value in {rows}:
        {groups}.append(value)
        if len({groups}) > {key}:
            {groups}.pop(0)
        current = sum({groups}) / len({groups})
        {summary}.append(round(current, {digits}))
        if {total} is None or current > {total}:
            {total} = current
    return {summary}, {total}
''', ("groups", "summary", "total", "key")),
}
NOUNS = ["order", "invoice", "sensor", "ticket", "account", "shipment", "student", "booking", "sample", "packet",
         "visit", "payment", "parcel", "lesson", "reading", "trip"]
ROLE_NAMES = {"groups": ["groups", "buckets", "kept", "pending", "found", "seen"],
              "total": ["total", "overall", "running", "best", "tally", "acc"],
              "summary": ["summary", "report", "result", "collected", "out", "rows_out"],
              "key": ["key", "size", "limit", "wanted", "level", "width"]}
VERBS = {"group": ["summarize", "group", "tally"], "parse": ["filter", "scan", "pick"],
         "validate": ["validate", "check", "screen"], "window": ["smooth", "average", "track"]}
RENAME_ASKS = ["Rewrite this function with the variable `{old}` renamed to `{new}`. Keep everything else as it is.",
               "Rename `{old}` to `{new}` everywhere in the function below and give the whole function back.",
               "In this code, change the name `{old}` to `{new}`; reply with the complete code."]


def _function(rng: random.Random, body: str, roles: tuple[str, ...], template: str) -> tuple[str, str, str]:
    """The function's text, with each role given a name of its own, and one role's name and a new one."""
    noun, field_ = rng.sample(NOUNS, 2)
    names: dict[str, str] = {}
    for role, pool in ROLE_NAMES.items():
        names[role] = rng.choice([n for n in pool if n not in names.values()])
    names["row"] = noun
    text = body.format(fn=f"{rng.choice(VERBS[template])}_{noun}s", rows=f"{noun}s", field=field_,
                       amount=rng.choice(["amount", "weight", "cost", "note", "label"]), sep=rng.choice("|;,"),
                       level=rng.choice(["ERROR", "WARN", "INFO"]), limit=rng.randint(3, 40),
                       digits=rng.randint(1, 3), **names)
    old = names[rng.choice(roles)]
    new = rng.choice(["_".join(p) for p in (("the", old), (old, "list"), ("my", old), (old, "value"))])
    return text, old, new


def _rename(rng: random.Random) -> tuple[str, str]:
    template = rng.choice(list(FUNCTIONS))
    text, old, new = _function(rng, *FUNCTIONS[template], template)
    return rng.choice(RENAME_ASKS).format(old=old, new=new) + f"\n\n```python\n{text}```", text


SENTENCES = [
    "{name} opened the {shop} at seven, as {pronoun} had done every morning for {years} years.",
    "The road to {town} climbs through pine woods and crosses the river twice before the last village.",
    "Nobody in {town} remembered who had planted the chestnut trees along the harbour wall.",
    "On market days the square filled with carts of apples, cheese, wool and copper pans.",
    "{name} kept a notebook of every visitor, with the weather and the price of bread beside each name.",
    "In the spring of {year} the bridge was closed for repairs, and the ferry carried everyone across.",
    "The {shop} smelled of varnish and sawdust, and a radio played quietly behind the counter.",
    "Children walked to the school on the hill, {distance} kilometres each way, in every kind of weather.",
    "The old station clock had stopped at a quarter past four, and nobody wanted it repaired.",
    "Every evening {name} counted the money twice and wrote the total in a green ledger.",
    "Fishermen mended their nets on the quay while gulls waited on the roofs of the warehouses.",
    "A letter from {town} arrived in {month}, asking whether the {shop} could take an apprentice.",
    "The library had {years} thousand books, most of them donated by families who had moved away.",
    "When the snow came early, the bus stopped running and the village baked its own bread.",
    "{name} believed that a good tool should outlast the person who bought it.",
    "The festival ended with a procession of lanterns down to the water and back again.",
]
PEOPLE = ["Marta", "Jonas", "Ilse", "Tomas", "Aurelia", "Bram", "Noor", "Emil", "Rosa", "Dmitri"]
TOWNS = ["Hallberg", "San Lucio", "Kerrowmore", "Vellinge", "Port Amsel", "Oberwald", "Castelmar"]
SHOPS = ["bakery", "workshop", "bookshop", "pharmacy", "boatyard", "clockmaker's", "print shop"]
MONTHS = ["March", "April", "June", "September", "October", "November"]
TYPO_ASKS = ["Copy the paragraph below exactly, but correct the misspelled word \"{typo}\" to \"{word}\". "
             "Change nothing else.",
             "This paragraph has one typo: \"{typo}\" should be \"{word}\". Write the corrected paragraph in full.",
             "Quote the following paragraph back to me with the spelling mistake \"{typo}\" fixed (\"{word}\")."]


def _typo(rng: random.Random) -> tuple[str, str]:
    """A paragraph of 6-9 sentences with one word's two inner letters swapped, and the ask to fix it."""
    slots = {"name": rng.choice(PEOPLE), "pronoun": rng.choice(["she", "he"]), "shop": rng.choice(SHOPS),
             "town": rng.choice(TOWNS), "years": rng.randint(3, 40), "year": rng.randint(1921, 1989),
             "distance": rng.randint(2, 9), "month": rng.choice(MONTHS)}
    paragraph = " ".join(s.format(**slots) for s in rng.sample(SENTENCES, rng.randint(6, 9)))
    words = sorted({w for w in (w.strip(".,'") for w in paragraph.split()) if len(w) >= 6 and w.isalpha()})
    word = rng.choice(words)
    at = rng.choice([k for k in range(1, len(word) - 2) if word[k] != word[k + 1]])
    typo = word[:at] + word[at + 1] + word[at] + word[at + 2:]
    quoted = re.sub(rf"\b{word}\b", typo, paragraph, count=1)  # the word, not a longer one holding it
    return rng.choice(TYPO_ASKS).format(typo=typo, word=word) + f"\n\n{quoted}", quoted


STATUSES = ["open", "pending", "shipped", "closed", "on_hold", "cancelled"]
TAGS = ["priority", "gift", "fragile", "repeat", "wholesale", "export", "trial", "late", "vip"]
CITIES = ["Lyon", "Porto", "Graz", "Tampere", "Ghent", "Bologna", "Cork", "Bergen", "Malmo", "Brno"]


def _record(rng: random.Random) -> dict[str, Any]:
    """A customer record of 8-10 fields, its items always among them, its values drawn."""
    first, last = rng.choice(PEOPLE), rng.choice(["Lind", "Okafor", "Moreau", "Keller", "Ricci", "Novak", "Berg"])
    fields: dict[str, Any] = {
        "id": rng.randint(1000, 99999), "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@example.{rng.choice(['com', 'org', 'net'])}",
        "status": rng.choice(STATUSES), "created": f"20{rng.randint(18, 25)}-{rng.randint(1, 12):02d}-"
                                                  f"{rng.randint(1, 28):02d}",
        "tags": rng.sample(TAGS, rng.randint(1, 3)),
        "address": {"street": f"{rng.randint(1, 180)} {rng.choice(['Mill', 'Station', 'Harbour', 'Elm'])} "
                              f"{rng.choice(['Road', 'Lane', 'Street'])}", "city": rng.choice(CITIES),
                    "postcode": f"{rng.randint(1000, 98999)}"},
        "items": [{"sku": f"{rng.choice('ABCDEFGH')}{rng.choice('KLMNPRST')}-{rng.randint(100, 999)}",
                   "quantity": rng.randint(1, 12), "price": round(rng.uniform(2, 250), 2)}
                  for _ in range(rng.randint(2, 3))],
        "paid": rng.random() < 0.5, "discount": rng.choice([0, 5, 10, 15]),
    }
    optional = [k for k in fields if k not in ("id", "status", "items")]
    keep = {"id", "status", "items", *rng.sample(optional, rng.randint(5, len(optional)))}
    return {k: v for k, v in fields.items() if k in keep}


def _json_echo(rng: random.Random) -> tuple[str, str]:
    record = _record(rng)
    key = rng.choice([k for k in ("status", "discount", "paid", "id") if k in record])
    new: Any = {"status": rng.choice([s for s in STATUSES if s != record.get("status")]),
                "discount": rng.choice([20, 25, 30]), "paid": not record.get("paid"),
                "id": record["id"] + rng.randint(1, 99)}[key]
    text = json.dumps(record, indent=2)
    ask = rng.choice([f"Return this JSON object unchanged except that \"{key}\" becomes {json.dumps(new)}. "
                      "Reply with the JSON only.",
                      f"Echo the JSON below with one change: set \"{key}\" to {json.dumps(new)}."])
    return f"{ask}\n\n```json\n{text}\n```", text


SECTIONS = {
    "server": {"host": ["0.0.0.0", "127.0.0.1"], "port": ["8080", "9000", "5000"], "workers": ["2", "4", "8"],
               "timeout_seconds": ["30", "60", "120"], "keep_alive": ["true", "false"],
               "max_body_bytes": ["1048576", "65536"]},
    "database": {"url": ["postgres://db.internal:5432/app", "sqlite:///data/app.db"], "pool_size": ["5", "10", "20"],
                 "retries": ["3", "5"], "echo_queries": ["false", "true"], "statement_timeout_ms": ["500", "2000"]},
    "logging": {"level": ["info", "debug", "warning"], "file": ["/var/log/app.log", "logs/service.log"],
                "rotate_megabytes": ["10", "50"], "json": ["true", "false"], "keep_files": ["7", "30"]},
    "cache": {"backend": ["redis", "memory"], "url": ["redis://cache.internal:6379/0", "memory://"],
              "ttl_seconds": ["300", "3600"], "max_entries": ["1000", "50000"]},
    "mail": {"smtp_host": ["smtp.example.org", "mail.internal"],
             "sender": ["noreply@example.org", "alerts@example.org"],
             "use_tls": ["true", "false"], "port": ["587", "25"], "batch_size": ["50", "200"]},
    "auth": {"issuer": ["https://login.example.org", "https://sso.internal"], "token_minutes": ["15", "60"],
             "refresh_days": ["7", "30"], "allow_signup": ["false", "true"]},
    "uploads": {"directory": ["/srv/uploads", "data/uploads"], "max_megabytes": ["20", "100"],
                "allowed_types": ["jpg,png,pdf", "csv,xlsx"], "scan_viruses": ["true", "false"]},
}
COMMENTS = ["# edited by ops, see the runbook", "# keep in sync with staging", "# defaults unless noted",
            "# reviewed in the last audit"]


def _config(rng: random.Random) -> tuple[str, str]:
    """An INI file of 4-6 sections, 3-6 keys each, some commented, and the ask to change one value."""
    lines: list[str] = []
    keys: list[tuple[str, str, str]] = []
    for section in rng.sample(list(SECTIONS), rng.randint(4, 6)):
        values = SECTIONS[section]
        chosen = rng.sample(list(values), rng.randint(3, len(values)))
        comment = [rng.choice(COMMENTS)] if rng.random() < 0.4 else []
        keys += [(section, k, rng.choice(values[k])) for k in chosen]
        lines += [f"[{section}]", *comment, *(f"{k} = {v}" for _, k, v in keys[-len(chosen):]), ""]
    text = "\n".join(lines).strip() + "\n"
    section, key, old = rng.choice(keys)
    new = rng.choice([v for v in SECTIONS[section][key] if v != old])  # a value the key could hold
    ask = rng.choice([f"Here is a configuration file. Rewrite it with `{key}` in [{section}] set to `{new}`, "
                      "everything else unchanged.",
                      f"Change {key} under [{section}] to {new} in this file and show me the whole file."])
    return f"{ask}\n\n```ini\n{text}```", text


COPY_TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "rename": _rename, "typo": _typo, "json-echo": _json_echo, "config": _config}


def copy_heavy(rng: random.Random, n: int) -> list[CorpusRequest]:
    """Greedy: the reply is a copy, or should be; `source` is the text it copies."""
    out = []
    for i, label in enumerate(_cycle(rng, list(COPY_TEMPLATES), n)):
        prompt, source = COPY_TEMPLATES[label](rng)
        out.append(_user("copy-heavy", i, label, prompt, source=source))
    return out


# -- free ----------------------------------------------------------------------------------------
FREE = {
    "letter": "Write a short letter from a {role} to a {other} about {topic}.",
    "workday": "Describe an ordinary {time} in a {place}, as someone who works there.",
    "fable": "Tell a story about a {creature} who wants to {wish}.",
    "craft": "Explain to a new {role} what makes a good day's work in their trade.",
    "diary": "Write a diary entry by a {role} on the day {event}.",
    "advice": "Give some advice to someone who wants to start {hobby}.",
    "season": "Describe {season} in a {place} to someone who has never been there.",
    "dialogue": "Write a conversation between a {role} and a {other} about {topic}.",
    "poem": "Write a short poem about {thing}.",
    "town": "Imagine a town where {oddity}. Describe a day there.",
    "reassure": "What would you tell a friend who is nervous about {worry}?",
    "mystery": "Write the opening of a mystery set in a {place}.",
}
FREE_SLOTS = {
    "role": ["ferry pilot", "librarian", "glassblower", "night nurse", "train conductor", "cartographer",
             "postwoman", "violin maker", "shepherd", "tailor"],
    "other": ["retired sailor", "young painter", "city mayor", "museum guard", "schoolteacher"],
    "topic": ["a lost umbrella", "the new bridge", "a noisy neighbour", "the harvest", "an old photograph"],
    "time": ["morning", "night shift", "rainy afternoon", "market day"],
    "place": ["fishing harbour", "mountain hut", "observatory", "railway station", "flower market", "shipyard",
              "desert inn"],
    "creature": ["fox", "small dragon", "tortoise", "crow", "snail", "octopus"],
    "wish": ["see the sea", "learn to sing", "build a bridge", "find its lost brother", "win a race"],
    "event": ["the river froze", "the circus came to town", "the power went out", "a stranger arrived"],
    "hobby": ["rock climbing", "pottery", "birdwatching", "sourdough baking", "chess", "long-distance running"],
    "season": ["winter", "spring", "the rainy season", "autumn"],
    "thing": ["an old bicycle", "the first snow", "a broken clock", "a city at dawn", "a kitchen table"],
    "oddity": ["it never stops raining", "everyone speaks in rhyme", "the clocks run backwards",
               "cats run the post office"],
    "worry": ["a job interview", "moving abroad", "speaking in public", "a first day at a new school"],
}


def free(rng: random.Random, n: int) -> list[CorpusRequest]:
    """Sampled with a seed of its own: novel text that every server still draws alike."""
    out = []
    for i, label in enumerate(_cycle(rng, list(FREE), n)):
        prompt = FREE[label].format(**{k: rng.choice(v) for k, v in FREE_SLOTS.items()})
        out.append(_user("free", i, label, prompt, {**FREE_SAMPLING, "seed": rng.randint(1, 2**31 - 1)}))
    return out


# -- code ----------------------------------------------------------------------------------------
CODE = {
    "merge": ("merge_sorted_{noun}s", "left, right", "merges two sorted lists of {noun} ids into one sorted list"),
    "largest": ("largest_{noun}s", "values, k", "returns the k largest values without sorting the whole list"),
    "group-pairs": ("group_{noun}_pairs", "pairs", "turns a list of (key, value) pairs into a dict of lists"),
    "brackets": ("balanced", "text", "checks whether the brackets (), [] and {{}} in a string are balanced"),
    "duration": ("format_duration", "seconds", "turns a number of seconds into a string like '2h 05m 09s'"),
    "flatten": ("flatten", "items", "flattens a nested list of any depth"),
    "chunks": ("chunk_{noun}s", "items, size", "splits a list into chunks of at most `size` items"),
    "letters": ("letter_counts", "word", "counts how often each letter appears in a word, ignoring case"),
    "pairs": ("parse_{noun}_fields", "line", "parses 'key=value' pairs separated by semicolons into a dict"),
    "rotate": ("rotate_grid", "grid", "rotates a square matrix, given as a list of lists, 90 degrees clockwise"),
    "roman": ("to_roman", "number", "converts an integer from 1 to 3999 to a Roman numeral"),
    "prefix": ("common_prefix", "words", "finds the longest common prefix of a list of strings"),
    "median": ("median_{noun}", "numbers", "returns the median of a list of numbers"),
    "dedupe": ("unique_{noun}s", "items", "removes duplicates from a list, keeping the first of each"),
    "distance": ("edit_distance", "a, b", "computes the Levenshtein distance between two strings"),
}
CODE_EXTRAS = ["", " Include a docstring.", " Add a short example of its use.", " Keep it under 15 lines.",
               " Handle the empty case.", " Use no imports."]


def code(rng: random.Random, n: int) -> list[CorpusRequest]:
    out = []
    for i, label in enumerate(_cycle(rng, list(CODE), n)):
        name, params, what = CODE[label]
        noun = rng.choice(NOUNS)
        lang = rng.choice(["Python", "Python", "Python", "JavaScript"])
        name = name.format(noun=noun) if lang == "Python" else _camel(name.format(noun=noun))
        prompt = f"Write a {lang} function `{name}({params})` that {what.format(noun=noun)}.{rng.choice(CODE_EXTRAS)}"
        out.append(_user("code", i, label, prompt))
    return out


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


# -- schemas -------------------------------------------------------------------------------------
# A field: ("str",), ("int", lo, hi), ("num", lo, hi), ("bool",), ("enum", [...]), ("strs",) (a
# list of strings), ("obj", {fields}) or ("objs", {fields}) (a list of objects). Bounds on strings
# and lists keep a small model from writing one string or list until --tokens.
Spec = tuple[Any, ...]
NESTED: dict[str, tuple[str, dict[str, Spec]]] = {
    "library": ("a small town library", {
        "name": ("str",), "city": ("str",), "open_on_sundays": ("bool",),
        "books": ("objs", {"title": ("str",), "author": ("str",), "year": ("int", 1800, 2030),
                           "genre": ("enum", ["novel", "poetry", "history", "science"])})}),
    "team": ("a football team", {
        "name": ("str",), "founded": ("int", 1860, 2024), "league": ("enum", ["first", "second", "amateur"]),
        "players": ("objs", {"name": ("str",), "position": ("enum", ["goalkeeper", "defender", "midfielder",
                                                                      "forward"]),
                             "number": ("int", 1, 99), "age": ("int", 16, 45)})}),
    "order": ("an online shop order", {
        "order_id": ("int", 1, 999999), "paid": ("bool",), "currency": ("enum", ["EUR", "USD", "GBP"]),
        "items": ("objs", {"product": ("str",), "quantity": ("int", 1, 20), "unit_price": ("num", 0, 1000)}),
        "shipping": ("obj", {"city": ("str",), "express": ("bool",)})}),
    "trip": ("a train trip through Europe", {
        "traveller": ("str",), "budget_euros": ("int", 100, 10000),
        "stops": ("objs", {"city": ("str",), "nights": ("int", 1, 14), "sights": ("strs",)})}),
    "playlist": ("a playlist for a long drive", {
        "title": ("str",), "public": ("bool",),
        "tracks": ("objs", {"title": ("str",), "artist": ("str",), "seconds": ("int", 30, 900)})}),
    "course": ("an evening course at a community college", {
        "title": ("str",), "weeks": ("int", 1, 20), "level": ("enum", ["beginner", "intermediate", "advanced"]),
        "lessons": ("objs", {"topic": ("str",), "minutes": ("int", 30, 180), "homework": ("bool",)})}),
    "garden": ("a vegetable garden", {
        "owner": ("str",), "square_metres": ("int", 1, 500),
        "beds": ("objs", {"name": ("str",), "sunny": ("bool",),
                          "plants": ("objs", {"name": ("str",), "count": ("int", 1, 50)})})}),
    "conference": ("a one-day conference", {
        "name": ("str",), "city": ("str",),
        "talks": ("objs", {"title": ("str",), "minutes": ("int", 10, 90),
                           "speaker": ("obj", {"name": ("str",), "company": ("str",)})})}),
    "zoo": ("a small zoo", {
        "name": ("str",), "visitors_per_year": ("int", 0, 5000000),
        "enclosures": ("objs", {"name": ("str",), "indoor": ("bool",),
                                "animals": ("objs", {"species": ("str",), "count": ("int", 1, 40)})})}),
    "tour": ("a band's summer tour", {
        "band": ("str",), "year": ("int", 1960, 2030),
        "concerts": ("objs", {"city": ("str",), "venue": ("str",), "sold_out": ("bool",)}),
        "members": ("objs", {"name": ("str",), "instrument": ("enum", ["guitar", "bass", "drums", "keys",
                                                                        "vocals"])})}),
}
FLAT: dict[str, tuple[str, dict[str, Spec]]] = {
    "weather": ("today's weather in a city", {
        "city": ("str",), "condition": ("enum", ["sunny", "cloudy", "rain", "snow", "fog"]),
        "temperature_c": ("num", -40, 50), "humidity_percent": ("int", 0, 100), "windy": ("bool",)}),
    "product": ("a product in a hardware shop", {
        "name": ("str",), "category": ("enum", ["tools", "paint", "garden", "plumbing"]),
        "price": ("num", 0, 5000), "in_stock": ("bool",), "rating": ("int", 1, 5)}),
    "person": ("a character in a novel", {
        "name": ("str",), "age": ("int", 1, 110), "occupation": ("enum", ["farmer", "sailor", "teacher", "thief"]),
        "hometown": ("str",), "brave": ("bool",)}),
    "sensor": ("a reading from a greenhouse sensor", {
        "sensor_id": ("str",), "kind": ("enum", ["temperature", "humidity", "light", "soil"]),
        "value": ("num", -100, 100000), "battery_percent": ("int", 0, 100), "ok": ("bool",)}),
    "ticket": ("a bug report", {
        "title": ("str",), "severity": ("enum", ["low", "medium", "high", "critical"]),
        "component": ("enum", ["api", "ui", "database", "docs"]), "open": ("bool",), "votes": ("int", 0, 1000)}),
    "book": ("a book you would recommend", {
        "title": ("str",), "author": ("str",), "pages": ("int", 20, 2000),
        "language": ("enum", ["english", "french", "german", "spanish"]), "translated": ("bool",)}),
    "car": ("a used car for sale", {
        "make": ("str",), "year": ("int", 1950, 2025), "fuel": ("enum", ["petrol", "diesel", "electric", "hybrid"]),
        "kilometres": ("int", 0, 900000), "price_euros": ("num", 0, 200000), "manual": ("bool",)}),
    "restaurant": ("a restaurant in your neighbourhood", {
        "name": ("str",), "cuisine": ("enum", ["italian", "thai", "mexican", "indian", "local"]),
        "price_level": ("enum", ["cheap", "moderate", "expensive"]), "seats": ("int", 4, 400),
        "vegan_options": ("bool",)}),
    "planet": ("an imaginary planet", {
        "name": ("str",), "moons": ("int", 0, 80), "atmosphere": ("enum", ["none", "thin", "thick", "toxic"]),
        "gravity_g": ("num", 0, 10), "habitable": ("bool",)}),
    "hotel": ("a hotel room booking", {
        "guest": ("str",), "nights": ("int", 1, 30), "room": ("enum", ["single", "double", "suite"]),
        "breakfast": ("bool",), "total_price": ("num", 0, 20000)}),
}


def _field(rng: random.Random, spec: Spec) -> dict[str, Any]:
    """One field's schema; an object's fields are drawn by `_object`."""
    kind = spec[0]
    if kind == "str":
        return {"type": "string", "maxLength": rng.choice([20, 24, 30, 40])}
    if kind in ("int", "num"):
        return {"type": "integer" if kind == "int" else "number", "minimum": spec[1], "maximum": spec[2]}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": list(spec[1])}
    if kind == "strs":
        return {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": rng.randint(2, 3)}
    if kind == "obj":
        return _object(rng, spec[1], (), len(spec[1]))
    items = _object(rng, spec[1], ("objs",), 2)
    return {"type": "array", "items": items, "maxItems": rng.randint(2, 4), **({"minItems": 1} if rng.random() < 0.5
                                                                               else {})}


def _object(rng: random.Random, fields: dict[str, Spec], keep: tuple[str, ...], least: int) -> dict[str, Any]:
    """An object of some of `fields`, in their given order, no other key allowed: the first, every
    field of a kind in `keep`, and of the rest as many as drawn, `least` in all (or every one)."""
    kept = {next(iter(fields))} | {k for k, s in fields.items() if s[0] in keep}
    rest = [k for k in fields if k not in kept]
    kept |= set(rng.sample(rest, rng.randint(min(max(least - len(kept), 0), len(rest)), len(rest))))
    props = {k: _field(rng, s) for k, s in fields.items() if k in kept}
    return {"type": "object", "additionalProperties": False, "required": list(props), "properties": props}


def _describe(schema: dict[str, Any]) -> str:
    """An object's fields in words, as a prompt lists them: a list of objects with its own."""
    parts = []
    for key, sub in schema["properties"].items():
        words = key.replace("_", " ")
        if sub.get("type") == "array" and sub["items"].get("type") == "object":
            parts.append(f"{words} (each with {_describe(sub['items'])})")
        elif sub.get("type") == "object":
            parts.append(f"{words} ({_describe(sub)})")
        elif "enum" in sub:
            parts.append(f"{words} ({', '.join(sub['enum'][:-1])} or {sub['enum'][-1]})")
        else:
            parts.append(words)
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]


def _schema_requests(rng: random.Random, n: int, kind: str, keep: str) -> list[CorpusRequest]:
    """A domain's object with some of its fields (every field of the kind `keep`, 3 at least)."""
    domains = NESTED if kind == "nested-schema" else FLAT
    out = []
    for i, label in enumerate(_cycle(rng, list(domains), n)):
        thing, fields = domains[label]
        schema = _object(rng, fields, (keep,), 3)
        lead = rng.choice(["Describe", "Make up", "Give me", "Invent"])
        prompt = f"{lead} {thing} as JSON: {_describe(schema)}."
        fmt = {"type": "json_schema", "json_schema": {"name": label, "schema": schema, "strict": True}}
        out.append(_user(kind, i, label, prompt, {"response_format": fmt}))
    return out


def nested_schema(rng: random.Random, n: int) -> list[CorpusRequest]:
    """Lists of objects, some holding lists or objects of their own."""
    return _schema_requests(rng, n, "nested-schema", "objs")


def flat_schema(rng: random.Random, n: int) -> list[CorpusRequest]:
    """Scalars and every enum of the domain."""
    return _schema_requests(rng, n, "flat-schema", "enum")


# -- tool calls ----------------------------------------------------------------------------------
STRING, NUMBER, INTEGER = {"type": "string"}, {"type": "number"}, {"type": "integer"}
# name -> (description, parameters: name -> (schema, description), required, what a user asks)
TOOLS: dict[str, tuple[str, dict[str, tuple[dict[str, Any], str]], list[str], list[str]]] = {
    "get_weather": ("Get the current weather for a city.",
                    {"city": (STRING, "The city, e.g. Lisbon"),
                     "unit": ({"enum": ["celsius", "fahrenheit"]}, "The temperature unit")},
                    ["city"], ["What's the weather like in {city} right now?",
                               "Is it cold in {city} today? Tell me in {unit}."]),
    "convert_currency": ("Convert an amount of money from one currency to another.",
                         {"amount": (NUMBER, "How much"), "source": (STRING, "ISO code to convert from"),
                          "target": (STRING, "ISO code to convert to")},
                         ["amount", "source", "target"], ["How much is {amount} {currency} in {currency2}?"]),
    "book_table": ("Reserve a table at a restaurant.",
                   {"restaurant": (STRING, "The restaurant's name"), "people": (INTEGER, "Party size"),
                    "time": (STRING, "24-hour time, e.g. 19:30")},
                   ["restaurant", "people", "time"],
                   ["Book a table for {people} at {restaurant} at {time}.",
                    "Can you get us a table at {restaurant}, {people} people, {time}?"]),
    "search_flights": ("Search for flights between two cities on a date.",
                       {"origin": (STRING, "Departure city"), "destination": (STRING, "Arrival city"),
                        "date": (STRING, "YYYY-MM-DD")},
                       ["origin", "destination", "date"], ["Find me a flight from {city} to {city2} on {date}."]),
    "set_timer": ("Start a countdown timer.",
                  {"minutes": (INTEGER, "Length of the timer"), "label": (STRING, "What the timer is for")},
                  ["minutes"], ["Set a timer for {minutes} minutes for the {label}.",
                                "Remind me in {minutes} minutes to check the {label}."]),
    "send_email": ("Send an email.",
                   {"to": (STRING, "Recipient address"), "subject": (STRING, "Subject line"),
                    "body": (STRING, "Message text")},
                   ["to", "subject", "body"], ["Email {email} with the subject '{subject}' and say {text}."]),
    "translate_text": ("Translate text into another language.",
                       {"text": (STRING, "The text"), "language": ({"enum": ["french", "german", "spanish",
                                                                             "italian"]}, "Target language")},
                       ["text", "language"], ["Translate '{text}' into {language}."]),
    "get_stock_price": ("Look up the latest price of a stock.",
                        {"symbol": (STRING, "Ticker symbol, e.g. ACME")},
                        ["symbol"], ["What is {symbol} trading at right now?", "Price of {symbol} stock, please."]),
    "create_reminder": ("Create a reminder for a date.",
                        {"text": (STRING, "What to be reminded of"), "date": (STRING, "YYYY-MM-DD")},
                        ["text", "date"], ["Remind me to {task} on {date}."]),
    "calculate_tip": ("Work out a tip for a bill.",
                      {"bill": (NUMBER, "The bill amount"), "percent": (INTEGER, "Tip percentage")},
                      ["bill", "percent"], ["What's a {percent}% tip on a bill of {amount}?"]),
    "set_lights": ("Turn the lights in a room on or off, or dim them.",
                   {"room": ({"enum": ["kitchen", "bedroom", "living_room", "office"]}, "Which room"),
                    "brightness": ({"type": "integer", "minimum": 0, "maximum": 100}, "0 is off, 100 full")},
                   ["room", "brightness"], ["Dim the {room} lights to {brightness} percent.",
                                            "Set the {room} lights to {brightness}."]),
    "track_package": ("Find where a parcel is.",
                      {"tracking_number": (STRING, "The carrier's tracking number")},
                      ["tracking_number"], ["Where is my parcel {tracking}?"]),
}
TOOL_SLOTS = {
    "city": CITIES, "city2": ["Oslo", "Seville", "Krakow", "Dublin", "Zurich", "Riga"],
    "unit": ["celsius", "fahrenheit"], "amount": ["12.50", "80", "245", "1300", "19.99"],
    "currency": ["EUR", "USD", "GBP", "SEK"], "currency2": ["JPY", "CHF", "NOK", "CAD"],
    "people": ["2", "4", "6", "7"], "restaurant": ["Chez Marcel", "The Green Fig", "Osteria Nove", "Blue Lantern"],
    "time": ["18:30", "19:00", "20:15", "21:00"], "date": ["2026-03-14", "2026-05-02", "2026-07-21", "2026-11-08"],
    "minutes": ["5", "12", "25", "40"], "label": ["pasta", "laundry", "bread", "tea", "parking meter"],
    "email": ["ana@example.org", "li.wei@example.com", "sam@example.net"],
    "subject": ["Friday meeting", "Invoice 42", "Trip photos"],
    "text": ["that I will be late", "thanks for yesterday", "good morning", "that the train is late"],
    "language": ["french", "german", "spanish", "italian"], "symbol": ["ACME", "GLOBX", "NRTH", "VOLT"],
    "task": ["call the dentist", "renew my passport", "water the plants", "pay the rent"],
    "percent": ["10", "15", "18", "20"], "room": ["kitchen", "bedroom", "living room", "office"],
    "brightness": ["20", "35", "60", "80"], "tracking": ["1Z999AA10123456784", "JD0146000032145", "RR123456789SE"],
}


def tool_definition(name: str) -> dict[str, Any]:
    """One of TOOLS in OpenAI's shape: {"type": "function", "function": {name, description, parameters}}."""
    description, params, required, _ = TOOLS[name]
    properties = {k: {**schema, "description": words} for k, (schema, words) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def tool_call(rng: random.Random, n: int) -> list[CorpusRequest]:
    """The function the message asks for and 0-2 others, shuffled; "required" and "auto" in turn."""
    out = []
    first = rng.randint(0, 1)
    for i, target in enumerate(_cycle(rng, list(TOOLS), n)):
        offered = [target, *rng.sample([t for t in TOOLS if t != target], rng.randint(0, 2))]
        rng.shuffle(offered)
        prompt = rng.choice(TOOLS[target][3]).format(**{k: rng.choice(v) for k, v in TOOL_SLOTS.items()})
        body = {"tools": [tool_definition(t) for t in offered], "tool_choice": ("required", "auto")[(i + first) % 2]}
        out.append(_user("tool-call", i, target, prompt, body))
    return out


KINDS: dict[str, Callable[[random.Random, int], list[CorpusRequest]]] = {
    "copy-heavy": copy_heavy, "free": free, "code": code, "nested-schema": nested_schema,
    "flat-schema": flat_schema, "tool-call": tool_call}


def corpus(seed: int = SEED, per_kind: int = PER_KIND) -> list[CorpusRequest]:
    """`per_kind` requests of every kind, kind by kind; each kind from its own generator, seeded
    by the seed and the kind's name (a string seed: the same on every run, whatever PYTHONHASHSEED)."""
    return [r for kind, make in KINDS.items() for r in make(random.Random(f"{seed}:{kind}"), per_kind)]
