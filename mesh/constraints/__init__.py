"""Structured output at stage 0 (issue 27): grammars compiled with llguidance, one matcher
per request, and the per-row masks a frame carries to the final stage (DESIGN.md §9)."""
