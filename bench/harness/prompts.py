"""The bench's built-in prompts, and a long one for time to first token."""

from __future__ import annotations

from mesh.model.tokenizer import Tokenizer

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten things to pack for a week of hiking in the mountains.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "Tell a story about a robot learning to paint.",
    "List the planets of the solar system with one fact about each.",
    "Write a JavaScript function that debounces another function, and explain it.",
    "What are the main causes of inflation, and how do central banks respond?",
]
LONG_PROMPT_TOKENS = 512


def long_prompt(tokenizer: Tokenizer) -> str:
    """A chat prompt of about LONG_PROMPT_TOKENS tokens, for time to first token."""
    words = " ".join(PROMPTS).split()
    text, i = "Summarize the following notes.\n", 0
    while len(tokenizer.tokenize(text, False)) < LONG_PROMPT_TOKENS - 40:
        text += words[i % len(words)] + " "
        i += 1
    return text
