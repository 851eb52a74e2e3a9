"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): a protocol layer
over the chat code.

A request becomes a chat request (messages_protocol.py) that `ChatServing.start` checks, renders,
tokenizes and admits as /v1/chat/completions does; the reply is read by the same `ChoiceStream`
and turned into content blocks (`thinking`, `text`, `tool_use`) and Anthropic's stream events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`,
and a `ping` after the start and every PING_S seconds without output).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from pagedserve.frontend.openai.chat_output import ChoiceStream
from pagedserve.frontend.openai.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    error_body,
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
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput

_encode = msgspec.json.encode
PING_S = 15.0
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}  # fmt: skip


class Blocks:
    """Content blocks built from chat deltas, and the stream events that build them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open = False
        self._arguments: dict[int, str] = {}  # tool_use block index -> its input JSON so far

    def feed(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._add("thinking", delta["reasoning_content"])
        if delta.get("content"):
            self._add("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                self._start({"type": "tool_use", "id": call["id"],
                             "name": call["function"]["name"], "input": {}})  # fmt: skip
            if call["function"].get("arguments"):
                self._add("tool_use", call["function"]["arguments"])

    def close(self) -> None:
        """End the last block; each tool_use block gets its input."""
        self._end()
        for index, arguments in self._arguments.items():
            self.blocks[index]["input"] = _input(arguments)

    @property
    def num_calls(self) -> int:
        return len(self._arguments)

    def _end(self) -> None:
        if self._open:
            self._open = False
            self.events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})

    def _start(self, block: dict[str, Any]) -> None:
        self._end()
        self._open = True
        self.blocks.append(block)
        if block["type"] == "tool_use":
            self._arguments[len(self.blocks) - 1] = ""
        self.events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                            "content_block": dict(block)})  # fmt: skip

    def _add(self, kind: str, text: str) -> None:
        if not self._open or self.blocks[-1]["type"] != kind:
            assert kind != "tool_use", "a call's arguments follow its start"
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""  # nothing to verify: thinking comes back as it went
            self._start(block)
        index = len(self.blocks) - 1
        if kind == "tool_use":
            self._arguments[index] += text
        else:
            self.blocks[index][kind] += text
        name, field = _DELTAS[kind]
        self.events.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": name, field: text}})  # fmt: skip


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}  # cut short (max_tokens): the partial JSON went out in the deltas
    return value if isinstance(value, dict) else {"value": value}


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        chat_req = chat_request(req)
        self.chat.check_model(chat_req.model)
        self.chat._shape(chat_req)  # tool_choice checked as a request would be
        (ids,) = await self.chat.tokenize([self.chat.render(chat_req)], False, "messages")
        return Response(_encode({"input_tokens": len(ids)}), 200)

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        chat_req = chat_request(req)
        try:
            started = await self.chat.start(chat_req, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        head = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(started, None),
        }
        if req.stream:
            return SSEResponse(self._stream(head, started))
        try:
            body = await run_until_disconnect(self._collect(head, started), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        return Response(_encode(body), 200)

    async def _collect(self, head: dict[str, Any], started: Started) -> dict[str, Any]:
        blocks, choice, final = Blocks(), ChoiceStream(started.shape), None
        outputs = with_ticks(started.stream)
        try:
            async for out in outputs:
                assert out is not None
                final, c = out, out.outputs[0]
                for delta in choice.deltas(c.text, final=c.finish_reason is not None):
                    blocks.feed(delta)
        finally:
            await outputs.aclose()  # aborts the request if it did not finish
            await started.stream.aclose()  # type: ignore[attr-defined]
        assert final is not None
        blocks.close()
        return {**head, "content": blocks.blocks, **self._stop(final.outputs[0], blocks),
                "usage": self._usage(started, final)}  # fmt: skip

    async def _stream(self, head: dict[str, Any], started: Started) -> AsyncIterator[bytes]:
        blocks, choice, final = Blocks(), ChoiceStream(started.shape), None

        def flush() -> list[bytes]:
            events, blocks.events = blocks.events, []
            return [_event(e) for e in events]

        outputs = with_ticks(started.stream, PING_S)
        try:
            yield _event({"type": "message_start", "message": head})
            yield _event({"type": "ping"})
            async for out in outputs:
                if out is None:
                    yield _event({"type": "ping"})
                    continue
                final, c = out, out.outputs[0]
                for delta in choice.deltas(c.text, final=c.finish_reason is not None):
                    blocks.feed(delta)
                for chunk in flush():
                    yield chunk
            assert final is not None
            blocks.close()
            for chunk in flush():
                yield chunk
            usage = self._usage(started, final)
            yield _event({"type": "message_delta", "delta": self._stop(final.outputs[0], blocks),
                          "usage": usage})  # fmt: skip
            yield _event({"type": "message_stop"})
        except Exception as e:
            error = stream_error(e)["error"]
            status = {"service_unavailable": 529, "invalid_request_error": 400}
            yield _event(error_body(status.get(error["type"], 500), error["message"]))
        finally:
            await outputs.aclose()  # aborts the request if it did not finish
            await started.stream.aclose()  # type: ignore[attr-defined]  (if never started)

    @staticmethod
    def _stop(c: CompletionOutput, blocks: Blocks) -> dict[str, Any]:
        if c.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if blocks.num_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(c.stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": c.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _usage(self, started: Started, out: RequestOutput | None) -> dict[str, Any]:
        """Anthropic counts prompt tokens read from the cache apart from `input_tokens`; they
        are told only with --enable-prompt-tokens-details (else all are input_tokens)."""
        num_prompt = len(started.prompt_token_ids)
        cached = out.num_cached_tokens if out is not None else None
        if not self.chat.prompt_tokens_details or cached is None:
            cached = None
        return {
            "input_tokens": num_prompt - (cached or 0),
            "output_tokens": len(out.outputs[0].token_ids) if out is not None else 0,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": None,
        }


def _event(body: dict[str, Any]) -> bytes:
    return b"event: " + body["type"].encode() + b"\n" + sse(_encode(body))
