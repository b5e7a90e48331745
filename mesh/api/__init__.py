"""The OpenAI-compatible HTTP API: request validation, the app, response shaping and the server."""
