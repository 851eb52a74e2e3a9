"""POST /v1/chat/completions: the tokenizer's chat template, chat-format logprobs, SSE deltas.

The conversation is rendered to text by the model's chat template (which already holds BOS and
the assistant header), then tokenized without adding special tokens again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.structs
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
from pagedserve.frontend.openai.chat_output import ChatShape, ChoiceStream
from pagedserve.frontend.openai.metrics import Metrics
from pagedserve.frontend.openai.protocol import APIError, ChatCompletionRequest, ChatMessage
from pagedserve.frontend.openai.reasoning_parsers import make_reasoning_parser
from pagedserve.frontend.openai.serving import (
    Serving,
    check_prompt_logprobs,
    clamp_logprob,
    now_s,
    vllm_prompt_logprobs,
)
from pagedserve.frontend.openai.streams import (
    SSE_DONE,
    ClientDisconnected,
    Cursor,
    SSEResponse,
    run_until_disconnect,
    sse,
    stream_error,
)
from pagedserve.frontend.openai.structured import spec_from_request, tool_call_spec
from pagedserve.frontend.openai.tool_parsers import make_tool_parser
from pagedserve.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.frontend.tokenizer import render_chat
from pagedserve.ipc.messages import StructuredOutputs

_encode = msgspec.json.encode


@dataclass(frozen=True)
class ChatOptions:
    """Server flags for chat replies (vLLM's names): `--enable-auto-tool-choice`,
    `--tool-call-parser`, `--reasoning-parser`, `--chat-template` (the template's text; None: the
    tokenizer's own), `--trust-request-chat-template`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False


@dataclass
class Started:
    """An admitted chat request: its prompt, how its reply is read, and its outputs."""

    prompt_token_ids: list[int]
    shape: ChatShape
    stream: AsyncIterator[RequestOutput]


class ChatServing(Serving):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: Metrics | None = None,
        options: ChatOptions | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        super().__init__(engine, metrics, prompt_tokens_details)
        self.options = opts = options or ChatOptions()
        self.chat_template = opts.chat_template
        self.trust_request_chat_template = opts.trust_request_chat_template
        parser = opts.tool_call_parser
        self.tool_parser = make_tool_parser(parser) if parser else None
        self.reasoning = (
            make_reasoning_parser(opts.reasoning_parser, self.tokenizer)
            if opts.reasoning_parser
            else None
        )

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        try:
            started = await self.start(req, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        ids, shape, stream = started.prompt_token_ids, started.shape, started.stream
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": now_s(),
            "model": req.model or self.model_name,
        }
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return SSEResponse(self._stream(req, head, len(ids), top_n or 0, stream, shape))
        try:
            final = await run_until_disconnect(_last(stream), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for c in final.outputs:
            message, finish_reason = shape.message(c.text, c.finish_reason)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c, 0, top_n or 0) if c.logprobs is not None else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        body = {**head, "choices": choices}
        if req.prompt_logprobs is not None:  # vLLM's field, beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(final)
        body["usage"] = self.usage(len(ids), num_generated, final.num_cached_tokens)
        return Response(_encode(body), 200)

    async def start(self, req: ChatCompletionRequest, raw: Request) -> Started:
        """Check, render, tokenize and admit a chat request: what every chat-shaped API (chat
        completions, Responses, Anthropic Messages) shares. Raises APIError before anything runs,
        ClientDisconnected if the client left while it was admitted."""
        lora = self.check_request(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            message = "max_completion_tokens must be at least 1."
            raise APIError(400, message, param="max_completion_tokens")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true.", param="top_logprobs")
        prompt_logprobs = check_prompt_logprobs(req)
        shape, spec = self._shape(req)
        if any(
            getattr(p, "keeps_special_tokens", False) for p in (shape.tool_parser, self.reasoning)
        ):
            req.skip_special_tokens = False
        if spec is None:
            spec = await self.structured_outputs(req)
        elif spec_from_request(req) is not None:
            raise APIError(400, "tool_choice required or named cannot take response_format or "
                           "structured_outputs too.", param="tool_choice")  # fmt: skip
        else:
            await self.check_grammar(spec, "tool_choice")
        text = self.render(req)
        (ids,) = await self.tokenize([text], False, "messages")
        max_tokens = self.check_prompt(ids, max_tokens)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        if self.reasoning is not None:
            shape.reasoning = self.reasoning.for_prompt(ids)  # whether the prompt opens <think>
        if spec is not None and self.reasoning is not None:
            after = self.reasoning.grammar_starts_after(ids)
            spec = msgspec.structs.replace(spec, after_token_id=after)
        params = self.sampling_params(req, max_tokens, top_n, spec)
        if prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=prompt_logprobs)
        (stream,) = await self.admit([self.generate(ids, params, text, req.priority, lora)], raw)
        return Started(ids, shape, stream)

    def _shape(self, req: ChatCompletionRequest) -> tuple[ChatShape, StructuredOutputs | None]:
        """How replies are read, and the grammar tool_choice required/named imposes."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools and self.options.enable_auto_tool_choice else "none"
        if choice == "auto" and self.tool_parser is None:
            message = 'tool_choice "auto" needs --enable-auto-tool-choice and --tool-call-parser.'
            raise APIError(400, message, param="tool_choice")
        spec, name = tool_call_spec(choice, req.tools or [], req.parallel_tool_calls)
        parser = self.tool_parser if choice == "auto" else None
        if hasattr(parser, "for_tools"):  # a parser that reads arguments by the tools' schemas
            parser = parser.for_tools(req.tools or [])
        shape = ChatShape(
            reasoning=self.reasoning,
            forced_name=name,
            required=choice == "required",
            tool_parser=parser,
        )
        return shape, spec

    def render(self, req: Any) -> str:
        """The prompt text of a chat request (also used by /tokenize); rendered templates already
        hold BOS, so it is tokenized without special tokens."""
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(
                400, "add_generation_prompt and continue_final_message are exclusive.",
                param="continue_final_message",
            )  # fmt: skip
        messages = [_message(m) for m in req.messages]
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        kwargs.pop("chat_template", None)
        tools = getattr(req, "tools", None)
        if tools and getattr(req, "tool_choice", None) != "none":
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
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
        return text

    async def _stream(
        self,
        req: ChatCompletionRequest,
        head: dict[str, Any],
        num_prompt: int,
        top_n: int,
        stream: AsyncIterator[RequestOutput],
        shape: ChatShape,
    ) -> AsyncIterator[bytes]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        cursors = [Cursor() for _ in range(req.n)]
        choices = [ChoiceStream(shape) for _ in range(req.n)]
        num_generated = num_cached = 0

        def chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            body = {**head, "choices": [{**choice, **extra}]}
            if continuous:
                body["usage"] = self.usage(num_prompt, num_generated)
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
                    _, start = step
                    done = c.finish_reason is not None
                    deltas = choices[c.index].deltas(c.text, final=done) or [{}]
                    extra: dict[str, Any] = {}
                    if c.logprobs is not None:
                        extra["logprobs"] = chat_logprobs(c, start, top_n)
                    if done:
                        finish = c.finish_reason
                        if finish == "stop" and choices[c.index].num_calls:
                            finish = "tool_calls"
                        extra.update(finish_reason=finish, stop_reason=c.stop_reason)
                    for delta in deltas[:-1]:
                        yield chunk(c.index, delta)
                    if deltas[-1] or extra:
                        yield chunk(c.index, deltas[-1], **extra)
            if include_usage:
                total = self.usage(num_prompt, num_generated, num_cached)
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
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:  # templates that show past reasoning read it (as vLLM passes it)
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:  # templates read arguments as a mapping (transformers' convention)
        out["tool_calls"] = [
            {"id": t.id, "type": t.type, "function": {"name": t.function.name,
             "arguments": _arguments(t.function.arguments)}}
            for t in m.tool_calls
        ]  # fmt: skip
    return out


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        raise APIError(400, "tool_calls arguments must be JSON.", param="messages") from None


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
