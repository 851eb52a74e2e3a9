"""The OpenAI-compatible HTTP server: app, protocol, serving of completions and chat, middleware,
metrics. One API server process (entrypoints/api_server.py) serves the app `api_server.py` builds;
everything here talks to the EngineCore through `pagedserve.frontend.async_engine.AsyncEngine`."""
