"""The FastAPI app of one API server process: OpenAI routes, utility routes, error handlers,
around an AsyncEngine client of the EngineCore (the process itself: entrypoints/api_server.py).
The coding agents' APIs (OpenAI Responses, Anthropic Messages) are routed in agent_routes.py.

Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, or under
/v1/messages in Anthropic's (`{"type": "error", "error": {"type", "message"}}`); the engine
client's own errors (pagedserve/errors.py) are mapped to statuses here.

Signals: SIGTERM drains (new requests and /health get 503, running requests and streams finish
for up to `--drain-timeout` s, then are aborted with an error), then the process exits 0. SIGINT
(what the launcher sends when another process died) aborts running requests at once, then exits.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.responses import Response

import pagedserve
from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.openai.agent_routes import add_agent_routes
from pagedserve.frontend.openai.lora_routes import add_lora_routes
from pagedserve.frontend.openai.messages_protocol import PATH as MESSAGES_PATH
from pagedserve.frontend.openai.messages_protocol import error_body as anthropic_error_body
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.middleware import (
    DEFAULT_MAX_REQUEST_BYTES,
    Drain,
    ServerMiddleware,
    api_key_of,
    route_path,
)
from pagedserve.frontend.openai.protocol import (
    ENGINE_ERRORS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    engine_api_error,
)
from pagedserve.frontend.openai.response_store import ResponseStore
from pagedserve.frontend.openai.serving import Serving, now_s
from pagedserve.frontend.openai.serving_chat import ChatOptions, ChatServing
from pagedserve.frontend.openai.serving_completions import CompletionServing
from pagedserve.frontend.openai.serving_pooling import PoolingServing, add_pooling_routes
from pagedserve.ipc.messages import MAX_CACHE_SALT, valid_cache_salt

logger = logging.getLogger("pagedserve.api")
CACHE_SALT_BY = ("none", "user", "api-key")


@dataclass(frozen=True)
class TenancyOptions:
    """What one client may learn of another's requests (docs/serving.md, Security):
    `--enable-prompt-tokens-details` reports `usage.prompt_tokens_details.cached_tokens`;
    `--cache-salt-by user|api-key` salts each request's prefix cache by its `user` field or the
    API key it presented; `--metrics-public` serves /metrics without the API key."""

    prompt_tokens_details: bool = False
    cache_salt_by: str = "none"
    metrics_public: bool = False

    def __post_init__(self) -> None:
        assert self.cache_salt_by in CACHE_SALT_BY, self.cache_salt_by


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg', 'invalid')}{more}", param


def _error(request: Request, error: APIError) -> Response:
    """`error` in OpenAI's shape, or in Anthropic's (503 as its 529) under /v1/messages."""
    if route_path(request.scope).startswith(MESSAGES_PATH):
        status = 529 if error.status == 503 else error.status
        return _json(anthropic_error_body(status, error.message), status, error.headers)
    return _json(error.body(), error.status, error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return _error(request, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        message, param = _validation_message(e)
        return _error(request, APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return _error(request, APIError(e.status_code, str(e.detail), type=kind))

    async def engine_error(request: Request, e: Exception) -> Response:
        return _error(request, engine_api_error(e))

    for error_class in ENGINE_ERRORS:
        app.add_exception_handler(error_class, engine_error)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        message = f"Internal error: {type(e).__name__}: {e}"
        return _error(request, APIError(500, message, type="internal_error"))


def build_app(
    engine: AsyncEngine,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    server_index: int = 0,
    on_ready: Any = None,
    drain: Drain | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    log_requests: bool = False,
    log_prompts: bool = False,
    allowed_origins: list[str] | None = None,
    chat_options: ChatOptions | None = None,
    tenancy: TenancyOptions | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The FastAPI app around a constructed (ready) AsyncEngine; `on_ready()` is called once the
    server accepts connections (uvicorn's `Server` is expected at `app.state.server`, and is told
    to exit when a drain started by `drain.request()` ends). `chat_options`: templates, tool and
    reasoning parsers; `allowed_origins`: CORS (None: no CORS headers); `response_store`: the
    Responses API's stored responses (default: its default bounds)."""
    drain = drain or Drain()
    tenancy = tenancy or TenancyOptions()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await engine.start()
        drain.attach()
        if metrics is not None:
            engine.stats_listeners.append(metrics.on_stats)
            engine.stats_listeners.append(lambda *_: metrics.api_tracked.set(engine.num_tracked))
        tasks = [
            asyncio.ensure_future(_notify_when_started(app, on_ready)),
            asyncio.ensure_future(drain.run(lambda: _abort_all(engine), lambda: _exit(app))),
        ]
        yield
        for task in tasks:
            task.cancel()
        engine.shutdown()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(
        ServerMiddleware, api_key=api_key, server_index=server_index, drain=drain,
        max_request_bytes=max_request_bytes, metrics_public=tenancy.metrics_public,
        log_requests=log_requests, log_prompts=log_prompts, metrics=metrics,
    )  # fmt: skip
    if allowed_origins is not None:  # outermost: preflight requests carry no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    details = tenancy.prompt_tokens_details
    base = Serving(engine, metrics, details)
    chat = ChatServing(engine, metrics, chat_options, details)
    add_openai_routes(app, engine, base, chat, tenancy.cache_salt_by)
    add_pooling_routes(app, PoolingServing(engine, metrics, details), _json)
    salt = functools.partial(salt_by_tenant, tenancy.cache_salt_by)
    add_agent_routes(app, chat, response_store or ResponseStore(), salt)
    add_utility_routes(app, metrics, base, chat)
    return app


