"""POST /v1/chat/completions: the tokenizer's chat template, chat-format logprobs, SSE deltas.

The conversation is rendered to text by the model's chat template (which already holds BOS and
the assistant header), then tokenized without adding special tokens again.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.chat_template import (
    REQUEST_TEMPLATE_TIMEOUT_S,
    TRUST_FLAG,
    TemplateTimeout,
    request_template,
    run_bounded,
)
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.protocol import APIError, ChatCompletionRequest, ChatMessage
from pagedserve.frontend.openai.serving import (
    SSE_DONE,
    ClientDisconnected,
    Cursor,
    Serving,
    SSEResponse,
    clamp_logprob,
    now_s,
    run_until_disconnect,
    sse,
    stream_error,
    usage,
)
from pagedserve.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.frontend.tokenizer import encode_prompt, render_chat

_encode = msgspec.json.encode


class ChatServing(Serving):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: Metrics | None = None,
        log_requests: bool = False,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        super().__init__(engine, metrics, log_requests)
        self.chat_template = chat_template  # --chat-template; None: the tokenizer's own
        self.trust_request_chat_template = trust_request_chat_template

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            message = "max_completion_tokens must be at least 1."
            raise APIError(400, message, param="max_completion_tokens")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true.", param="top_logprobs")
        text, ids = self.render(req)
        max_tokens = self.check_prompt(ids, max_tokens)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, top_n)
        (stream,) = await self.admit([self.generate(ids, params, text, req.priority)])
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": now_s(),
            "model": req.model or self.model_name,
        }
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return SSEResponse(self._stream(req, head, len(ids), top_n or 0, stream))
        try:
            final = await run_until_disconnect(_last(stream), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, top_n or 0) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        body = {**head, "choices": choices}
        body["usage"] = usage(len(ids), num_generated, final.num_cached_tokens)
        return Response(_encode(body), 200)

    def render(self, req: Any) -> tuple[str, list[int]]:
        """The prompt text and its token ids for a chat request (also used by /tokenize)."""
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(
                400, "add_generation_prompt and continue_final_message are exclusive.",
                param="continue_final_message",
            )  # fmt: skip
        messages = [_message(m) for m in req.messages]
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        kwargs.pop("chat_template", None)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        own = request_template(req)
        if own is not None and not self.trust_request_chat_template:
            raise APIError(
                400, f"This server does not run chat templates sent in requests (start it with "
                f"{TRUST_FLAG} to allow them).", param="chat_template",
            )  # fmt: skip

        def render() -> Any:
            return render_chat(
                self.tokenizer,
                messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                chat_template=own or self.chat_template,
                **kwargs,
            )

        try:
            text = render() if own is None else run_bounded(render, REQUEST_TEMPLATE_TIMEOUT_S)
        except TemplateTimeout as e:
            raise APIError(400, f"{e}.", param="chat_template") from e
        except Exception as e:  # jinja2 errors, a missing template, bad kwargs
            raise APIError(400, f"Cannot apply the chat template: {e}", param="messages") from e
        if not isinstance(text, str):  # chat_template_kwargs such as {"tokenize": true}
            raise APIError(400, "chat_template_kwargs must not change the output.", "messages")
        return text, encode_prompt(self.tokenizer, text, add_special_tokens=False)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        head: dict[str, Any],
        num_prompt: int,
        top_n: int,
        stream: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[bytes]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        cursors = [Cursor() for _ in range(req.n)]
        num_generated = num_cached = 0

        def chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            body = {**head, "choices": [{**choice, **extra}]}
            if continuous:
                body["usage"] = usage(num_prompt, num_generated)
            return sse(_encode(body))

        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for out in stream:
                num_generated = sum(len(c.token_ids) for c in out.outputs)
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    step = cursors[c.index].advance(c)
                    if step is None:
                        continue
                    text, start = step
                    extra: dict[str, Any] = {}
                    if c.logprobs is not None:
                        extra["logprobs"] = chat_logprobs(c, start, top_n)
                    if c.finish_reason is not None:
                        extra.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield chunk(c.index, {"content": text} if text else {}, **extra)
            if include_usage:
                total = usage(num_prompt, num_generated, num_cached)
                yield sse(_encode({**head, "choices": [], "usage": total}))
        except Exception as e:
            yield sse(_encode(stream_error(e)))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    assert final is not None and final.finished
    return final


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _message(m: ChatMessage) -> dict[str, Any]:
    if m.role not in ROLES:
        raise APIError(
            400, f"Unknown message role {m.role!r}; expected one of {', '.join(ROLES)}.",
            param="messages",
        )  # fmt: skip
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400, f"Content parts of type {part.type!r} are not supported (only text).",
                    param="messages",
                )  # fmt: skip
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out


def _entry(e: Logprob) -> dict[str, Any]:
    token = e.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(e.logprob), "bytes": list(token.encode())}


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict[str, Any]:
    """Chat-format logprobs for the tokens of a choice from `start` on."""
    assert c.logprobs is not None
    content = []
    for token_id, entries in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
        ranked = sorted(entries.values(), key=lambda e: e.rank or 0)[:top_n]
        content.append({**_entry(entries[token_id]), "top_logprobs": [_entry(e) for e in ranked]})
    return {"content": content}
