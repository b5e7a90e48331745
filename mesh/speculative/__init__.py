"""Speculative decoding at stage 0: the plan, the draft, the window controller and the verify loop."""