def _abort_all(engine: AsyncEngine) -> None:
    message = "The server is shutting down; the request was aborted (drain timeout)."
    engine.abort_all(APIError(503, message, code="server_shutting_down"))


def _exit(app: FastAPI) -> None:
    server = getattr(app.state, "server", None)
    if server is not None:
        server.should_exit = True


def add_openai_routes(
    app: FastAPI, engine: AsyncEngine, base: Serving, chat: ChatServing, cache_salt_by: str
) -> None:
    completions = CompletionServing(engine, base.metrics, base.prompt_tokens_details)
    add_lora_routes(app, engine, base.model_names)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": now_s(),
                "owned_by": "pagedserve",
                "root": engine.config.model.hf_dir,  # a GGUF's converted config and tokenizer
                "parent": None,
                "max_model_len": base.max_model_len,
            }
            for name in base.model_names
        ]
        for card in engine.loras.cards() if engine.loras is not None else []:
            cards.append({**cards[0], **card})  # an adapter: its path as root, the base as parent
        return _json({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        salt_by_tenant(cache_salt_by, req, raw)
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        salt_by_tenant(cache_salt_by, req, raw)
        return await chat.create(req, raw)


def salt_by_tenant(by: str, req: Any, raw: Request) -> None:
    """Check the request's `cache_salt`; with `--cache-salt-by user|api-key` replace it by a hash
    of (mode, tenant, its own salt), so a tenant's requests share cached blocks only among
    themselves (and, with a salt of their own, only with the same salt). A request without a
    tenant (no `user`, no API key) keeps its own salt, or none. `req`: any request with
    `cache_salt` and `user`."""
    if req.cache_salt is not None and not valid_cache_salt(req.cache_salt):
        message = f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters."
        raise APIError(400, message, param="cache_salt")
    tenant = None
    if by == "user":
        tenant = req.user
    elif by == "api-key":
        key = api_key_of(raw.scope["headers"])
        tenant = key.decode("latin-1") if key else None
    if tenant:
        key = msgspec.json.encode([by, tenant, req.cache_salt])
        req.cache_salt = hashlib.blake2b(key, digest_size=16).hexdigest()


def add_utility_routes(
    app: FastAPI, metrics: Metrics | None, base: Serving, chat: ChatServing
) -> None:
    """Health, version, Prometheus metrics and vLLM's /tokenize and /detokenize."""

    @app.get("/health")
    async def health() -> Response:
        base.check_alive()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": pagedserve.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are disabled")
        body, content_type = metrics.render()
        return Response(body, 200, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        base.check_model(req.model)
        if req.messages is not None:
            text, param = chat.render(req), "messages"
            add_special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text, param = req.prompt, "prompt"
            add_special = req.add_special_tokens is not False
        else:
            raise APIError(400, "Pass either prompt or messages.", param="prompt")
        (ids,) = await base.tokenize([text], add_special, param)
        strs = base.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = {"count": len(ids), "max_model_len": base.max_model_len, "tokens": ids}
        return _json({**body, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        base.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < base.vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of vocabulary.", param="tokens")
        return _json({"prompt": base.tokenizer.decode(req.tokens)})


async def _notify_when_started(app: FastAPI, on_ready: Any) -> None:
    server = getattr(app.state, "server", None)
    while server is not None and not server.started:
        await asyncio.sleep(0.02)
    if on_ready is not None:
        on_ready()
