"""A Responses API reply built from chat deltas: output items and the typed stream events.

The chat code reads the model's text (`ChoiceStream.deltas`: reasoning, content, tool calls as
they settle); `ResponseOutput.feed` turns each delta into Responses output items (`reasoning`,
`message` with one `output_text` part, `function_call`) and the events OpenAI sends for them, in
its order: `output_item.added`, `content_part.added`, `output_text.delta`... `output_text.done`,
`content_part.done`, `output_item.done`, one item after the other. A non-streamed reply is the
same items with the events dropped.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

Event = dict[str, Any]  # without sequence_number (the stream numbers them)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    def __init__(self, summary: bool, encrypted_reasoning: bool) -> None:
        self.summary = summary  # reasoning also as a summary (reasoning.summary set)
        self.encrypted_reasoning = encrypted_reasoning  # include reasoning.encrypted_content
        self.items: list[dict[str, Any]] = []
        self.events: list[Event] = []
        self._open: str | None = None  # the kind of the last item while it takes deltas
        self._calls: dict[int, int] = {}  # chat tool call index -> output index

    def feed(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                self._call_start(call["index"], call["id"], call["function"]["name"])
            arguments = call["function"].get("arguments")
            if arguments:
                self._call_arguments(call["index"], arguments)

    def close(self, status: str = "completed") -> None:
        """End the open item (its `done` events); each item's status becomes `status`."""
        self._end()
        for item in self.items:
            item["status"] = status

    def message(self) -> dict[str, Any]:
        """The reply as an assistant chat message (what previous_response_id continues)."""
        text = [i["content"][0]["text"] for i in self.items if i["type"] == "message"]
        reasoning = [_reasoning_text(i) for i in self.items if i["type"] == "reasoning"]
        calls = [
            {"id": i["call_id"], "type": "function",
             "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items if i["type"] == "function_call"
        ]  # fmt: skip
        out: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            out["tool_calls"] = calls
        if reasoning:
            out["reasoning_content"] = "".join(reasoning)
        return out

    # ------------------------------------------------------------------ items
    def _add(self, kind: str, item: dict[str, Any]) -> int:
        self._end()
        self._open = kind
        self.items.append(item)
        index = len(self.items) - 1
        self.events.append({"type": "response.output_item.added", "output_index": index,
                            "item": _copy(item)})  # fmt: skip
        return index

    def _reasoning(self, text: str) -> None:
        if self._open != "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            index = self._add("reasoning", item)
            if self.summary:
                item["summary"].append({"type": "summary_text", "text": ""})
                self._event("response.reasoning_summary_part.added", index, summary_index=0,
                            part={"type": "summary_text", "text": ""})  # fmt: skip
        index, item = len(self.items) - 1, self.items[-1]
        item["content"][0]["text"] += text
        if self.summary:
            item["summary"][0]["text"] += text
            self._event("response.reasoning_summary_text.delta", index, summary_index=0,
                        delta=text)  # fmt: skip
        else:
            self._event("response.reasoning_text.delta", index, content_index=0, delta=text)

    def _text(self, text: str) -> None:
        if self._open != "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            index = self._add("message", item)
            item["content"].append(_output_text(""))
            self._event("response.content_part.added", index, content_index=0,
                        part=_output_text(""))  # fmt: skip
        index, item = len(self.items) - 1, self.items[-1]
        item["content"][0]["text"] += text
        self._event("response.output_text.delta", index, content_index=0, delta=text,
                    logprobs=[])  # fmt: skip

    def _call_start(self, chat_index: int, call_id: str, name: str) -> None:
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}  # fmt: skip
        self._calls[chat_index] = self._add("function_call", item)

    def _call_arguments(self, chat_index: int, fragment: str) -> None:
        index = self._calls[chat_index]
        assert index == len(self.items) - 1, "a call's arguments come before the next call"
        self.items[index]["arguments"] += fragment
        self._event("response.function_call_arguments.delta", index, delta=fragment)

    def _end(self) -> None:
        """The `done` events of the open item."""
        kind, self._open = self._open, None
        if kind is None:
            return
        index, item = len(self.items) - 1, self.items[-1]
        item["status"] = "completed"
        if kind == "reasoning":
            text = item["content"][0]["text"]
            if self.summary:
                self._event("response.reasoning_summary_text.done", index, summary_index=0,
                            text=text)  # fmt: skip
                self._event("response.reasoning_summary_part.done", index, summary_index=0,
                            part={"type": "summary_text", "text": text})  # fmt: skip
            else:
                self._event("response.reasoning_text.done", index, content_index=0, text=text)
            if self.encrypted_reasoning:
                item["encrypted_content"] = base64.b64encode(text.encode()).decode()
        elif kind == "message":
            part = item["content"][0]
            self._event("response.output_text.done", index, content_index=0, text=part["text"],
                        logprobs=[])  # fmt: skip
            self._event("response.content_part.done", index, content_index=0, part=_copy(part))
        else:
            self._event("response.function_call_arguments.done", index,
                        arguments=item["arguments"], name=item["name"])  # fmt: skip
        self.events.append({"type": "response.output_item.done", "output_index": index,
                            "item": _copy(item)})  # fmt: skip

    def _event(self, kind: str, index: int, **fields: Any) -> None:
        self.events.append({"type": kind, "item_id": self.items[index]["id"],
                            "output_index": index, **fields})  # fmt: skip


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_text(item: dict[str, Any]) -> str:
    return item["content"][0]["text"]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it stands (it keeps changing after its event is queued)."""
    out = dict(item)
    for key in ("content", "summary"):
        if key in out:
            out[key] = [dict(part) for part in out[key]]
    return out
