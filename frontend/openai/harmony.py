"""gpt-oss's harmony format, read from a reply's text: its reasoning and its tool calls.

A harmony reply is a run of messages: `<|start|>{role}[ to={recipient}]<|channel|>{channel}
[ to={recipient}][ <|constrain|>json]<|message|>{body}` ended by `<|end|>`, `<|call|>` (a tool
call) or `<|return|>` (the last). The prompt ends with `<|start|>assistant`, so the reply's first
message has no `<|start|>`. Channels: `analysis` (chain of thought), `commentary` (tool calls,
which name a recipient such as `functions.get_weather`, and preambles) and `final` (the answer).

The special tokens must stay in the text (`keeps_special_tokens`: the reply is detokenized with
them; the EOS `<|return|>` / `<|call|>` that ends it is dropped as for any model). They are single
tokens, so a stream never sees half of one; a message counts once its header is complete.

`--reasoning-parser openai_gptoss` sends analysis bodies to `reasoning_content`; what it leaves as
content is the final and preamble bodies as plain text and each tool call as its raw message,
which `--tool-call-parser openai` then turns into `tool_calls` (it also reads a raw reply, without
the reasoning parser, dropping the analysis). Built on the text (not openai_harmony's token
parser: its tokenizer, o200k_harmony, is a download this deployment may not make).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedserve.frontend.openai.protocol import APIError

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_ENDS = re.compile("|".join(re.escape(e) for e in ENDS))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class Message:
    raw: str  # from its `<|start|>` (if any) to its end marker (if it came)
    channel: str | None  # None: no channel named
    recipient: str | None  # a tool call's `functions.NAME`
    body: str


Item = str | Message  # plain text (outside any message) or a message with a complete header


def parse(text: str) -> list[Item]:
    """The reply's messages, and plain text where no message is (a reply that ignores harmony,
    or what follows an end marker); a message whose header is not complete yet is left out."""
    items: list[Item] = []
    for i, chunk in enumerate(text.split(START)):
        if i == 0 and MESSAGE not in chunk and CHANNEL not in chunk:
            items.append(chunk)  # no message opened yet
            continue
        header, has_body, rest = chunk.partition(MESSAGE)
        if not has_body:
            continue  # the header is still coming
        end = _ENDS.search(rest)
        body = rest if end is None else rest[: end.start()]
        whole = chunk if end is None else chunk[: len(header) + len(MESSAGE) + end.end()]
        raw = (START if i else "") + whole
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        items.append(Message(raw, channel and channel[1], recipient and recipient[1], body))
        if end is not None and rest[end.end() :]:
            items.append(rest[end.end() :])
    return items


def call_name(recipient: str) -> str:
    return recipient.removeprefix("functions.")


class GptOssReasoningParser:
    """`--reasoning-parser openai_gptoss`: analysis bodies -> reasoning_content."""

    opens_in_prompt = False
    keeps_special_tokens = True
    end_token_id: int | None = None  # grammars are refused (grammar_starts_after)

    def __init__(self, tokenizer: Any) -> None:
        pass

    def for_prompt(self, prompt_ids: list[int]) -> GptOssReasoningParser:
        """The parser for one request: the same one (harmony replies name their channel)."""
        return self

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) so far, each a prefix of what the next call returns."""
        reasoning, content = [], []
        for item in parse(text):
            if isinstance(item, str):
                content.append(item)
            elif item.channel == "analysis" and item.recipient is None:
                reasoning.append(item.body)
            else:  # a tool call stays raw for the tool parser; the rest is plain text
                content.append(item.raw if item.recipient else item.body)
        return "".join(reasoning), "".join(content)

    def grammar_starts_after(self, prompt_ids: list[int]) -> int | None:
        """A grammar would bind the reply from its first token, the harmony header: refused."""
        raise APIError(
            400,
            "response_format, structured_outputs and tool_choice required or named are not "
            "supported with --reasoning-parser openai_gptoss yet (use tool_choice auto).",
        )


class OpenAIToolParser:
    """`--tool-call-parser openai`: commentary messages to `functions.NAME` -> tool calls (the
    body is the arguments' JSON), the final and preamble text -> content."""

    keeps_special_tokens = True
    markers = (START, CHANNEL)

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        content, calls = [], []
        for item in parse(text):
            if isinstance(item, str):
                content.append(item)
            elif item.recipient is not None:
                calls.append((call_name(item.recipient), item.body.strip()))
            elif item.channel != "analysis":
                content.append(item.body)
        left = "".join(content)
        if not calls:
            return left, []
        return left.strip() or None, calls

    def stream_cut(self, text: str) -> int:
        """Content may stream up to where a message (a call, with the reasoning parser) opens."""
        cuts = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(cuts, default=len(text))
