"""Structured output at stage 0: grammars compiled with llguidance, one matcher per request,
and the per-row masks a frame carries to the final stage (DESIGN.md §9).

May import: common, config, stage (DESIGN.md §1's list), mesh.model.
"""
