"""Workloads more than one scenario decodes: the copy-heavy rename (`ngram`, `prompt_lookup`,
`guard`) and the nested recipe schema (`constrained`, `guard`)."""

from __future__ import annotations

from typing import Any

# SmolLM2-135M copies this one nearly whole (greedy, about 280 tokens) though it seldom does the
# rename; a copy is what the workload needs. Functions with rarer lines, it abandons midway.
COPY_FUNCTION = '''def word_statistics(text, stop_words=None, top=10):
    """Count the words of a text and return the most common ones with a few totals."""
    stop_words = set(stop_words or [])
    counts = {}
    total_words = 0
    total_letters = 0
    longest_word = ""
    for line in text.splitlines():
        for word in line.split():
            word = word.strip(".,;:!?\\"'()[]").lower()
            if not word or word in stop_words:
                continue
            total_words += 1
            total_letters += len(word)
            counts[word] = counts.get(word, 0) + 1
            if len(word) > len(longest_word):
                longest_word = word
    common = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
    average_length = total_letters / total_words if total_words else 0.0
    return {
        "total_words": total_words,
        "unique_words": len(counts),
        "average_length": round(average_length, 2),
        "longest_word": longest_word,
        "most_common": common,
    }
'''
RENAME = ("counts", "frequencies")
COPY_PROMPT = (f"Rewrite this function with the identifier `{RENAME[0]}` renamed to `{RENAME[1]}`.\n\n"
               f"```python\n{COPY_FUNCTION}```")

# A schema that is not the film one the constrained scenario was tuned on: an object of scalars
# and an enum with a list of up to 4 objects in it (issue 42 measured speculation earning less here)
RECIPE: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "servings", "difficulty", "vegetarian", "ingredients"],
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                   "difficulty": {"enum": ["easy", "medium", "hard"]},
                   "vegetarian": {"type": "boolean"},
                   "ingredients": {"type": "array", "maxItems": 4, "items": {
                       "type": "object", "additionalProperties": False, "required": ["name", "grams"],
                       "properties": {"name": {"type": "string", "maxLength": 30},
                                      "grams": {"type": "integer", "minimum": 0}}}}}}
RECIPE_PROMPT = ("Give a recipe you like as JSON: title, servings, difficulty (easy, medium or hard), "
                 "vegetarian, and ingredients, each with its name and grams.")
