"""The OpenAI wire protocol: request bodies as pydantic models, errors in OpenAI's shape.

Requests accept unknown fields (clients send extras; vLLM ignores them too). Only shapes and types
are checked here; values are checked where they meet the engine (`serving.py`, SamplingParams), so
each rule lives in one place. Responses are plain dicts built by the serving classes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error a client caused (or 503), rendered as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "internal_error")
        self.code = code
        self.headers = headers  # extra response headers (Retry-After on 503 overload)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
