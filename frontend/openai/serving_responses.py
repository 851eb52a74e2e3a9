"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id} and
POST /v1/responses/{id}/cancel: a protocol layer over the chat code.

A request becomes a chat request (responses_protocol.py), which `ChatServing.start` checks,
renders, tokenizes and admits exactly as /v1/chat/completions does; its reply is read by the
same `ChoiceStream` (reasoning, content, tool calls) and turned into Responses output items and
events (response_output.py). Stored responses: response_store.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from pagedserve.frontend.openai.chat_output import ChoiceStream
from pagedserve.frontend.openai.protocol import APIError
from pagedserve.frontend.openai.response_output import ResponseOutput, new_id
from pagedserve.frontend.openai.response_store import ResponseStore
from pagedserve.frontend.openai.responses_protocol import (
    ResponsesRequest,
    chat_request,
    conversation,
)
from pagedserve.frontend.openai.serving_chat import ChatServing, Started
from pagedserve.frontend.openai.streams import (
    ClientDisconnected,
    SSEResponse,
    run_until_disconnect,
    sse,
    stream_error,
    with_ticks,
)
from pagedserve.frontend.outputs import RequestOutput

_encode = msgspec.json.encode
CANCEL_WAIT_S = 10.0


@dataclass
class Run:
    """One response being generated: what it asked, what it has made, how to stop it."""

    req: ResponsesRequest
    head: dict[str, Any]
    messages: list[dict[str, Any]]  # its conversation, as chat messages (stored with the reply)
    started: Started
    output: ResponseOutput
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future[dict[str, Any]] = field(default_factory=asyncio.Future)
    final: RequestOutput | None = None


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self.runs: dict[str, Run] = {}

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self._stored(req.previous_response_id, "previous_response_id").messages
        messages = conversation(req, history)
        chat_req = chat_request(req, messages)
        try:
            started = await self.chat.start(chat_req, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        include = req.include or ()
        output = ResponseOutput(req.summary, "reasoning.encrypted_content" in include)
        head = self._head(req, new_id("resp"))
        run = Run(req, head, messages, started, output)
        if req.stream:
            return SSEResponse(self._stream(run))
        try:
            body = await run_until_disconnect(self._collect(run), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        return Response(_encode(body), 200)

    # ------------------------------------------------------------------ generation
    @contextmanager
    def _running(self, run: Run) -> Iterator[None]:
        """While a response generates, GET and cancel find it. Its `done` future gets the final
        body (`_complete`), or is cancelled if it failed."""
        self.runs[run.head["id"]] = run
        try:
            yield
        finally:
            self.runs.pop(run.head["id"], None)
            if not run.done.done():
                run.done.cancel()

    async def _run(self, run: Run) -> AsyncIterator[None]:
        """Feed the reply's deltas to `run.output`; yields whenever events are queued."""
        choice = ChoiceStream(run.started.shape)
        outputs = with_ticks(run.started.stream, cancel=run.cancel)
        try:
            async for out in outputs:
                assert out is not None  # no ticks asked for
                c = out.outputs[0]
                for delta in choice.deltas(c.text, final=c.finish_reason is not None):
                    run.output.feed(delta)
                run.final = out
                yield None
        finally:
            await outputs.aclose()  # aborts the request if it did not finish
            await run.started.stream.aclose()  # type: ignore[attr-defined]  (if never started)

    async def _collect(self, run: Run) -> dict[str, Any]:
        with self._running(run):
            updates = self._run(run)
            try:
                async for _ in updates:
                    pass
            finally:
                await updates.aclose()
            return self._complete(run)

    async def _stream(self, run: Run) -> AsyncIterator[bytes]:
        sequence = 0

        def event(body: dict[str, Any]) -> bytes:
            nonlocal sequence
            body["sequence_number"], sequence = sequence, sequence + 1
            return b"event: " + body["type"].encode() + b"\n" + sse(_encode(body))

        def flush() -> list[bytes]:
            events, run.output.events = run.output.events, []
            return [event(e) for e in events]

        with self._running(run):
            updates = self._run(run)
            try:
                yield event({"type": "response.created", "response": _copy_head(run.head)})
                yield event({"type": "response.in_progress", "response": _copy_head(run.head)})
                async for _ in updates:
                    for chunk in flush():
                        yield chunk
                body = self._complete(run)
                for chunk in flush():
                    yield chunk
                # cancelled too: an end short of completion (OpenAI has no event of its own)
                done = body["status"] == "completed"
                yield event({"type": "response.completed" if done else "response.incomplete",
                             "response": body})  # fmt: skip
            except Exception as e:
                error = stream_error(e)["error"]
                yield event({"type": "error", "message": error["message"],
                             "code": error["code"], "param": error["param"]})  # fmt: skip
            finally:
                await updates.aclose()
                await run.started.stream.aclose()  # type: ignore[attr-defined]  (never started)

    def _complete(self, run: Run) -> dict[str, Any]:
        """The finished response (stored if asked); ends its output items."""
        final, c = run.final, run.final.outputs[0] if run.final else None
        body = run.head
        if run.cancel.is_set() and (c is None or c.finish_reason is None):
            body["status"] = "cancelled"
        elif c is not None and c.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        run.output.close("completed" if body["status"] == "completed" else "incomplete")
        body["output"] = run.output.items
        body["completed_at"] = time.time() if body["status"] == "completed" else None
        num_prompt = len(run.started.prompt_token_ids)
        generated = list(c.token_ids) if c is not None else []
        cached = final.num_cached_tokens if final is not None else 0
        reasoning = _reasoning_tokens(run.started.shape.reasoning, generated, run.output.items)
        body["usage"] = {
            "input_tokens": num_prompt,
            # cached tokens only with --enable-prompt-tokens-details; no cache-write accounting
            "input_tokens_details": {
                "cached_tokens": cached if self.chat.prompt_tokens_details else 0,
                "cache_write_tokens": 0,
            },
            "output_tokens": len(generated),
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": num_prompt + len(generated),
        }
        if run.req.store:
            self.store.put(body["id"], body, [*run.messages, run.output.message()])
        if not run.done.done():
            run.done.set_result(body)
        return body

    # ------------------------------------------------------------------ stored responses
    def _stored(self, resp_id: str, param: str | None = None) -> Any:
        entry = self.store.get(resp_id)
        if entry is None:
            raise APIError(404, f"Response with id '{resp_id}' not found.", param=param,
                           code="response_not_found")  # fmt: skip
        return entry

    def get(self, resp_id: str) -> Response:
        run = self.runs.get(resp_id)
        if run is not None and run.req.store:
            return Response(_encode(_copy_head(run.head)), 200)
        return Response(_encode(self._stored(resp_id).body), 200)

    def delete(self, resp_id: str) -> Response:
        if not self.store.delete(resp_id):
            self._stored(resp_id)  # the 404
        return Response(_encode({"id": resp_id, "object": "response", "deleted": True}), 200)

    async def cancel(self, resp_id: str) -> Response:
        """Stop a running response; answer with it as it ended (status cancelled)."""
        run = self.runs.get(resp_id)
        if run is None:
            body = self._stored(resp_id).body
            raise APIError(400, f"Response '{resp_id}' is not running (its status is "
                           f"{body['status']}).", param="response_id")  # fmt: skip
        run.cancel.set()
        try:
            body = await asyncio.wait_for(asyncio.shield(run.done), CANCEL_WAIT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            body = _copy_head(run.head)
        return Response(_encode(body), 200)

    def _head(self, req: ResponsesRequest, resp_id: str) -> dict[str, Any]:
        """The response object as it starts (status in_progress, no output yet)."""
        reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning else None
        return {
            "id": resp_id,
            "object": "response",
            "created_at": time.time(),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model or self.chat.model_name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": reasoning,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": _echo_format(req)},
            "tool_choice": req.tool_choice or "auto",
            "tools": [_echo_tool(t) for t in req.tools or ()],
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _copy_head(head: dict[str, Any]) -> dict[str, Any]:
    return {**head, "output": list(head["output"])}


def _reasoning_tokens(parser: Any, token_ids: list[int], items: list[dict[str, Any]]) -> int:
    """With a reasoning parser, the tokens up to and including the one that ends the reasoning
    (all of them when the reply is only reasoning); else 0."""
    if parser is None or parser.end_token_id is None:
        return 0
    if parser.end_token_id in token_ids:
        return token_ids.index(parser.end_token_id) + 1
    only_reasoning = bool(items) and all(i["type"] == "reasoning" for i in items)
    return len(token_ids) if only_reasoning else 0


def _echo_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return {"type": "json_schema", "name": fmt.name or "response", "schema": fmt.json_schema or {},
            "strict": fmt.strict}  # fmt: skip


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}  # fmt: skip
