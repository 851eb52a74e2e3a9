"""Tools on a model whose own template ignores them (SmolLM2's ChatML): `launch` warns when
`--enable-auto-tool-choice` meets such a template, and the shipped `chatml_tools` template shows
the model its tools, so `tool_choice: auto` really calls.

SmolLM2-135M does not call zero-shot: with the tools listed, a dozen direct requests ("Call the
function get_weather for the city of Paris.", "Use the get_weather function with the argument
city=\"Paris\".", ...) under three system prompts, greedy, all answered in prose or code. With one
earlier call in the conversation (rendered by the template, as a client replaying history sends
it) it calls, which is what the test below asks of it."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import Launched, launch_args

from pagedserve.frontend.chat_template import (
    load_chat_template,
    model_chat_template,
    reads_variable,
)
from pagedserve.frontend.tokenizer import load_tokenizer, render_chat

from real_models import smollm2_hf_dir

MODEL = "smollm2"
REAL_ARGS = ["--served-model-name", MODEL, "--max-model-len", "1024", "--kv-cache-memory", "64M"]
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
WARNING = "--enable-auto-tool-choice is set but the chat template never reads `tools`"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


def _call(city: str, call_id: str) -> dict:
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {"id": call_id, "type": "function", "function": function}


def _ask(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


@pytest.fixture(scope="module")
def hf_dir() -> str:
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def launches(hf_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 with its own template and with the shipped one, started side by side."""
    logs = tmp_path_factory.mktemp("tools")
    own = Launched(launch_args(hf_dir, *REAL_ARGS, *TOOL_ARGS), str(logs / "own.log"))
    shipped_args = [*REAL_ARGS, *TOOL_ARGS, "--chat-template", "chatml_tools"]
    shipped = Launched(launch_args(hf_dir, *shipped_args), str(logs / "shipped.log"))
    try:
        yield own, shipped
    finally:
        assert own.stop() == 0, own.output()
        assert shipped.stop() == 0, shipped.output()


def test_warns_when_the_template_never_reads_tools(launches: tuple[Launched, Launched]) -> None:
    own, shipped = launches
    own.wait_ready()
    assert WARNING in own.output() and "--chat-template chatml_tools" in own.output()
    assert own.stop() == 0, own.output()
    shipped.wait_ready()
    assert WARNING not in shipped.output()


def test_auto_calls_with_the_shipped_template(launches: tuple[Launched, Launched]) -> None:
    url = launches[1].wait_ready()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    earlier = {"role": "assistant", "content": None, "tool_calls": [_call("London", "call_1")]}
    messages = [_ask("London"), earlier, _ask("Paris")]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_shipped_template_shows_tools_calls_and_results(hf_dir: str) -> None:
    tokenizer = load_tokenizer(hf_dir)
    template = load_chat_template("chatml_tools")
    own = model_chat_template(hf_dir)
    assert reads_variable(template, "tools") and reads_variable(own, "tools") is False
    messages = [_ask("Paris")]
    plain = render_chat(tokenizer, messages, chat_template=template)
    assert plain == render_chat(tokenizer, messages, chat_template=own)  # no tools: no change
    history = [
        _ask("London"),
        {"role": "assistant", "content": "", "tool_calls": [_call("London", "c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 15}'},
        {"role": "assistant", "content": "It is 15 degrees."},
        _ask("Paris"),
    ]
    for call in history[1]["tool_calls"]:  # templates read arguments as a mapping
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = render_chat(tokenizer, history, chat_template=template, tools=[WEATHER])
    system = text.split("<|im_end|>")[0]
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    response = '<|im_start|>tool\n<tool_response>\n{"temperature": 15}\n</tool_response><|im_end|>'
    assert response in text and text.endswith("<|im_start|>assistant\n")
