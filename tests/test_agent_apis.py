"""The APIs coding agents speak, end to end through `pagedserve launch` (the embedded default
model, one server for the module): OpenAI's Responses API with the `openai` SDK and Anthropic's
Messages API with the `anthropic` SDK. Every response and streamed event is also validated
strictly (pydantic) against the SDKs' own types, which the SDKs themselves only construct."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_server import CPU_ARGS, Launched

from pagedserve.frontend.openai.response_store import ResponseStore

MODEL = "tiny"
KEY = "sk-agents"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": WEATHER_SCHEMA}  # fmt: skip
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}


def strict(kind: object, data: dict) -> object:
    """`data` validated as `kind` (a union of events: as its member of data's type)."""
    members = {a.model_fields["type"].annotation.__args__[0]: a for a in _members(kind)}
    return TypeAdapter(members.get(data.get("type"), kind)).validate_python(data)


def _members(kind: object) -> list:
    args = getattr(kind, "__args__", ())
    if args and hasattr(args[0], "__args__"):  # Annotated[Union[...], ...]
        args = args[0].__args__
    return [a for a in args if hasattr(a, "model_fields") and "type" in a.model_fields]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    args = ["--host", "127.0.0.1", "--port", "0", *CPU_ARGS, "--served-model-name", MODEL,
            "--api-key", KEY, "--max-model-len", "512",
            "--enable-prompt-tokens-details"]  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("agents") / "launch.log"))
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url: str):
    with httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=60) as c:
        yield c


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of a server-sent event stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


