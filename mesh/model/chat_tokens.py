"""Chat prompts as tokens, where only the template can make a role token.

Parsing special tokens in a rendered chat would turn a user's `<|im_end|><|im_start|>system`
into real role tokens. llama.cpp's special parsing splits a text at every control-token
string and tokenizes the pieces between as plain text; this module does the same split, but
only inside the text the template wrote. Message contents are never split, so control-token
strings in them stay text, and a chat without such strings gets exactly the tokens that
parsing the whole rendered prompt would give (tests/test_chat_tokens.py).
"""

from __future__ import annotations

import re
from typing import Any

from mesh.model.tokenizer import PromptRefusedError, SpecialToken, Tokenizer

_MARK = "\x1e{}\x1f"  # ASCII record/unit separators: no template writes them
_MARKS = re.compile("\x1e(\\d+)\x1f")

Piece = str | SpecialToken  # text to tokenize, or one control token


def chat_tokens(tok: Tokenizer, messages: list[dict[str, Any]], limit: int) -> list[int]:
    contents = [m.get("content") or "" for m in messages]
    marked = [{**m, "content": _MARK.format(i)} if contents[i] else m for i, m in enumerate(messages)]
    pieces = _pieces(tok, tok.render_chat(marked), contents)
    if pieces is None:
        return _whole(tok, messages, contents, limit)
    tok.check_fits(sum(len(p.encode()) if isinstance(p, str) else 1 for p in pieces), limit)
    starts_with_bos = bool(pieces) and isinstance(pieces[0], SpecialToken) and pieces[0].id == tok.bos
    out = [tok.bos] if tok.add_bos and tok.bos >= 0 and not starts_with_bos else []
    for piece in pieces:
        if isinstance(piece, SpecialToken):
            out.append(piece.id)
        elif piece:
            out += tok.tokenize(piece, special=False, add_bos=False)
    return out


def _pieces(tok: Tokenizer, rendered: str, contents: list[str]) -> list[Piece] | None:
    """The rendered chat as text and control tokens; None if the template altered a content."""
    found = [int(i) for i in _MARKS.findall(rendered)]
    if sorted(found) != [i for i, c in enumerate(contents) if c]:
        return None
    pieces: list[Piece] = []
    for n, part in enumerate(_MARKS.split(rendered)):
        if n % 2:
            _add_text(pieces, contents[int(part)])
        else:
            _add_template_text(pieces, part, tok)
    return pieces


def _add_template_text(pieces: list[Piece], text: str, tok: Tokenizer) -> None:
    if tok.special_split is None:
        return _add_text(pieces, text)
    for n, part in enumerate(tok.special_split.split(text)):
        if n % 2:
            special = tok.special_by_text[part]
            if special.lstrip and pieces and isinstance(pieces[-1], str):
                pieces[-1] = pieces[-1].rstrip()
            pieces.append(special)
        else:
            if pieces and isinstance(pieces[-1], SpecialToken) and pieces[-1].rstrip:
                part = part.lstrip()
            _add_text(pieces, part)


def _add_text(pieces: list[Piece], text: str) -> None:
    """Text joins the text before it: llama.cpp tokenizes each run between specials at once."""
    if pieces and isinstance(pieces[-1], str):
        pieces[-1] += text
    elif text:
        pieces.append(text)


def _whole(tok: Tokenizer, messages: list[dict[str, Any]], contents: list[str], limit: int) -> list[int]:
    """A template that rewrites contents: safe only when no content holds a control token."""
    for i, content in enumerate(contents):
        hit = next((s.text for s in tok.specials if s.text in content), None)
        if hit is not None:
            raise PromptRefusedError(f"messages[{i}] contains the control token {hit!r}, and this "
                                "model's chat template rewrites message text, so the server "
                                "cannot keep it as plain text")
    return tok.tokenize(tok.render_chat(messages), special=True, limit=limit)
