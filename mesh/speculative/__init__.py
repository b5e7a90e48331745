"""Speculation at stage 0, below the generate loop: the plan (which strategies a request may
use), the proposers (a draft model, prompt lookup, a grammar's forced tokens) and the window
controllers with their cost model. The loop (mesh/serving/generate.py) asks a proposer for
tokens and tells the controller what each step cost; nothing here sends a frame.

May import: common, config, packages, proto, stage (DESIGN.md §1's list), mesh.model,
mesh.constraints, mesh.reports, mesh.backend.
"""
