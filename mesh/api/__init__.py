"""The OpenAI-compatible HTTP API: request validation, the app, response shaping and the server.

May import: every part of mesh/ but mesh.cli. It talks to the mesh through mesh.backend's
`Backend`; only server.py, which starts the coordinator, names it.
"""