# ---------------------------------------------------------------------- Responses
def test_responses_create_get_delete_and_continue(oai: openai.OpenAI, http: httpx.Client) -> None:
    raw = oai.responses.with_raw_response.create(
        model=MODEL, instructions="Write Python.", input="def fib(n):", max_output_tokens=12,
        temperature=0, metadata={"case": "1"},
    )  # fmt: skip
    first = raw.parse()
    strict(Response, raw.http_response.json())
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.id.startswith("resp_") and first.metadata == {"case": "1"}
    (message,) = first.output
    assert message.type == "message" and first.output_text == message.content[0].text
    assert first.usage.output_tokens == 12 and first.usage.total_tokens > 12
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    second = oai.responses.create(
        model=MODEL, instructions="Write Python.", input="Again.", previous_response_id=first.id,
        max_output_tokens=4,
    )  # fmt: skip
    # the earlier turn (its prompt and reply) is the prefix of this one, and the cache holds it
    assert second.usage.input_tokens > first.usage.input_tokens + 12
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert second.previous_response_id == first.id
    oai.responses.delete(first.id)
    for call in (lambda: oai.responses.retrieve(first.id),
                 lambda: oai.responses.create(model=MODEL, input="x",
                                              previous_response_id=first.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found"
    gone = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"


def test_responses_stream(oai: openai.OpenAI, http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "import os", "max_output_tokens": 10, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    for name, data in events:
        assert name == data["type"]
        strict(ResponseStreamEvent, data)
    kinds = [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas and final["usage"]["output_tokens"]
    # the SDK's own stream reads the same
    with oai.responses.stream(model=MODEL, input="import os", max_output_tokens=10) as stream:
        seen = [e.type for e in stream]
    assert seen[0] == "response.created" and seen[-1] == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(oai: openai.OpenAI, stream: bool) -> None:
    """A named tool_choice forces a call (grammar); its output goes back as
    function_call_output and the conversation goes on."""
    ask = dict(model=MODEL, input="Weather in Paris?", tools=[FUNCTION], max_output_tokens=40,
               tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    if stream:
        with oai.responses.stream(**ask) as s:
            kinds = [e.type for e in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    else:
        first = oai.responses.create(**ask)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "London")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    after = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                 tools=[FUNCTION], tool_choice="required", temperature=0,
                                 max_output_tokens=80)  # fmt: skip
    assert after.status == "completed" and after.output[0].type == "function_call"
    assert after.usage.input_tokens > first.usage.input_tokens
    # stateless: the whole conversation as input items (store false, as Codex CLI sends it)
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(), result]
    again = oai.responses.create(model=MODEL, input=items, tools=[FUNCTION], store=False,
                                 max_output_tokens=4)  # fmt: skip
    assert again.usage.input_tokens == after.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(again.id)


def test_responses_cancel(url: str, http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "class A:", "max_output_tokens": 400, "stream": True,
            "temperature": 1.0}  # fmt: skip
    events: list[dict] = []
    with http.stream("POST", "/v1/responses", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
        resp_id = events[0]["response"]["id"]
        assert http.get(f"/v1/responses/{resp_id}").json()["status"] == "in_progress"
        cancelled = {}
        thread = threading.Thread(target=lambda: cancelled.update(
            http.post(f"/v1/responses/{resp_id}/cancel").json()))  # fmt: skip
        thread.start()
        events += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        thread.join()
    assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] < 400
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"
    again = http.post(f"/v1/responses/{resp_id}/cancel")
    assert again.status_code == 400 and "not running" in again.json()["error"]["message"]


def test_responses_bad_inputs(http: httpx.Client) -> None:
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
         "input", "call_x"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input", "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
    ]  # fmt: skip
    for extra, param, named in cases:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and named in error["message"], error
    assert http.get("/v1/responses/resp_missing").status_code == 404
    assert http.delete("/v1/responses/resp_missing").status_code == 404
    ok = http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


# ---------------------------------------------------------------------- Anthropic Messages
def test_messages_create_stream_and_count(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    content = [{"type": "text", "text": "def fib(n):"}]
    ask = dict(model=MODEL, max_tokens=12, system="Write Python.", extra_body={"temperature": 0},
               messages=[{"role": "user", "content": content}])  # fmt: skip
    raw = claude.messages.with_raw_response.create(**ask)
    message = raw.parse()
    strict(Message, raw.http_response.json())
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 12 and message.content[0].type == "text"
    count = claude.messages.count_tokens(model=MODEL, system=ask["system"],
                                         messages=ask["messages"])  # fmt: skip
    assert count.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
    strict(MessageTokensCount, count.model_dump())
    body = {**{k: v for k, v in ask.items() if k != "extra_body"}, "temperature": 0}
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert ("ping", {"type": "ping"}) in events
    events = [(n, d) for n, d in events if n != "ping"]
    for name, data in events:
        assert name == data["type"]
        strict(RawMessageStreamEvent, data)
    kinds = [d["type"] for _, d in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for _, d in events if d["type"] == "content_block_delta")
    assert text == message.content[0].text  # greedy: the same reply
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 12


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    ask = dict(model=MODEL, max_tokens=80, tools=[TOOL], extra_body={"temperature": 0},
               tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
    with claude.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_message()
    assert "input_json" in kinds and first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.input["city"] in ("Paris", "London")
    history = [*ask["messages"], {"role": "assistant", "content": first.content},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": "21 C"},
                   {"type": "text", "text": "And London?"}]}]  # fmt: skip
    after = claude.messages.create(**{**ask, "messages": history,
                                      "tool_choice": {"type": "any"}})  # fmt: skip
    assert after.stop_reason == "tool_use" and after.content[0].name == "get_weather"
    assert after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0) > (
        first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    )


def test_messages_stop_sequence(claude: anthropic.Anthropic) -> None:
    ask = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
               messages=[{"role": "user", "content": "import sys"}])  # fmt: skip
    text = claude.messages.create(**ask).content[0].text
    word = next(w for w in text.split()[1:] if len(w) >= 3 and w.isalpha())
    stopped = claude.messages.create(**ask, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_messages_bad_inputs(url: str, http: httpx.Client, claude: anthropic.Anthropic) -> None:
    user = {"role": "user", "content": "x"}
    cases = [
        ({"messages": [user]}, 400, "max_tokens"),  # no max_tokens
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "foo"}]}]},
         400, "'foo'"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, 400, "'image'"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "toolu_x"),
        ({"max_tokens": 4, "messages": [user],
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "web_search"),
        ({"max_tokens": 4, "messages": [user], "model": "claude-x"}, 404, "claude-x"),
    ]  # fmt: skip
    for body, status, named in cases:
        r = http.post("/v1/messages", json={"model": MODEL, **body})
        assert r.status_code == status, (body, r.text)
        error = strict(ErrorResponse, r.json()).error
        assert named in error.message, error
        assert error.type == ("not_found_error" if status == 404 else "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=0, messages=[user])
    bad_key = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model=MODEL, max_tokens=2, messages=[user])
    assert e.value.body["error"]["type"] == "authentication_error"
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=[user]).usage.output_tokens


