"""A reasoning model's `<think>...</think>` moved out of the content into `reasoning_content`.

`--reasoning-parser NAME`, as in vLLM:
- qwen3: Qwen3's templates let the model write `<think>` itself; Qwen3.5's open it in the
  generation prompt (thinking on) or close an empty block there (`enable_thinking: false`). So a
  reply is reasoning until `</think>` when it opens with `<think>` or when the prompt's last think
  tag is an open `<think>` (`for_prompt`); else all content. An open reasoning also ends where a
  tool call begins (`<tool_call>` then `<function=`: Qwen3.5 may call without closing `</think>`);
- deepseek_r1: the template opens `<think>`, so the reply is reasoning until `</think>`
  (a reply without `</think>` is all reasoning, so far or in the end).
`split` works on the whole text so far, so a stream sends what grew since its last call; a
partial tag at the end is held back. A grammar (response_format, tools) applies only after
`</think>`: `end_token_id` tells the sampling ranks which token ends the reasoning.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pagedserve.frontend.openai.harmony import GptOssReasoningParser
from pagedserve.frontend.openai.tool_parsers import held_back

START, END = "<think>", "</think>"
CALL, FUNCTION = "<tool_call>", "<function"
_CALL_BEGINS = re.compile(r"<tool_call>\s*<function[=\s>]")


class ReasoningParser:
    opens_in_prompt = False  # deepseek_r1: the generation prompt always holds <think>
    ends_at_tool_call = False  # qwen3: `<tool_call><function=` ends an open reasoning

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        self.start_token_id: int | None = vocab.get(START)
        self.end_token_id: int | None = vocab.get(END)
        self.opened = self.opens_in_prompt  # whether the reply starts inside <think>

    def for_prompt(self, prompt_ids: list[int]) -> ReasoningParser:
        """This parser for one request: the reply starts inside `<think>` when the prompt's
        last think tag opens one (Qwen3.5's template with thinking on)."""
        view = copy.copy(self)
        view.opened = self.opens_in_prompt or self._last_tag(prompt_ids) == self.start_token_id
        return view

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far, each a prefix of what the next call returns
        (a possible start of `</think>` or `<think>` is held back until `final`)."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START) :]
        elif not self.opened:
            may_open = not final and START.startswith(body)
            return "", "" if may_open else text
        reasoning, closed, content = body.partition(END)
        if closed:
            return reasoning, content
        call = _CALL_BEGINS.search(reasoning) if self.ends_at_tool_call else None
        if call is not None:
            return reasoning[: call.start()], reasoning[call.start() :]
        if final:
            return reasoning, ""
        return reasoning[: self._settled(reasoning)], ""

    def _settled(self, reasoning: str) -> int:
        """How much of an open reasoning a stream may send: short of a partial `</think>` at the
        end and, for qwen3, of a `<tool_call>` that `<function` may still follow."""
        cut = held_back(reasoning, (END,))
        if not self.ends_at_tool_call:
            return cut
        last = reasoning.rfind(CALL)
        after = last + len(CALL) if last >= 0 else 0
        if last >= 0 and FUNCTION.startswith(reasoning[after:].lstrip()):
            return min(cut, last)
        return min(cut, after + held_back(reasoning[after:], (CALL,)))

    def grammar_starts_after(self, prompt_ids: list[int]) -> int | None:
        """The token after which a grammar applies; None: at once (no reasoning expected, as
        when the prompt's last think tag closes the block)."""
        if self.end_token_id is None or self._last_tag(prompt_ids) == self.end_token_id:
            return None
        return self.end_token_id

    def _last_tag(self, prompt_ids: list[int]) -> int | None:
        tags = (self.start_token_id, self.end_token_id)
        return next((t for t in reversed(prompt_ids) if t in tags and t is not None), None)


class Qwen3ReasoningParser(ReasoningParser):
    ends_at_tool_call = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    opens_in_prompt = True


REASONING_PARSERS = {
    "qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,  # harmony's analysis channel (harmony.py)
}  # fmt: skip


def make_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r} (one of {known})")
    return REASONING_PARSERS[name](tokenizer)
