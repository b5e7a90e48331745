"""Reading the running coordinator: Prometheus metrics, the counters at one instant
(readings), and the sampler that builds the page's snapshot once a second.

May import: every part of mesh/ below the API (mesh.coordinator included), never mesh.api or
mesh.cli.
"""