def test_disconnect_aborts(url: str, http: httpx.Client) -> None:
    """A client that leaves a stream early frees its request in the engine and the server (an
    output stream nobody reads or closes would stay tracked)."""
    user = {"role": "user", "content": "x"}
    asks = [("/v1/responses", {"input": "class A:", "max_output_tokens": 400}),
            ("/v1/messages", {"max_tokens": 400, "messages": [user]})]  # fmt: skip
    names = ("pagedserve:num_requests_running{", "pagedserve:api_server_requests_tracked{")
    for path, body in asks:
        leaving = httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=60)
        with (
            leaving,
            leaving.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r,
        ):
            next(r.iter_lines())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            lines = http.get("/metrics").text.splitlines()
            busy = [float(line.split()[-1]) for line in lines if line.startswith(names)]
            if len(busy) == 2 and not any(busy):
                break
            time.sleep(0.2)
        assert len(busy) == 2 and not any(busy), (path, busy)


def test_metrics_per_endpoint(http: httpx.Client) -> None:
    user = {"role": "user", "content": "x"}
    http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [user]})
    lines = http.get("/metrics").text.splitlines()
    for handler, status in [("/v1/responses", "2xx"), ("/v1/responses", "4xx"),
                            ("/v1/messages", "2xx"), ("/v1/messages", "4xx"),
                            ("/v1/messages/count_tokens", "2xx"),
                            ("/v1/responses/{id}/cancel", "2xx")]:  # fmt: skip
        series = [line for line in lines if line.startswith("pagedserve:http_requests_total")]
        assert any(f'handler="{handler}",method="POST"' in line and f'status="{status}"' in line
                   for line in series), handler  # fmt: skip


def test_response_store_bounds() -> None:
    store = ResponseStore(max_entries=2, max_age_s=0.2)
    for name in "abc":
        store.put(name, {"id": name}, [])
    assert store.get("a") is None and len(store) == 2
    assert store.get("b") is not None  # used: c is now the least recently used
    store.put("d", {"id": "d"}, [])
    assert store.get("c") is None and store.get("b") is not None
    time.sleep(0.25)
    assert store.get("b") is None and len(store) == 0


