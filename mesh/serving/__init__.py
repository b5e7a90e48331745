"""One request's way through stage 0: admission to a lane, its record (request_state), the
generate loop (propose, send, await, apply), the pipeline that carries each frame through
every stage, the prefix cache of what free lanes hold, and the reply deadline.

Serving runs on whatever pipeline it is handed: it asks for the live one through a small
interface (`requests.LiveRoute`) and never builds or repairs a route itself.

May import: common, config, packages, proto, stage (DESIGN.md §1's list), mesh.model,
mesh.constraints, mesh.reports, mesh.backend, mesh.speculative.
"""
