"""Anthropic's Messages API request (`POST /v1/messages`), its translation to chat, its errors.

A Messages request is a chat request in other words: `system` is the system message, a
`tool_use` block is an assistant's tool call, a `tool_result` block a tool message, a `thinking`
block the assistant's `reasoning_content`, `tool_choice` any / tool / none are chat's required /
named / none. So it becomes a `ChatCompletionRequest` and the chat code serves it. What it asks
and we do not do (image and document blocks, server tools, ...) is a 400 naming it, in
Anthropic's error shape: `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError, model_validator

from pagedserve.frontend.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    _Request,
    unsupported_field,
)

PATH = "/v1/messages"  # requests under it get errors in Anthropic's shape
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "container": (),
    "mcp_servers": ([],),
    "context_management": (),
    "service_tier": ("auto", "standard_only"),
}
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(_Request):
    model: str
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        name = unsupported_field(data, UNSUPPORTED)
        if name is not None:
            raise APIError(400, f"{name} is not supported by this server.", param=name)
        return data

    @property
    def user(self) -> str | None:
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes none


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    if req.max_tokens < 1:
        raise APIError(400, "max_tokens: must be at least 1.", param="max_tokens")
    messages = _system(req.system) + _messages(req.messages)
    kwargs: dict[str, Any] = {}
    thinking = req.thinking or {}
    if thinking.get("type") not in (None, "enabled", "disabled", "adaptive"):
        raise APIError(400, f"thinking type {thinking.get('type')!r} is not supported.", "thinking")
    if thinking.get("type") in ("enabled", "adaptive"):
        kwargs["enable_thinking"] = True  # templates that take it read it (Qwen3)
        if thinking.get("budget_tokens"):
            kwargs["thinking_budget"] = thinking["budget_tokens"]
    elif thinking.get("type") == "disabled":
        kwargs["enable_thinking"] = False
    choice = req.tool_choice or {}
    body = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "user": req.user,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "stream": req.stream,
        "tools": [_tool(t) for t in req.tools or ()] or None,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False),
        "chat_template_kwargs": kwargs or None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise APIError(400, f"Invalid request: {e.errors()[0].get('msg')}") from None


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else _texts(system, "system", ("text",))
    return [{"role": "system", "content": text}]


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tool_ids: set[str] = set()
    for i, m in enumerate(messages):
        where, role, content = f"messages.{i}", m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: must be user or assistant, not {role!r}.")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise APIError(400, f"{where}.content: must be a string or a list of blocks.")
        elif role == "assistant":
            out.append(_assistant(content, where, tool_ids))
        else:
            out.extend(_user(content, where, tool_ids))
    return out


def _assistant(blocks: list[dict[str, Any]], where: str, tool_ids: set[str]) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "thinking":
            thinking.append(block.get("thinking") or "")
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not call_id or not name or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where}.content.{j}: tool_use needs id, name and an "
                               "input object.")  # fmt: skip
            tool_ids.add(call_id)
            function = {"name": name, "arguments": block.get("input") or {}}
            calls.append({"id": call_id, "type": "function", "function": function})
        else:
            raise _unknown_block(kind, f"{where}.content.{j}", "text, thinking, tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _user(blocks: list[dict[str, Any]], where: str, tool_ids: set[str]) -> list[dict[str, Any]]:
    """Tool results become tool messages (in order), the text one user message after them."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content.{j}"
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in tool_ids:
                raise APIError(400, f"{at}: tool_result for tool_use_id {call_id!r}, which no "
                               "earlier assistant tool_use block has.")  # fmt: skip
            content = block.get("content") or ""
            text = content if isinstance(content, str) else _texts(content, at, ("text",))
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _unknown_block(kind, at, "text, tool_result")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _texts(blocks: list[dict[str, Any]], where: str, kinds: tuple[str, ...]) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") not in kinds:
            kind = block.get("type") if isinstance(block, dict) else None
            raise _unknown_block(kind, f"{where}.{j}", ", ".join(kinds))
        texts.append(block.get("text") or "")
    return "\n".join(texts)


def _unknown_block(kind: Any, where: str, known: str) -> APIError:
    what = "are not supported yet" if kind in ("image", "document") else "are not supported here"
    return APIError(400, f"{where}: content blocks of type {kind!r} {what} ({known}).")


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported (only client "
                       "tools: name, description, input_schema).", param="tools")  # fmt: skip
    if not tool.get("name") or not isinstance(tool.get("input_schema"), dict):
        raise APIError(400, "tools: each tool needs a name and an input_schema.", param="tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> str | dict[str, Any] | None:
    kind = choice.get("type")
    if kind is None:
        return None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {json.dumps(choice)} is not supported (auto, any, tool "
                   "with name, none).", param="tool_choice")  # fmt: skip
