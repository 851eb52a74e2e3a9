"""What every HTTP request of an API server passes first: drain gate, API key, body size limit.

- Draining (after SIGTERM): `/health` and every new request answer 503 (OpenAI's error shape,
  `Connection: close`) while requests already running finish; `/metrics` stays open.
- API key: `Authorization: Bearer KEY` or (Anthropic's clients) `x-api-key: KEY`, compared in
  constant time (`hmac.compare_digest`); `/health` is open, and `/metrics` with `--metrics-public`
  only: its prefix-cache counters would tell any client whether a guessed prompt was cached for
  another (docs/serving.md, Security).
- Body size: a body over `max_request_bytes` is refused with 413 before the app parses any of it
  (by Content-Length, or while reading a chunked body), so a huge body costs no JSON parsing.
- Responses carry `x-pagedserve-api-server: <index>`. Refusals under /v1/messages are in
  Anthropic's error shape, the others in OpenAI's.
- Each request, refused or served, gets a log line once its response ended (request_log.py).
The middleware also counts the requests the app is serving, which is what a drain waits for.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.frontend.openai.messages_protocol import PATH as MESSAGES_PATH
from pagedserve.frontend.openai.messages_protocol import error_body as anthropic_error_body
from pagedserve.frontend.openai.protocol import error_body
from pagedserve.frontend.openai.request_log import log_request, new_tally

logger = logging.getLogger("pagedserve.api")
SERVER_HEADER = b"x-pagedserve-api-server"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class Drain:
    """The drain of one API server: `request(timeout)` (from a signal handler) starts it; `run`
    waits until no request is being served or the deadline passes, then calls `on_timeout` (which
    aborts what still runs, so streams end with an error event) and finally `on_done`."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # requests the app is serving (refused ones not counted)
        self.deadline = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = asyncio.Event()

    def attach(self) -> None:
        self._loop = asyncio.get_running_loop()

    def request(self, timeout: float) -> bool:
        """Start (or shorten) the drain; False when no event loop runs it yet. Signal-safe."""
        if self._loop is None:
            return False
        self.draining = True
        self.deadline = min(self.deadline, time.monotonic() + timeout)
        self._loop.call_soon_threadsafe(self._started.set)
        return True

    async def run(
        self, on_timeout: Callable[[], None], on_done: Callable[[], None], grace: float = 3.0
    ) -> None:
        await self._started.wait()
        logger.info("draining: %d request(s) in flight", self.active)
        while self.active and time.monotonic() < self.deadline:
            await asyncio.sleep(0.05)
        if self.active:
            logger.warning("drain timeout: aborting %d request(s)", self.active)
            on_timeout()
            end = time.monotonic() + grace
            while self.active and time.monotonic() < end:
                await asyncio.sleep(0.05)
        on_done()


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains (up to `drain_timeout` s) and SIGINT or a second signal aborts
    what runs; the drain task sets `should_exit` when it is done."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        timeout = self.drain_timeout if sig == signal.SIGTERM and not self.drain.draining else 0.0
        if not self.drain.request(timeout):  # not serving yet: plain uvicorn shutdown
            super().handle_exit(sig, frame)


class ServerMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        server_index: int,
        drain: Drain | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        metrics_public: bool = False,
        log_requests: bool = False,
        log_prompts: bool = False,
        metrics: Any = None,
    ) -> None:
        """`log_requests`: a line per request (request_log.py), with its prompts if
        `log_prompts`; `metrics`: counts each answered request by endpoint (metrics.py)."""
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests
        self.log_prompts = log_prompts
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = ("/health", "/metrics") if metrics_public else ("/health",)
        self.tag = (SERVER_HEADER, str(server_index).encode())
        self.drain = drain or Drain()
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.log_requests and self.metrics is None:
            return await self._serve(scope, receive, send)
        started = time.monotonic()
        tally = new_tally(scope)
        status = 0  # none sent (the client left first)

        async def status_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, status_send)
        finally:
            path = route_path(scope)
            if self.metrics is not None:
                self.metrics.count_http(path, scope["method"], status or 499)
            if self.log_requests:
                seconds = time.monotonic() - started
                log_request(scope, path, status, seconds, tally, self.log_prompts)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.tag]
            await send(message)

        refusal = self._refusal(scope)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive)
            if body is None:
                refusal = error_response(
                    413, f"The request body exceeds {self.max_request_bytes} bytes.",
                    "invalid_request_error", "request_too_large", route_path(scope),
                )  # fmt: skip
            else:
                receive = _replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, tagged_send)
        self.drain.active += 1
        try:
            await self.app(scope, receive, tagged_send)
        finally:
            self.drain.active -= 1

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        path = route_path(scope)
        if self.drain.draining and path != "/metrics":
            response = error_response(
                503, "The server is shutting down.", "service_unavailable", "server_draining", path
            )
            response.headers["connection"] = "close"
            return response
        if self.api_key is not None and path not in self.open_paths:
            token = api_key_of(scope["headers"])
            if token is None or not hmac.compare_digest(token, self.api_key):
                message = "Invalid or missing API key."
                return error_response(
                    401, message, "invalid_request_error", "invalid_api_key", path
                )
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it exceeds the limit (the rest is left unread)."""
        headers = dict(scope["headers"])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_request_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected: let the app see it
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def route_path(scope: Scope) -> str:
    """The path routes see: with `--root-path /api` uvicorn reports `/api/health` for `/health`
    (the proxy in front stripped the prefix; the app is told it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the buffered body once, then waits on the real one (which
    reports the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def api_key_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    given = dict(headers)
    scheme, _, token = given.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return given.get(b"x-api-key")


def error_response(status: int, message: str, type: str, code: str, path: str = "") -> JSONResponse:
    """An error in OpenAI's shape, or Anthropic's for a path under /v1/messages."""
    if path.startswith(MESSAGES_PATH):
        status = 529 if status == 503 else status
        return JSONResponse(anthropic_error_body(status, message), status)
    return JSONResponse(error_body(message, type, None, code), status)
