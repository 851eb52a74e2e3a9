"""Tool-call and reasoning parsers on replies in the formats real chat templates teach (Qwen's
hermes `<tool_call>`, Llama 3.1's JSON with `<|python_tag|>`, Mistral's `[TOOL_CALLS]`, Qwen3.5's
XML `<function=...>`), whole and streamed token by token; Qwen3.5's reasoning opened by the
prompt; the grammar matcher's reasoning gate on token ids."""

from __future__ import annotations

import json

import pytest

from pagedserve.frontend.openai.chat_output import ChatShape, ChoiceStream
from pagedserve.frontend.openai.reasoning_parsers import make_reasoning_parser
from pagedserve.frontend.openai.tool_parsers import make_tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = {
    "hermes": (
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>',
        "I will check.",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {}}',
        None,
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
    ),
    "qwen3_coder": (
        "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will check.",
    ),
}


class _Vocab:
    def get_vocab(self):
        return {"<think>": 7, "</think>": 8}


@pytest.mark.parametrize("name", list(CASES))
def test_parsers_extract_calls(name):
    text, content = CASES[name]
    left, calls = make_tool_parser(name).extract(text)
    assert left == content
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", WEATHER), ("get_time", {})]
    plain = "The weather in Paris is {sunny}."
    assert make_tool_parser(name).extract(plain) == (plain, [])


def test_mistral_new_format():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    _, calls = make_tool_parser("mistral").extract(text)
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def _stream(shape: ChatShape, text: str, step: int = 3) -> list[dict]:
    stream, deltas = ChoiceStream(shape), []
    for end in range(step, len(text) + step, step):
        deltas += stream.deltas(text[:end], final=end >= len(text))
    return deltas


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_auto_calls_match_the_whole_reply(name):
    text, content = CASES[name]
    shape = ChatShape(tool_parser=make_tool_parser(name))
    deltas = _stream(shape, text)
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed.strip() == (content or "")
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}  # name first
    assert json.loads(calls[1]["function"]["arguments"]) == WEATHER
    message, finish = shape.message(text, "stop")
    assert finish == "tool_calls" and len(message["tool_calls"]) == 2


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_split_whole_and_streamed(parser):
    reasoning = make_reasoning_parser(parser, _Vocab())
    text = ("<think>" if parser == "qwen3" else "") + "Let me think.</think>\n\nThe answer."
    shape = ChatShape(reasoning=reasoning)
    message, _ = shape.message(text, "stop")
    assert message["reasoning_content"] == "Let me think."
    assert message["content"].strip() == "The answer."
    deltas = _stream(shape, text, step=2)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content", "") for d in deltas).strip() == "The answer."
    assert reasoning.grammar_starts_after([1, 2]) == 8
    assert reasoning.grammar_starts_after([1, 8, 2]) is None  # thinking closed in the prompt


def test_qwen3_without_thinking_is_all_content():
    shape = ChatShape(reasoning=make_reasoning_parser("qwen3", _Vocab()))
    message, _ = shape.message("Just the answer.", "stop")
    assert message == {
        "role": "assistant",
        "content": "Just the answer.",
        "reasoning_content": None,
    }


