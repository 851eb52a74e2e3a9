"""The OpenAI wire protocol: request bodies as pydantic models, errors in OpenAI's shape.

Requests accept unknown fields (clients send extras; vLLM ignores them too), except those that name
a feature vLLM has and pagedserve does not (`UNSUPPORTED_FIELDS`): those get a 400 naming the field,
never a silently different answer. Only shapes and types are checked here; values are checked
where they meet the engine (`serving.py`, SamplingParams), so each rule lives in one place.
Responses are plain dicts built by the serving classes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.errors import EngineDeadError, EngineOverloadedError, RequestRefusedError

# Request fields vLLM implements and pagedserve does not (yet), each with the values that ask for
# nothing (besides null): a request setting one to anything else gets a 400 naming it. A field a
# request model defines is never refused (completions' `echo` works; chat's is refused; chat's
# `tools` work, completions' are refused). When a feature lands on every endpoint that takes it,
# remove its entries here and add the fields to the request models.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # structured outputs
    "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structured_outputs": (),
    # tools and reasoning
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (),
    "functions": ([],), "function_call": ("none",), "reasoning_effort": (), "documents": (),
    # sampling and outputs
    "prompt_logprobs": (), "truncate_prompt_tokens": (), "use_beam_search": (False,),
    "length_penalty": (1.0,), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,), "vllm_xargs": (),
    # prompts
    "suffix": (), "prompt_embeds": (), "echo": (False,), "add_special_tokens": (False,),
    "mm_processor_kwargs": (), "kv_transfer_params": (),
}  # fmt: skip
# Fields vLLM itself removed (0.12 dropped `guided_*`): their 400 names what replaces them.
_REPLACED_BY = {
    "guided_json": "structured_outputs={'json': ...}",
    "guided_regex": "structured_outputs={'regex': ...}",
    "guided_choice": "structured_outputs={'choice': [...]}",
    "guided_grammar": "structured_outputs={'grammar': ...}",
    "guided_whitespace_pattern": "structured_outputs={'any_whitespace': true} (free whitespace "
    "in JSON; a custom pattern is not supported)",
    "guided_decoding_backend": "structured_outputs and leave the backend to the server "
    "(pagedserve always uses xgrammar)",
}


def _unsupported_message(name: str) -> str:
    if name in _REPLACED_BY:
        return f"{name} was removed in vLLM 0.12; use {_REPLACED_BY[name]}."
    return f"{name} is not supported by this server."


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


ENGINE_ERRORS = (EngineDeadError, EngineOverloadedError, RequestRefusedError)


def engine_api_error(e: Exception) -> APIError:
    """The HTTP answer to an engine client's error (one of ENGINE_ERRORS): the engine is gone
    (503), its waiting queue is full (503 + Retry-After), or its gate refused the request (400)."""
    if isinstance(e, EngineOverloadedError):
        return APIError(
            503, f"The server is overloaded ({e.max_waiting} requests are waiting). Retry later.",
            code="server_overloaded", headers={"Retry-After": "1"},
        )  # fmt: skip
    if isinstance(e, RequestRefusedError):
        return APIError(400, f"The engine refused the request: {e}")
    assert isinstance(e, EngineDeadError), e
    return APIError(503, f"The engine is not running: {e}", code="engine_dead")


def unsupported_field(data: Any, table: dict[str, tuple[Any, ...]], own: Any = ()) -> str | None:
    """The first field of a request body that `table` refuses (a value other than null and the
    harmless ones it lists), skipping the names in `own`; None when there is none."""
    if not isinstance(data, dict):
        return None
    for name, harmless in table.items():
        value = data.get(name)
        if value is not None and name not in own and value not in harmless:
            return name
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        name = unsupported_field(data, UNSUPPORTED_FIELDS, cls.model_fields)
        if name is not None:
            message = _unsupported_message(name)
            raise APIError(400, message, param=name, code="unsupported_parameter")
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---------------------------------------------------------------- structured outputs and tools
# (issue 14: these fields are implemented, so they must not be refused by name)
class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` field: one of json, regex, choice, grammar, json_object,
    structural_tag; `any_whitespace` lets JSON hold free whitespace (off: compact JSON). Any
    other key (vLLM's `whitespace_pattern`, `disable_fallback`, ...) is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    any_whitespace: bool | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: str = "function"
    function: FunctionDefinition


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


# ---------------------------------------------------------------- requests
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
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's field): see docs/serving.md
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field
    add_special_tokens: bool = True


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool = True


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