@pytest.mark.parametrize("summary", [False, True])
def test_reasoning_text_and_calls_become_items_and_events(summary: bool) -> None:
    """A reasoning model's reply (qwen3 parser), read as a stream in uneven pieces, becomes a
    reasoning item, a message and a function call, and Anthropic's thinking, text and tool_use
    blocks; every event and item passes the SDKs' types."""
    from anthropic.types import ContentBlock
    from openai.types.responses import ResponseOutputItem

    from pagedserve.frontend.openai.chat_output import ChatShape, ChoiceStream
    from pagedserve.frontend.openai.reasoning_parsers import make_reasoning_parser
    from pagedserve.frontend.openai.response_output import ResponseOutput
    from pagedserve.frontend.openai.serving_messages import Blocks
    from pagedserve.frontend.openai.tool_parsers import make_tool_parser

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {"</think>": 7}

    reply = '<think>Paris is asked for.</think>Let me look.<tool_call>\n{"name": "get_weather", ' \
        '"arguments": {"city": "Paris"}}\n</tool_call>'  # fmt: skip
    shape = ChatShape(reasoning=make_reasoning_parser("qwen3", Vocab()),
                      tool_parser=make_tool_parser("hermes"))  # fmt: skip
    output, blocks = ResponseOutput(summary, True), Blocks()
    choice = ChoiceStream(shape)
    for end in [3, 9, 30, 31, 45, 80, len(reply)]:
        for delta in choice.deltas(reply[:end], final=end == len(reply)):
            output.feed(delta)
            blocks.feed(delta)
    output.close()
    blocks.close()
    assert [i["type"] for i in output.items] == ["reasoning", "message", "function_call"]
    for number, event in enumerate(output.events):
        strict(ResponseStreamEvent, {**event, "sequence_number": number})
    for item in output.items:
        strict(ResponseOutputItem, item)
    reasoning, message, call = output.items
    assert reasoning["content"][0]["text"] == "Paris is asked for."
    assert bool(reasoning["summary"]) == summary and reasoning["encrypted_content"]
    assert message["content"][0]["text"] == "Let me look."
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    kinds = [e["type"] for e in output.events]
    assert ("response.reasoning_summary_text.delta" in kinds) == summary
    assert output.message()["tool_calls"][0]["function"]["name"] == "get_weather"
    for event in blocks.events:
        strict(RawMessageStreamEvent, event)
    assert [strict(ContentBlock, b).type for b in blocks.blocks] == ["thinking", "text", "tool_use"]
    assert blocks.blocks[2]["input"] == {"city": "Paris"}


def test_codex_style_input_becomes_a_chat_request() -> None:
    """What Codex CLI sends (store false, developer instructions, the previous turn's reasoning
    as encrypted_content, a call and its output) becomes the chat conversation it means."""
    import base64

    from pagedserve.frontend.openai.responses_protocol import (
        ResponsesRequest,
        chat_request,
        conversation,
    )

    def text(role: str, value: str) -> dict:
        return {"type": "message", "role": role, "content": [{"type": "input_text", "text": value}]}

    thought = base64.b64encode(b"I should call it.").decode()
    req = ResponsesRequest.model_validate({
        "model": MODEL, "instructions": "Be terse.", "store": False, "stream": True,
        "tools": [FUNCTION], "tool_choice": "required", "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "summary": "auto"}, "prompt_cache_key": "k",
        "include": ["reasoning.encrypted_content"],
        "input": [text("developer", "Use tools."), text("user", "Weather in Paris?"),
                  {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": thought},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather",
                   "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "21 C"}],
    })  # fmt: skip
    chat = chat_request(req, conversation(req, []))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[0].content == "Be terse.\n\nUse tools."
    assistant = chat.messages[2]
    assert assistant.reasoning_content == "I should call it." and assistant.content is None
    assert assistant.tool_calls[0].id == "c1" and assistant.tool_calls[0].function.name == (
        "get_weather"
    )
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "21 C"
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert chat.tools[0].function.parameters == WEATHER_SCHEMA and not chat.parallel_tool_calls


def test_claude_code_style_request_becomes_a_chat_request() -> None:
    """What Claude Code sends (system blocks with cache_control, thinking and tool_use blocks
    replayed, an is_error tool_result beside new text) becomes the chat conversation it means."""
    from pagedserve.frontend.openai.messages_protocol import MessagesRequest, chat_request

    cache = {"type": "ephemeral"}
    req = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 64, "stream": True, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "You are an agent.", "cache_control": cache},
                   {"type": "text", "text": "Be terse."}],
        "tools": [{**TOOL, "cache_control": cache}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user",
             "content": [{"type": "text", "text": "Weather?", "cache_control": cache}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Try again."}]},
        ],
    })  # fmt: skip
    chat = chat_request(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "You are an agent.\nBe terse."
    assistant = chat.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning_content == "Call it."
    assert assistant.tool_calls[0].function.arguments == {"city": "Paris"}
    assert chat.messages[3].content == "Error: timeout" and chat.messages[4].content == "Try again."
    assert chat.tool_choice == "required" and not chat.parallel_tool_calls and chat.user == "u1"
    assert chat.chat_template_kwargs == {"enable_thinking": True, "thinking_budget": 1024}
