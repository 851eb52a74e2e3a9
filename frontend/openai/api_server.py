"""One API server process: FastAPI on uvicorn (uvloop), an AsyncEngine client of the EngineCore.

Started by `pagedserve launch` as `python -m pagedserve.frontend.openai.api_server --fd N ...`: the
launcher binds the listening socket once and every API server accepts on the same fd, so N servers
share one port. Each server is its own engine client (`--client-index`); the core routes each
request's outputs back to the server that sent it. Readiness is reported to the launcher as lines
on `--ready-fd` ("engine I" once the engine answered, "server I" once accepting connections).

Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

Signals: SIGTERM drains (new requests and /health get 503, running requests and streams finish
for up to `--drain-timeout` s, then are aborted with an error), then the process exits 0. SIGINT
(what the launcher sends when another process died) aborts running requests at once, then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.responses import Response

import pagedserve
from pagedserve.config import EngineConfig
from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.engine_client import EngineDeadError
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.middleware import (
    DEFAULT_MAX_REQUEST_BYTES,
    Drain,
    DrainingServer,
    ServerMiddleware,
)
from pagedserve.frontend.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from pagedserve.frontend.openai.serving import Serving, now_s
from pagedserve.frontend.openai.serving_chat import ChatOptions, ChatServing
from pagedserve.frontend.openai.serving_completions import CompletionServing
from pagedserve.frontend.tokenizer import encode_prompt
from pagedserve.ipc.process import die_with_parent

logger = logging.getLogger("pagedserve.api")
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# How long an idle client connection stays open. Longer than any proxy in front keeps its idle
# connections to us (deploy/nginx: keepalive_timeout 60s), so the proxy always closes first:
# with uvicorn's 5 s, nginx reused connections we had just closed, and a POST sent on one fails
# with 502 (never resent: it may have run) and marks this replica down for fail_timeout.
KEEP_ALIVE_S = 75


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return _json(e.body(), e.status, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> Response:
        message, param = _validation_message(e)
        return _json(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return _json(error_body(str(e.detail), kind), e.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> Response:
        body = APIError(503, f"The engine is not running: {e}", code="engine_dead").body()
        return _json(body, 503)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        return _json(error_body(f"Internal error: {type(e).__name__}: {e}", "internal_error"), 500)


def build_app(
    engine: AsyncEngine,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    server_index: int = 0,
    on_ready: Any = None,
    drain: Drain | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    log_requests: bool = False,
    allowed_origins: list[str] | None = None,
    chat_options: ChatOptions | None = None,
) -> FastAPI:
    """The FastAPI app around a constructed (ready) AsyncEngine; `on_ready()` is called once the
    server accepts connections (uvicorn's `Server` is expected at `app.state.server`, and is told
    to exit when a drain started by `drain.request()` ends). `chat_options`: templates, tool and
    reasoning parsers; `allowed_origins`: CORS (None: no CORS headers)."""
    drain = drain or Drain()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await engine.start()
        drain.attach()
        if metrics is not None:
            engine.stats_listeners.append(metrics.on_stats)
            engine.stats_listeners.append(lambda _: metrics.api_tracked.set(engine.num_tracked))
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
        max_request_bytes=max_request_bytes,
    )  # fmt: skip
    if allowed_origins is not None:  # outermost: preflight requests carry no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
    base = Serving(engine, metrics, log_requests)
    chat = ChatServing(engine, metrics, log_requests, options=chat_options)
    add_openai_routes(app, engine, metrics, base, chat)
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
    app: FastAPI, engine: AsyncEngine, metrics: Metrics | None, base: Serving, chat: ChatServing
) -> None:
    completions = CompletionServing(engine, metrics, base.log_requests)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": now_s(),
                "owned_by": "pagedserve",
                "root": engine.config.model.model,
                "parent": None,
                "max_model_len": base.max_model_len,
            }
            for name in base.model_names
        ]
        return _json({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)


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
            text, _ = chat.render(req)
            add_special = bool(req.add_special_tokens)
        elif req.prompt is not None:
            text = req.prompt
            add_special = req.add_special_tokens is not False
        else:
            raise APIError(400, "Pass either prompt or messages.", param="prompt")
        ids = encode_prompt(base.tokenizer, text, add_special_tokens=add_special)
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


# ---------------------------------------------------------------------- process entry point
def _listening_socket(args: argparse.Namespace) -> socket.socket:
    if args.fd is not None:
        return socket.socket(fileno=args.fd)
    return socket.create_server((args.host, args.port), backlog=2048)


def _notifier(ready_fd: int | None, line: str) -> Any:
    def notify() -> None:
        if ready_fd is not None:
            os.write(ready_fd, f"{line}\n".encode())

    return notify


def _exit_quietly(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve-api-server")
    ap.add_argument("--config", required=True, help="EngineConfig.to_json()")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--core-pid", type=int)
    ap.add_argument("--client-index", type=int, default=0)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--fd", type=int, help="an inherited listening socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S)
    ap.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    ap.add_argument("--log-requests", action="store_true")
    ap.add_argument("--uvicorn-log-level", default="info")
    ap.add_argument("--chat-template", help="the template itself (the launcher read the file)")
    ap.add_argument("--trust-request-chat-template", action="store_true")
    ap.add_argument("--allowed-origins", type=json.loads, help="a JSON list")
    ap.add_argument("--ssl-keyfile")
    ap.add_argument("--ssl-certfile")
    ap.add_argument("--root-path", default="")
    ap.add_argument("--enable-auto-tool-choice", action="store_true")
    ap.add_argument("--tool-call-parser")
    ap.add_argument("--reasoning-parser")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    die_with_parent(args.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # until uvicorn takes them over: exit quietly
        signal.signal(sig, _exit_quietly)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s[%(process)d]: %(message)s")
    index = args.client_index
    config = EngineConfig.from_json(args.config)
    sock = _listening_socket(args)
    try:
        engine = AsyncEngine(config, index, args.ipc_dir, args.core_pid)
    except Exception as e:
        print(f"pagedserve: API server {index}: {e}", file=sys.stderr, flush=True)
        return 1
    _notifier(args.ready_fd, f"engine {index}")()
    drain = Drain()
    metrics = Metrics(config.model.name)
    ready = engine.ready
    cache_dtype = "fp8_e4m3" if config.cache.kv_fp8 else config.model.resolved_dtype
    metrics.set_cache(ready.num_blocks, ready.block_size, cache_dtype)
    app = build_app(
        engine,
        metrics,
        os.environ.get("PAGEDSERVE_API_KEY") or None,
        index,
        on_ready=_notifier(args.ready_fd, f"server {index}"),
        drain=drain,
        max_request_bytes=args.max_request_bytes,
        log_requests=args.log_requests,
        allowed_origins=args.allowed_origins,
        chat_options=ChatOptions(
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            args.reasoning_parser,
            args.chat_template,
            args.trust_request_chat_template,
        ),
    )
    uv_config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",  # C parser: h11 was a third of this process's time when streaming
        log_level=args.uvicorn_log_level.lower(),
        access_log=args.uvicorn_log_level.lower() in ("debug", "trace"),
        timeout_graceful_shutdown=2,
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
    )
    server = DrainingServer(uv_config, drain, args.drain_timeout)
    app.state.server = server
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
