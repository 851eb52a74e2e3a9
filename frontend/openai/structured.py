"""Which grammar a request asks for (response_format, structured_outputs, tool_choice), checked
before anything runs.

Every grammar is built once here with xgrammar (pagedserve/grammar_spec.py: a bad schema or regex
is a 400 naming the problem) and then compiled by the sampling worker ranks, which mask the logits
with it. xgrammar imports torch, so it loads on the first constrained request (in a thread), never
at start-up.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Any

from pagedserve.frontend.openai.protocol import APIError
from pagedserve.grammar_spec import build_grammar
from pagedserve.ipc.messages import StructuredOutputs

MAX_VALIDATED = 1024


def spec_from_request(req: Any) -> StructuredOutputs | None:
    """The grammar of `response_format` or `structured_outputs` (both is a 400), or None."""
    fmt, so = req.response_format, req.structured_outputs
    spec: dict[str, Any] = {}
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            spec["json_object"] = True
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema.",
                               param="response_format")  # fmt: skip
            spec["json"] = fmt.json_schema.json_schema
        else:
            raise APIError(400, f"response_format type {fmt.type!r} is not supported (text, "
                           "json_object, json_schema).", param="response_format")  # fmt: skip
    if so is not None:
        kinds = {
            "json": so.json_schema, "regex": so.regex, "choice": so.choice,
            "grammar": so.grammar, "json_object": so.json_object or None,
            "structural_tag": so.structural_tag,
        }  # fmt: skip
        given = {k: v for k, v in kinds.items() if v is not None}
        if given and spec:
            raise APIError(400, "Give response_format or structured_outputs, not both.",
                           param="structured_outputs")  # fmt: skip
        spec.update(given)
        if isinstance(spec.get("structural_tag"), dict):
            spec["structural_tag"] = json.dumps(spec["structural_tag"])
        if so.any_whitespace:
            spec["any_whitespace"] = True
    return make_spec(spec, "structured_outputs") if spec.keys() - {"any_whitespace"} else None


def make_spec(fields: dict[str, Any], param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param) from e


def tool_call_spec(
    choice: str | dict[str, Any], tools: list[Any], parallel_tool_calls: bool
) -> tuple[StructuredOutputs | None, str | None]:
    """For `tool_choice` required or a named function: the grammar of the tool calls' JSON, and
    the forced function's name (None for required: the output is a JSON array of calls)."""
    if choice in ("none", "auto"):
        return None, None
    if not tools:
        raise APIError(400, "tool_choice needs tools.", param="tool_choice")
    by_name = {t.function.name: t.function for t in tools}
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _params(f.parameters)},
                "required": ["name", "parameters"],
            }
            for name, f in by_name.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return make_spec({"json": schema}, "tool_choice"), None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name is None:
        message = 'tool_choice must be none, auto, required or {"function": {"name": ...}}.'
        raise APIError(400, message, param="tool_choice")
    if name not in by_name:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools.", "tool_choice")
    return make_spec({"json": _params(by_name[name].parameters)}, "tool_choice"), name


def _params(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


class GrammarValidator:
    """Builds each new grammar once (off the event loop); remembers the keys that built."""

    def __init__(self) -> None:
        self._ok: OrderedDict[str, None] = OrderedDict()

    async def check(self, spec: StructuredOutputs, param: str) -> None:
        key = spec.key
        if key in self._ok:
            self._ok.move_to_end(key)
            return
        try:  # the first call imports xgrammar (and torch), in the thread
            await asyncio.to_thread(build_grammar, spec)
        except ValueError as e:
            raise APIError(400, f"{e}.", param=param) from None
        self._ok[key] = None
        while len(self._ok) > MAX_VALIDATED:
            self._ok.popitem(last=False)
