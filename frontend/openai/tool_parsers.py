"""Tool calls in a model's text (`tool_choice: auto`), one parser per model family's format.

`--tool-call-parser NAME` (with `--enable-auto-tool-choice`) picks one, as in vLLM:
- hermes: Qwen2.5 / Qwen3 / Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (any number, text before the first is content);
- llama3_json: Llama 3.1+, the whole reply a JSON object `{"name": ..., "parameters": {...}}`
  (several joined by `;`), optionally after `<|python_tag|>`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` and the newer
  `[TOOL_CALLS]name[ARGS]{...}` (repeated);
- qwen3_coder (alias qwen3_xml): Qwen3-Coder / Qwen3.5, `<tool_call>\n<function=NAME>\n
  <parameter=KEY>\nVALUE\n</parameter>...</function>\n</tool_call>`; values are text, read as
  the request's tool schema types them (`for_tools`): strings stay strings, the rest as JSON.
- openai: gpt-oss's harmony messages to `functions.NAME` (frontend/openai/harmony.py).
`extract` returns (content or None, [(name, arguments as JSON text)]); a reply that does not
parse is plain content. `stream_cut(text)`: how much of a reply a stream may send as content now
(up to where a call may start); the rest is held back and the calls are sent when the reply ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.frontend.openai.harmony import OpenAIToolParser

ToolCalls = list[tuple[str, str]]


def _call(obj: Any, args_key: str = "arguments") -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesParser:
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, ToolCalls]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def stream_cut(self, text: str) -> int:
        return held_back(text, self.markers)


class Llama3JsonParser:
    def stream_cut(self, text: str) -> int:
        """A reply that is (or may become) JSON is held back whole."""
        body = text.lstrip()
        may_be_call = body.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(body)
        return 0 if may_be_call else len(text)

    def extract(self, text: str) -> tuple[str | None, ToolCalls]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls


class MistralParser:
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token: the text must keep it

    def extract(self, text: str) -> tuple[str | None, ToolCalls]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        content = text[:start].strip() or None
        pieces = [p.strip() for p in text[start:].split("[TOOL_CALLS]") if p.strip()]
        try:
            if len(pieces) == 1 and pieces[0].startswith("["):  # [{"name":, "arguments":}, ...]
                calls = [_call(obj) for obj in json.loads(pieces[0])]
            else:  # name[ARGS]{...}, once per [TOOL_CALLS]
                calls = [_named_args(p) for p in pieces]
        except (json.JSONDecodeError, ValueError):
            return text, []
        if not calls or any(c is None for c in calls):
            return text, []
        return content, calls  # type: ignore[return-value]

    def stream_cut(self, text: str) -> int:
        return held_back(text, self.markers)


def _named_args(piece: str) -> tuple[str, str]:
    name, sep, args = piece.partition("[ARGS]")
    if not sep or not name.strip():
        raise ValueError(piece)
    return name.strip(), json.dumps(json.loads(args), ensure_ascii=False)


class Qwen3XMLParser:
    markers = ("<tool_call>", "<function=")
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
    )

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # function name -> its parameters' JSON schemas

    def for_tools(self, tools: list[Any]) -> Qwen3XMLParser:
        """This parser for one request's tools, whose schemas type the parameters' text."""
        schemas = {}
        for tool in tools:
            params = tool.function.parameters or {}
            schemas[tool.function.name] = params.get("properties") or {}
        return Qwen3XMLParser(schemas)

    def extract(self, text: str) -> tuple[str | None, ToolCalls]:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if not found:
            return text, []
        start = min(found)
        calls = []
        for name, body in self._FUNCTION.findall(text[start:]):
            name, schema = name.strip(), self.schemas.get(name.strip(), {})
            args = {
                key.strip(): _typed(_strip_newline(value), schema.get(key.strip()))
                for key, value in self._PARAMETER.findall(body)
            }
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def stream_cut(self, text: str) -> int:
        return held_back(text, self.markers)


def _strip_newline(value: str) -> str:
    """The template writes each value between newlines: `<parameter=k>\nVALUE\n</parameter>`."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema types it (vLLM's qwen3_coder reading): a string (or an
    unknown parameter) as it is, `null` as None, anything else as JSON when it parses."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if value.lower() == "null":
        return None
    if kind in (None, "string"):
        return value
    try:
        return json.loads(value.lower() if kind == "boolean" else value)
    except json.JSONDecodeError:
        return value


PARSERS = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3XMLParser,
    "qwen3_xml": Qwen3XMLParser,
    "openai": OpenAIToolParser,  # gpt-oss's harmony format (harmony.py)
}


def make_tool_parser(name: str) -> Any:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(PARSERS)})")
    return PARSERS[name]()


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How much of `text` a stream may send now: up to the first marker, or short of a marker's
    beginning at the very end (the rest of it may come with the next token)."""
    cut = min((i for i in (text.find(m) for m in markers) if i >= 0), default=len(text))
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut
