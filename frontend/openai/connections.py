"""Client connections of one API server: read deadlines and a connection limit.

uvicorn closes a kept-alive connection that stays idle, and nothing else: a connection that
sends no bytes, half a request head or half a body stays open for ever, and ~1,000 of them take
every descriptor of a 1,024-descriptor server (its `/health` then fails). `GuardedProtocol` is
uvicorn's httptools protocol with these hooks:
- head deadline (`--timeout-header`): a request's line and headers arrive within this many
  seconds of the connection opening or of the request's first byte (the idle time between two
  requests of a kept-alive connection is uvicorn's `timeout_keep_alive`);
- body deadline (`--timeout-body`): the whole body arrives within this many seconds of the head.
  A connection past a deadline is closed, after a 408 when a request had begun and no response
  has started;
- connection limit (`--max-connections`, capped below the descriptor limit): a connection
  beyond it first closes the oldest connection that waits for a request (idle, or sending its
  head): such a connection holds a descriptor and nothing else. If every other connection is
  serving a request, the new one gets 503 for everything but `/health`, and is then closed.
uvicorn's own `limit_concurrency` is not used: it answers 503 to `/health` too and closes
nothing. A slow body in flight is bounded by its deadline, not evicted.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.frontend.openai.middleware import error_response, route_path
from pagedserve.frontend.openai.protocol import error_body

logger = logging.getLogger("pagedserve.api")
# Descriptors kept for everything but client connections: the listening socket, ZeroMQ sockets,
# prometheus' multiprocess files, logs, tokenizer files, and /health's own connection.
RESERVED_FDS = 128


class ConnectionGuard:
    """The limits of one server and its connections; `protocol` is uvicorn's `http` class.

    `waiting` holds the open connections that wait for a request, oldest first (a dict is an
    ordered set): the ones a new connection may close when the limit is reached. Deadlines are
    checked by one sweep a second (a quarter of the shortest deadline if less), not by a timer
    per request: arming and cancelling uvloop timers cost ~9 us per request on a busy machine;
    a deadline then closes up to one sweep late."""

    def __init__(self, timeout_header: float, timeout_body: float, max_connections: int) -> None:
        assert timeout_header > 0 and timeout_body > 0 and max_connections >= 1
        self.timeout_header = timeout_header
        self.timeout_body = timeout_body
        self.max_connections = max_connections
        self.sweep_s = min(1.0, timeout_header / 4, timeout_body / 4)
        self.open: set[GuardedProtocol] = set()
        self.waiting: dict[GuardedProtocol, None] = {}
        self.sweeping = False

    def protocol(self, **kwargs: Any) -> GuardedProtocol:
        return GuardedProtocol(guard=self, **kwargs)

    def admit(self, conn: GuardedProtocol) -> bool:
        """Count a new connection, closing waiting ones to stay within the limit; False when
        it is over the limit anyway (every other connection is serving a request)."""
        if not self.sweeping:
            self.sweeping = True
            conn.loop.call_later(self.sweep_s, self._sweep, conn.loop)
        self.open.add(conn)
        while len(self.open) > self.max_connections and len(self.waiting) > 0:
            oldest = next(iter(self.waiting))
            self.forget(oldest)
            oldest.transport.close()
        self.waiting[conn] = None
        return len(self.open) <= self.max_connections

    def forget(self, conn: GuardedProtocol) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for conn in [c for c in self.open if c.deadline is not None and c.deadline <= now]:
            conn.expire()
        loop.call_later(self.sweep_s, self._sweep, loop)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the limit of its ConnectionGuard.
    `deadline` (loop time) is when the head or body being read must be complete; None while
    no request is being read."""

    def __init__(self, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard = guard
        self.deadline: float | None = None
        self.reading_body = False  # which deadline `deadline` is
        self.request_begun = False  # bytes of a request arrived; its response has not ended

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            logger.warning("%d connections: over --max-connections", len(self.guard.open))
            self.app = health_only(self.app)
        self.deadline = self.loop.time() + self.guard.timeout_header

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline = None
        self.guard.forget(self)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.request_begun = True
        # The next request of a kept-alive connection. One pipelined behind a response still
        # underway gets no deadline here: uvicorn's keep-alive timer follows that response.
        if self.deadline is None and (self.cycle is None or self.cycle.response_complete):
            self.deadline = self.loop.time() + self.guard.timeout_header

    def on_headers_complete(self) -> None:
        self.guard.waiting.pop(self, None)
        self.deadline = self.loop.time() + self.guard.timeout_body  # bodiless: ends at once
        self.reading_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.deadline = None
        self.reading_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.request_begun = False
        if self.timeout_keep_alive_task is not None:  # kept alive, idle until the next request
            self.guard.waiting[self] = None

    def expire(self) -> None:
        """Past the deadline: close, with a 408 answering the request that began unless it was
        answered or waits behind another (the head deadline runs only while no response is
        underway: see on_message_begin)."""
        self.deadline = None
        if self.transport.is_closing():
            return
        flag = "--timeout-body" if self.reading_body else "--timeout-header"
        if self.reading_body:
            cycle = self.cycle
            answer = cycle is not None and not cycle.response_started and not self.pipeline
        else:
            answer = self.request_begun
        if answer:
            seconds = self.guard.timeout_body if self.reading_body else self.guard.timeout_header
            self.transport.write(_timeout_response(seconds, flag))
        self.transport.close()


def _timeout_response(seconds: float, flag: str) -> bytes:
    part = "headers" if flag == "--timeout-header" else "body"
    message = f"The request {part} did not arrive within {seconds:g} s ({flag})."
    body = msgspec.json.encode(error_body(message, "invalid_request_error", None, "timeout"))
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def health_only(app: ASGIApp) -> ASGIApp:
    """The app of a connection over the limit: /health as usual, 503 for the rest; every
    response closes the connection."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        async def closing_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        if scope["type"] != "http" or route_path(scope) == "/health":
            return await app(scope, receive, closing_send)
        message = "The server holds too many connections (--max-connections); retry later."
        response = error_response(503, message, "service_unavailable", "too_many_connections")
        response.headers["retry-after"] = "1"
        await response(scope, receive, closing_send)

    return guarded


def connection_limit(requested: int) -> int:
    """`requested`, or less where the descriptor limit (raised to its hard limit first, as
    vLLM does) leaves fewer than RESERVED_FDS besides."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or requested <= soft - RESERVED_FDS:
        return requested
    limit = max(1, soft - RESERVED_FDS)
    logger.warning(
        "--max-connections %d lowered to %d: %d file descriptors (ulimit -n)",
        requested,
        limit,
        soft,
    )
    return limit
