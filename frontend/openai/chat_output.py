"""A chat reply's text turned into the message OpenAI returns: reasoning, content and tool calls.

The reasoning parser (if any) splits `<think>...</think>` off first; the rest is content, or
tool calls: the forced function's arguments (`tool_choice` named), a JSON array of calls
(`required`: both grammar-enforced), or what the tool parser finds (`auto`). A stream feeds the
whole text so far to `ChoiceStream.deltas` and gets OpenAI's deltas: reasoning and content as
they settle, a forced or required call's name first (once its string is closed) and then its
arguments as they grow, parsed calls (auto) when the reply ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.frontend.openai.reasoning_parsers import ReasoningParser

ToolCalls = list[tuple[str, str]]


@dataclass
class ChatShape:
    """How one request's replies are read."""

    reasoning: ReasoningParser | None = None
    forced_name: str | None = None  # tool_choice names a function: the reply is its arguments
    required: bool = False  # tool_choice required: the reply is [{"name", "parameters"}, ...]
    tool_parser: Any = None  # tool_choice auto with --enable-auto-tool-choice

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self.reasoning.split(text, final) if self.reasoning else ("", text)

    def tool_calls(self, content: str) -> tuple[str | None, ToolCalls]:
        """(content left, calls) of a finished reply's content."""
        if self.forced_name is not None:
            return None, [(self.forced_name, content)]
        if self.required:
            try:
                items = json.loads(content)
                parsed = [(c["name"], json.dumps(c["parameters"])) for c in items]
            except (ValueError, KeyError, TypeError):
                return content, []  # cut short (length): no valid array
            calls = required_calls(content)  # the arguments as generated, as a stream sends them
            return None, calls if len(calls) == len(parsed) else parsed
        if self.tool_parser is not None:
            return self.tool_parser.extract(content)
        return content, []

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        reasoning, content = self.split(text, final=True)
        left, calls = self.tool_calls(content)
        msg: dict[str, Any] = {"role": "assistant", "content": left}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [tool_call(name, args) for name, args in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        elif left is None:
            msg["content"] = content
        if self.reasoning is not None and not msg["content"]:
            msg["content"] = None  # all reasoning (cut short, or tool calls after it): as vLLM
        return msg, finish_reason


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ChoiceStream:
    """What one streamed choice has sent so far."""

    def __init__(self, shape: ChatShape) -> None:
        self.shape = shape
        self.reasoning_sent = 0
        self.content_sent = 0
        self.forced_started = False
        self.num_calls = 0
        self.arguments_sent: list[int] = []  # per call (required)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        shape = self.shape
        reasoning, content = shape.split(text, final)
        out: list[dict[str, Any]] = []
        if len(reasoning) > self.reasoning_sent:
            out.append({"reasoning_content": reasoning[self.reasoning_sent :]})
            self.reasoning_sent = len(reasoning)
        if shape.forced_name is not None:
            out.extend(self._forced(content, final))
        elif shape.required:
            out.extend(self._required(content, final))
        elif shape.tool_parser is not None:
            cut = shape.tool_parser.stream_cut(content)
            if final:
                left, calls = shape.tool_calls(content)
                self.num_calls = len(calls)
                cut = len(content) if not calls else self.content_sent
                out.extend(self._content(content[:cut]))
                for i, (name, arguments) in enumerate(calls):
                    out.extend(_call_deltas(i, name, arguments))
            else:
                out.extend(self._content(content[:cut]))
        else:
            out.extend(self._content(content))
        return out

    def _content(self, settled: str) -> list[dict[str, Any]]:
        if len(settled) <= self.content_sent:
            return []
        delta = {"content": settled[self.content_sent :]}
        self.content_sent = len(settled)
        return [delta]

    def _forced(self, content: str, final: bool) -> list[dict[str, Any]]:
        out = []
        if not self.forced_started and (content or final):
            self.forced_started = True
            self.num_calls = 1
            call = tool_call(self.shape.forced_name or "", "")
            out.append({"tool_calls": [{"index": 0, **call}]})
        if len(content) > self.content_sent:
            fragment = content[self.content_sent :]
            self.content_sent = len(content)
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
        return out

    def _required(self, content: str, final: bool) -> list[dict[str, Any]]:
        """Each call of the JSON array as it grows: its id and name once the name is closed,
        then its arguments' new text."""
        out = []
        calls = required_calls(content)
        for i, (name, arguments) in enumerate(calls):
            if i == self.num_calls:
                self.num_calls += 1
                self.arguments_sent.append(0)
                out.append({"tool_calls": [{"index": i, **tool_call(name, "")}]})
            if len(arguments) > self.arguments_sent[i]:
                fragment = arguments[self.arguments_sent[i] :]
                self.arguments_sent[i] = len(arguments)
                out.append({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
        if final and not calls:
            out.extend(self._content(content))  # not a call at all (cut short): plain content
        return out


_CALL_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*')
_PARAMETERS = re.compile(r'\s*,\s*"parameters"\s*:\s*')
_CALL_END = re.compile(r"\s*\}")


def required_calls(text: str) -> ToolCalls:
    """(name, arguments so far) of each call in (a prefix of) a `required` reply, the JSON
    array `[{"name": ..., "parameters": {...}}, ...]` its grammar enforces (keys in that order);
    a call appears once its name is closed."""
    calls: ToolCalls = []
    decoder, pos = json.JSONDecoder(), 0
    while head := _CALL_HEAD.match(text, pos):
        try:
            name, pos = decoder.raw_decode(text, head.end())
        except json.JSONDecodeError:
            break  # the name is not closed yet
        if not isinstance(name, str):
            break
        calls.append((name, ""))
        params = _PARAMETERS.match(text, pos)
        if params is None:
            break
        end = _value_end(text, params.end())
        calls[-1] = (name, text[params.end() : end])
        close = _CALL_END.match(text, end)
        if close is None:
            break
        pos = close.end()
    return calls


def _value_end(text: str, start: int) -> int:
    """Where the JSON value at `start` ends (its length so far if it is not closed yet)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else i
        elif ch == "," and depth == 0:
            return i
    return len(text)


def _call_deltas(index: int, name: str, arguments: str) -> list[dict[str, Any]]:
    """OpenAI's order: the call's id and name (empty arguments), then the arguments."""
    head = {"tool_calls": [{"index": index, **tool_call(name, "")}]}
    return [head, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]
