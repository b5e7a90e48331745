"""llguidance's view of the target's vocabulary, built once per tokenizer.

It is built from llama.cpp's own vocabulary, so a grammar's tokens are the model's tokens,
special tokens included; building it reads every token (about a second for 49k), so it is
done once, off the event loop, on the first constrained request.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

import llguidance
from llguidance.llamacpp import lltokenizer_from_vocab

if TYPE_CHECKING:
    from mesh.model.tokenizer import Tokenizer

# by id, with the tokenizer itself: llguidance's object points into its vocabulary, so the
# tokenizer must outlive it, and a later tokenizer must never find a freed one's id here
_built: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_lock = threading.Lock()  # two first requests at once build it once


def grammar_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of `tok`'s vocabulary; blocking the first time (run it in a thread).

    Its end tokens are the request's stop tokens (EOS and the turn ends): a grammar that is
    complete allows exactly those."""
    with _lock:
        entry = _built.get(id(tok))
        if entry is None:
            with warnings.catch_warnings():
                # llguidance reads each token's attributes through a call llama.cpp has
                # renamed: one warning per token of the vocabulary says nothing
                warnings.simplefilter("ignore", DeprecationWarning)
                built = lltokenizer_from_vocab(tok.vocab, n_vocab=tok.n_vocab, eos_token=sorted(tok.eos_tokens()))
            entry = _built[id(tok)] = (tok, built)
        return entry[1]
