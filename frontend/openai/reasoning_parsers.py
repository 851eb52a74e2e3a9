"""A reasoning model's `<think>...</think>` moved out of the content into `reasoning_content`.

`--reasoning-parser NAME`, as in vLLM:
- qwen3: the model writes `<think>` itself; a reply that does not open with it (thinking off:
  the template already closed an empty block) is all content;
- deepseek_r1: the template opens `<think>`, so the reply is reasoning until `</think>`
  (a reply without `</think>` is all reasoning, so far or in the end).
`split` works on the whole text so far, so a stream sends what grew since its last call; a
partial tag at the end is held back. A grammar (response_format, tools) applies only after
`</think>`: `end_token_id` tells the sampling ranks which token ends the reasoning.
"""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.openai.harmony import GptOssReasoningParser
from pagedserve.frontend.openai.tool_parsers import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    opens_in_prompt = False  # deepseek_r1: the generation prompt already holds <think>

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        self.end_token_id: int | None = vocab.get(END)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far, each a prefix of what the next call returns
        (a possible start of `</think>` or `<think>` is held back until `final`)."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START) :]
        elif not self.opens_in_prompt:
            may_open = not final and START.startswith(body)
            return "", "" if may_open else text
        reasoning, closed, content = body.partition(END)
        if closed or final:
            return reasoning, content
        return reasoning[: held_back(reasoning, (END,))], ""

    def grammar_starts_after(self, prompt_ids: list[int]) -> int | None:
        """The token after which a grammar applies; None: at once (no reasoning expected)."""
        if self.end_token_id is None or self.end_token_id in prompt_ids:
            return None
        return self.end_token_id


class Qwen3ReasoningParser(ReasoningParser):
    pass


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
