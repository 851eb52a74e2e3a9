"""Structured outputs and tool calls end to end: one `pagedserve launch` of the embedded default
model (its vocabulary spells JSON) driven by the official openai client."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from test_server import CPU_ARGS, Launched

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},  # bounded: the object can end
    },
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Tell me about a person as JSON."}]
SEEDS = [0, 1, 2]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    args = ["--host", "127.0.0.1", "--port", "0", *CPU_ARGS, "--max-model-len", "512",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("launch") / "launch.log"))
    yield proc.wait_ready() + "/v1"
    assert proc.stop() == 0, proc.output()


def run(url, go):
    """`go(client)` on a fresh event loop with an async openai client of its own."""

    async def main():
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=120) as c:
            return await go(c)

    return asyncio.run(main())


async def _chat(client, stream: bool, **kw) -> tuple[str, str, list]:
    """(content, finish_reason, tool_calls as [(name, arguments)]) of one chat reply."""
    kw = {"model": "pagedserve-default", "messages": ASK, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        r = await client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
        return m.content or "", r.choices[0].finish_reason, calls
    text, finish, calls = "", None, {}
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                if t.function.name:
                    assert not args, "the name comes before the arguments"
                calls[t.index] = (
                    name + (t.function.name or ""),
                    args + (t.function.arguments or ""),
                )
            finish = c.finish_reason or finish
    return text, finish, [calls[i] for i in sorted(calls)]


def test_json_schema_replies_validate(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    async def go(client):
        jobs = [_chat(client, stream, response_format=fmt, seed=s, temperature=1.0)
                for s in SEEDS for stream in (False, True)]  # fmt: skip
        return await asyncio.gather(*jobs)

    results = run(url, go)
    assert any(finish == "stop" for _, finish, _ in results), results
    for text, finish, _ in results:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
            assert " " not in text.replace(json.dumps(json.loads(text)["name"]), ""), text
    by_seed = [results[i : i + 2] for i in range(0, len(results), 2)]
    assert all(a[0] == b[0] for a, b in by_seed), "a stream gives the same text as a reply"


def test_other_grammars(url):
    async def go(client):
        tag = {
            "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
            "triggers": ["<f>"],
        }  # vLLM's structural_tag: free text, JSON inside <f>...</f>
        so = {"regex": r"[0-9]{3}-[a-c]{2}", "choice": ["red", "green"],
              "grammar": 'root ::= "x" ("ab" | "cd")+ "y"',
              "structural_tag": json.dumps(tag)}  # fmt: skip
        out = {}
        for kind, value in so.items():
            r = await client.completions.create(
                model="pagedserve-default", prompt="def f(", max_tokens=24, seed=3,
                extra_body={"structured_outputs": {kind: value}},
            )  # fmt: skip
            out[kind] = r.choices[0]
        r = await client.completions.create(
            model="pagedserve-default", prompt="def f(", max_tokens=24, seed=3,
            extra_body={"structured_outputs": {"choice": ["yes"]}, "min_tokens": 12},
        )  # fmt: skip
        out["min_tokens"] = r.choices[0]  # the grammar ends it before min_tokens, as in vLLM
        r = await client.completions.create(
            model="pagedserve-default", prompt="x = ", max_tokens=MAX_TOKENS, seed=1,
            extra_body={"response_format": {"type": "json_object"}},
        )  # fmt: skip
        return out, r.choices[0]

    out, obj = run(url, go)
    assert (out["min_tokens"].text, out["min_tokens"].finish_reason) == ("yes", "stop")
    assert out["regex"].finish_reason == "stop" and len(out["regex"].text) == 6
    assert out["regex"].text[:3].isdigit() and set(out["regex"].text[4:]) <= set("abc")
    assert out["choice"].text in ("red", "green") and out["choice"].finish_reason == "stop"
    text = out["grammar"].text
    assert text[0] == "x" and (out["grammar"].finish_reason != "stop" or text[-1] == "y"), text
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
         "objec"),
        ({"structured_outputs": {"regex": "a(b"}}, "parenthesis"),
        ({"structured_outputs": {"grammar": 'root ::= "a" b'}}, '"b"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
          "structured_outputs": {"regex": "a"}}, "not both"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "nope"),
    ],
)  # fmt: skip
def test_bad_grammars_are_400(url, body, needle):
    async def go(client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="pagedserve-default", messages=ASK, max_tokens=4, extra_body=body
            )
        return e.value

    error = run(url, go)
    assert error.status_code == 400 and needle in str(error), str(error)


def test_required_and_named_tool_calls_have_valid_arguments(url):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(client):
        jobs = [_chat(client, stream, tools=[WEATHER, TIME], tool_choice=choice, seed=s,
                      temperature=1.0, max_tokens=MAX_TOKENS)
                for choice in ("required", named) for s in SEEDS[:1]
                for stream in (False, True)]  # fmt: skip
        return await asyncio.gather(*jobs)

    results = run(url, go)
    assert any(f == "tool_calls" for _, f, _ in results), results
    for text, finish, calls in results:
        if finish != "tool_calls":
            assert finish == "length"
            continue
        assert calls and not text
        for name, arguments in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[name]
            jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    assert all(c[0][0] == "get_weather" for _, f, c in results[2:] if f == "tool_calls")


def test_history_with_tool_calls_and_tool_messages(url):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip

    async def go(client):
        return await client.chat.completions.create(
            model="pagedserve-default", messages=messages, tools=[WEATHER], max_tokens=4
        )

    reply = run(url, go)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_mixed_batch_gives_each_what_it_gets_alone(url):
    """Constrained and unconstrained requests in one batch (async scheduling on) get what each
    gets alone. (test_parallel checks tp=2, pp=2 and, with pp, async scheduling off.)"""
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    cases = [{"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, {},
             {"structured_outputs": {"regex": regex}}, {}]  # fmt: skip

    async def one(client, i, extra):
        r = await client.completions.create(
            model="pagedserve-default", prompt="x = ", max_tokens=32, seed=10 + i,
            temperature=0.9, extra_body=extra,
        )  # fmt: skip
        return r.choices[0].text

    async def go(client):
        alone = [await one(client, i, extra) for i, extra in enumerate(cases)]
        jobs = [one(client, i, extra) for i, extra in enumerate(cases)]
        together = await asyncio.gather(*jobs)
        return alone, list(together)

    alone, together = run(url, go)
    assert alone == together