@pytest.mark.parametrize("step", [1, 3])
def test_qwen35_reasoning_opens_in_the_prompt_and_ends_at_a_call(step):
    """Qwen3.5's template opens `<think>` in the prompt (thinking on) or closes an empty block
    (off, and earlier turns close theirs). Without `</think>`, a `<tool_call>` that `<function=`
    follows ends the reasoning (a mere mention does not); the call's parameters are typed by the
    request's tool schema. Streamed in pieces, the same as whole."""
    from pagedserve.frontend.openai.protocol import ToolDefinition

    parser = make_reasoning_parser("qwen3", _Vocab())  # <think> = 7, </think> = 8
    on, off, again = [5, 7, 3], [5, 7, 3, 8, 3], [7, 4, 8, 5, 7]
    assert [parser.grammar_starts_after(p) for p in (on, off, again)] == [8, None, 8]
    shape = ChatShape(reasoning=parser.for_prompt(off))
    assert shape.message("The answer.", "stop")[0]["content"] == "The answer."
    shape = ChatShape(reasoning=parser.for_prompt(again))
    message, _ = shape.message("Still thinking", "length")
    assert (message["reasoning_content"], message["content"]) == ("Still thinking", None)
    tool = ToolDefinition.model_validate({"function": {"name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}})  # fmt: skip
    thought = "I need the weather; <tool_call> is its tag.\n"
    text = (
        f"{thought}<tool_call>\n<function=get_weather>\n<parameter=city>\n7\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>"
        "\n</tool_call>"
    )
    shape = ChatShape(
        reasoning=parser.for_prompt(on),
        tool_parser=make_tool_parser("qwen3_coder").for_tools([tool]),
    )
    message, finish = shape.message(text, "stop")
    assert (message["reasoning_content"], message["content"], finish) == (
        thought,
        None,
        "tool_calls",
    )
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "7", "days": 3, "note": None}
    deltas = _stream(shape, text, step=step)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert not any("content" in d for d in deltas)
    streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed[1]["arguments"] == call["function"]["arguments"]


def test_forced_call_streams_name_then_arguments():
    shape = ChatShape(forced_name="get_weather")
    deltas = _stream(shape, json.dumps(WEATHER))
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    assert json.loads(args) == WEATHER and len(deltas) > 3


@pytest.mark.parametrize("step", [1, 4])
def test_required_calls_stream_name_then_arguments(step):
    """`required`: each call of the grammar's JSON array streams as OpenAI does, its name once
    closed, then its arguments as they grow (not all at the end), the same as the whole reply."""
    args = {"city": 'Pa\\"ris}, {"name"', "days": [1, {"x": 2}]}  # quotes, braces in a string
    items = [{"name": "get_weather", "parameters": args}, {"name": "get_time", "parameters": {}}]
    text = json.dumps(items, separators=(",", ":"))
    shape = ChatShape(required=True)
    stream, per_delta = ChoiceStream(shape), []
    for end in range(step, len(text) + step, step):
        per_delta.append(stream.deltas(text[:end], final=end >= len(text)))
    calls: dict[int, list] = {}
    for k, deltas in enumerate(per_delta):
        for d in deltas:
            (call,) = d["tool_calls"]
            if "id" in call:
                assert call["index"] not in calls and call["function"]["arguments"] == ""
                calls[call["index"]] = [call["function"]["name"], "", k]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a, _ in calls.values()] == [("get_weather", args),
                                                                  ("get_time", {})]  # fmt: skip
    assert calls[1][2] < len(per_delta) - 1, "the second call begins before the reply ends"
    first_args = [
        k for k, ds in enumerate(per_delta) for d in ds
        if d["tool_calls"][0]["index"] == 0 and "id" not in d["tool_calls"][0]
    ]  # fmt: skip
    assert len(first_args) > 3 and first_args[0] < len(per_delta) // 2, "arguments stream early"
    message, finish = shape.message(text, "stop")
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert finish == "tool_calls" and whole == [(n, a) for n, a, _ in calls.values()]


def test_matcher_waits_for_the_end_of_reasoning():
    """A grammar with `after_token_id` ignores the tokens up to and including it."""
    from pagedserve.frontend.hub import default_model_dir
    from pagedserve.ipc.messages import StructuredOutputs
    from pagedserve.worker.grammar import GrammarCompiler
    from pagedserve.worker.grammar_masks import RowMatcher

    compiler = GrammarCompiler(default_model_dir(), 4096)
    spec = StructuredOutputs(choice=["yes"], after_token_id=4)
    matcher = RowMatcher(compiler.hold(spec), spec, eos_token_ids=[1])
    matcher.catch_up([10, 11, 12])  # thinking: free text
    assert not matcher.active and not matcher.broken
    matcher.catch_up([10, 11, 12, 4])
    assert matcher.active
    compiler.close()
