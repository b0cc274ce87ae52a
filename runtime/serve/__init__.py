"""`sparkq serve`: the engine thread with continuous batching (engine.py) and the OpenAI-compatible app (server.py)."""
