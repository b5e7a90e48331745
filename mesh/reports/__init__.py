"""What the mesh reports of itself: the frozen models of /health and the live page, and the
plain counters the pipeline, the healer and the request path keep (hop timings, recoveries,
failures, stage 0's own work, peak memory). Records only: nothing here reads the running mesh.

May import: common, config, packages, proto. Nothing else of mesh/.
"""
