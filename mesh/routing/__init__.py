"""The route and its repair: find stages (discovery, peer probes), plan the cut (planner,
stage_fit, stage_cost), claim, prepare and load them (route, artifact_server), and keep the
route serving while stages die or hang (healing).

May import: everything below it (common, config, packages, proto, stage per DESIGN.md §1,
mesh.model, mesh.constraints, mesh.reports, mesh.backend, mesh.speculative, mesh.serving).
"""
