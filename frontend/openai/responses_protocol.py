"""The OpenAI Responses API's request (`POST /v1/responses`) and its translation to chat.

A Responses request is a chat request in other words: `instructions` is the system message,
`input` items are messages (`message`, `function_call` -> an assistant's tool call,
`function_call_output` -> a tool message, `reasoning` -> the next assistant message's
`reasoning_content`), `text.format` is `response_format`, a function tool is a chat tool. So it is
turned into a `ChatCompletionRequest` and served by the chat code (template, tool and reasoning
parsers, grammars, admission). What it asks and we do not do is a 400 naming the field or type.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedserve.frontend.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    _Request,
    unsupported_field,
)

# Responses fields we do not implement, with the values that ask for nothing (besides null).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "stream_options": ({"include_obfuscation": False}, {}),
    "context_management": (),
}
# `include` values we can give: reasoning as an opaque `encrypted_content` (base64 of its text,
# not encrypted: the client sends it back with store false, as Codex CLI does).
INCLUDABLE = ("reasoning.encrypted_content",)
BUILT_IN_TOOLS = "any built-in tool (web_search, file_search, code_interpreter, ...)"


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str = "text"  # text | json_object | json_schema
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None  # auto | concise | detailed: reasoning also as a summary
    generate_summary: str | None = None  # the older name of summary


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # none: previous_response_id's turn only
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None  # vLLM's extension
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache needs no key
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        name = unsupported_field(data, UNSUPPORTED)
        if name is not None:
            raise APIError(400, f"{name}={json.dumps(data[name])} is not supported by this "
                           "server.", param=name, code="unsupported_parameter")  # fmt: skip
        if isinstance(data, dict):
            for value in data.get("include") or ():
                if value not in INCLUDABLE:
                    raise APIError(400, f"include {value!r} is not supported (only "
                                   f"{', '.join(INCLUDABLE)}).", param="include")  # fmt: skip
        return data

    @property
    def summary(self) -> bool:
        return self.reasoning is not None and bool(
            self.reasoning.summary or self.reasoning.generate_summary
        )


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves `req`, whose conversation (`conversation`) is `messages`."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, "max_output_tokens must be at least 1.", param="max_output_tokens")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    kwargs = {}
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs["reasoning_effort"] = req.reasoning.effort  # templates that take it read it
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _merge_leading_system([*system, *messages]),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop,
        "user": req.user,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "stream": req.stream,
        "tools": [_tool(t) for t in req.tools or []] or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _format(req.text),
        "chat_template_kwargs": kwargs or None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise APIError(400, f"Invalid request: {e.errors()[0].get('msg')}") from None


def conversation(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`history` then `req.input` as chat messages (instructions left out)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = items or []
    messages = list(history)
    call_ids = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    reasoning: str | None = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"{where}: unknown role {item.get('role')!r}.", param="input")
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            function = {"name": _field(item, "name", where),
                        "arguments": item.get("arguments") or "{}"}  # fmt: skip
            call = {"id": _field(item, "call_id", where), "type": "function", "function": function}
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("tool_call_id"):
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            if call_id not in call_ids:
                raise APIError(400, f"{where}: no function_call with call_id {call_id!r} precedes "
                               "this function_call_output.", param="input")  # fmt: skip
            content = item.get("output")
            text = content if isinstance(content, str) else _text(content, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported "
                           "(message, function_call, function_call_output, reasoning).",
                           param="input")  # fmt: skip
    return messages


def _merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions` and the developer/system messages that open `input` (as Codex CLI sends
    them) as one system message: many templates take a system message only first."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}, *messages[n:]]


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}: {item.get('type')} needs {name}.", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(part.get("text") or "")
        elif kind == "refusal":
            texts.append(part.get("refusal") or "")
        else:
            raise APIError(400, f"{where}: content parts of type {kind!r} are not supported "
                           "(input_text, output_text).", param="input")  # fmt: skip
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict))
    if not text and item.get("encrypted_content"):
        try:
            text = base64.b64decode(item["encrypted_content"]).decode()
        except ValueError:
            raise APIError(400, "reasoning encrypted_content was not made by this server.",
                           param="input") from None  # fmt: skip
    return text


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise APIError(400, f"tools of type {kind!r} are not supported (only function tools; "
                       f"{BUILT_IN_TOOLS} is not).", param="tools")  # fmt: skip
    if not tool.get("name"):
        raise APIError(400, "a function tool needs a name.", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not choice.get("name"):
        raise APIError(400, f"tool_choice {json.dumps(choice)} is not supported (none, auto, "
                       'required or {"type": "function", "name": ...}).',
                       param="tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": choice["name"]}}


def _format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type {fmt.type!r} is not supported (text, json_object, "
                   "json_schema).", param="text.format")  # fmt: skip
