"""Incremental detokenizing and stop strings, on the client side (the core never sees text).

Decoding a growing id list token by token must not split a multi-byte character or lose the space
that a SentencePiece/BPE token carries only in context, so each step decodes a short window twice
(`[prefix, read)` and `[prefix, end)`) and emits the difference once it is no longer a partial
character (vLLM's approach). A few prompt tokens seed the window for the first output token.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if self.tokenizer is None:  # skip_tokenizer_init: ids only
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += new_text
        return new_text

    def decode_one(self, token_id: int) -> str | None:
        """A token's own text, for logprob entries."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def find_stop_string(
    text: str, new_len: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last `new_len` characters of `text`, and
    the length at which to cut the text (after the stop string when `include`)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    if best is None:
        return None
    stop, at = best
    return stop, at + len(stop) if include else at
