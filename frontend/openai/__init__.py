"""The OpenAI-compatible HTTP server: app, protocol, serving of completions and chat, middleware,
metrics. One API server process runs `api_server.py`; everything here talks to the EngineCore
through `pagedserve.frontend.async_engine.AsyncEngine`."""
