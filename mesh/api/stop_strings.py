"""Stop strings over text that arrives a piece at a time: where one is found, and how much of
the text so far must wait because it may yet become one."""

from __future__ import annotations


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string begins in `text`, or None."""
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that begins some stop string without being
    all of it: only that much may yet turn out to be a stop, so only that much is held back.

    A 300-character stop string holds back nothing while the text cannot begin it."""
    longest = 0
    for stop in filter(None, stops):  # an empty stop string is never one (request.py refuses them)
        # the candidates are where stop[0] occurs among the last len(stop) - 1 characters,
        # longest suffix first: the first one that begins the stop is this stop's longest
        at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while at != -1 and len(text) - at > longest:
            if stop.startswith(text[at:]):
                longest = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return longest
