"""TextStream: token bytes become text deltas, and a UTF-8 character is never split."""

from __future__ import annotations

import random

import pytest

from mesh.model.tokenizer import TextStream


class _Bytes:
    """Token i detokenizes to pieces[i]."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self.pieces[t] for t in tokens)


def _deltas(*pieces: bytes) -> tuple[list[str], str]:
    stream = TextStream(_Bytes(*pieces))
    return [stream.push(i) for i in range(len(pieces))], stream.flush()


def test_ascii_passes_through_token_by_token():
    assert _deltas(b"He", b"llo", b" ", b"world") == (["He", "llo", " ", "world"], "")


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_a_character_split_across_tokens_comes_out_whole_once_complete(char: str):
    data = char.encode()
    pieces = [b"a", *(data[i : i + 1] for i in range(len(data))), b"b"]
    deltas, rest = _deltas(*pieces)
    assert deltas == ["a", *[""] * (len(data) - 1), char, "b"]
    assert rest == ""


def test_a_split_character_joins_the_text_that_follows_it_in_the_same_token():
    data = "€".encode()
    assert _deltas(b"x" + data[:1], data[1:2], data[2:] + b"yz") == (["", "", "x€yz"], "")
    # and text before the incomplete tail waits with it
    assert _deltas(b"ok" + data[:2], data[2:]) == (["", "ok€"], "")


def test_invalid_bytes_become_replacement_characters_without_stalling():
    # a trailing stray byte waits one token (it may look like the start of a character),
    # then is replaced; nothing is lost
    assert _deltas(b"a\x80", b"b") == (["", "a\ufffdb"], "")
    assert _deltas(b"a\x80") == ([""], "a\ufffd")
    # a lead byte followed by a non-continuation: invalid in the middle, so it is replaced now
    assert _deltas(b"\xc3A", b"b") == (["\ufffdA", "b"], "")
    # four pending bytes that still do not decode are not an incomplete character
    deltas, _ = _deltas(b"\xf0\x9f\x98", b"\x41")
    assert deltas[0] == ""
    assert deltas[1] == "\ufffdA"


def test_flush_replaces_an_unfinished_character_and_empties_the_buffer():
    stream = TextStream(_Bytes(b"a", "😀".encode()[:2]))
    assert stream.push(0) == "a"
    assert stream.push(1) == ""
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""


def test_tokens_that_detokenize_to_nothing_yield_nothing():
    assert _deltas(b"", b"a", b"") == (["", "a", ""], "")


def test_deltas_of_any_bytes_join_to_the_whole_decoded_at_once():
    """A character begun after invalid bytes still waits for its end (random-weight models emit
    such byte runs: b"\\x80\\xd5" then b"\\x8a" is one replacement, then "\\u054a")."""
    assert "".join(_deltas(b"\x80\xd5", b"\x8a", b"J")[0]) == "\ufffd\u054aJ"
    rng = random.Random(0)
    for _ in range(500):
        pieces = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4))) for _ in range(12)]
        deltas, rest = _deltas(*pieces)
        assert "".join(deltas) + rest == b"".join(pieces).decode(errors="replace")
