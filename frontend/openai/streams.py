"""Streams between the engine and a client: merging several, closing them on a disconnect,
server-sent events, and how much of each choice a stream has sent.

Nothing here runs ahead of the client: `merge_streams` takes a stream's next output only once the
caller is done with the last one, and `SSEResponse` writes as fast as the client reads, so a
client that reads slowly gets merged chunks and costs the server nothing per engine step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.frontend.openai.protocol import ENGINE_ERRORS, APIError, engine_api_error
from pagedserve.frontend.outputs import CompletionOutput

T = TypeVar("T")
_DONE = object()
logger = logging.getLogger("pagedserve.api")


async def first_item(stream: AsyncIterator[T]) -> T:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("a request ended without any output") from None


class Cursor:
    """How much of one choice a stream has sent: text, tokens and (legacy logprobs) text offset."""

    def __init__(self, text_offset: int = 0) -> None:
        self.text_len = 0
        self.num_tokens = 0
        self.text_offset = text_offset
        self.started = False
        self.done = False

    def advance(self, choice: CompletionOutput) -> tuple[str, int] | None:
        """(new text, index of the first new token), or None when nothing changed."""
        if self.done:
            return None
        text = choice.text[self.text_len :]
        start = self.num_tokens
        self.done = choice.finish_reason is not None
        if not text and len(choice.token_ids) == start and not self.done:
            return None
        self.text_len = max(self.text_len, len(choice.text))
        self.num_tokens = len(choice.token_ids)
        return text, start


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as (stream index, item). A stream's next item is taken only
    once the caller is done with its last one (at most one item per stream waits here), so a slow
    caller slows the streams rather than queueing their items. Leaving early cancels (and so
    closes) every stream still running."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    taken = [asyncio.Event() for _ in streams]

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                taken[i].clear()
                queue.put_nowait((i, item, None))
                await taken[i].wait()
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, _DONE, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                remaining -= 1
            else:
                yield i, item
                taken[i].set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def with_ticks(
    stream: AsyncIterator[T], tick_s: float | None = None, cancel: asyncio.Event | None = None
) -> AsyncIterator[T | None]:
    """The items of `stream`, and None after every `tick_s` seconds without one (the caller sends
    a keep-alive); it ends early once `cancel` is set. Leaving closes `stream` (which aborts its
    request in the engine)."""
    waiter = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            waits = {pending} if waiter is None else {pending, waiter}
            done, _ = await asyncio.wait(waits, timeout=tick_s, return_when="FIRST_COMPLETED")
            if pending in done:
                try:
                    item = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield item
            elif waiter is not None and waiter in done:
                return
            else:
                yield None
    finally:
        left = [f for f in (pending, waiter) if f is not None]
        for future in left:
            future.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await stream.aclose()  # type: ignore[attr-defined]


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(coro: Any, request: Request) -> Any:
    """Await `coro` unless the client goes away first; then cancel it (which aborts its requests
    in the engine) and raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends (on a client
    disconnect starlette cancels the send task; the generator may be parked at a `yield`)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def stream_error(e: Exception) -> dict[str, Any]:
    """The error event that ends a stream that failed after its 200 went out."""
    if isinstance(e, APIError):
        return e.body()
    if isinstance(e, ENGINE_ERRORS):
        return engine_api_error(e).body()
    logger.exception("a stream failed")
    return APIError(500, f"Internal error: {type(e).__name__}: {e}").body()


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
