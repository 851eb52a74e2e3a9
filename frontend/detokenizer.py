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


# Stop strings a request may carry. vLLM sets no limit; these are far above what clients send
# (OpenAI takes 4), yet bound the work per token: each new token scans at most MAX_STOP_STRINGS
# windows of MAX_STOP_STRING_CHARS characters.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512


def check_stop_strings(stops: list[str]) -> None:
    """ValueError (with a message for the user) unless `stops` is a list of stop strings this
    engine matches: not empty (vLLM refuses it too), within the limits, valid Unicode (a lone
    surrogate cannot cross the ipc)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings (got {len(stops)}).")
    for stop in stops:
        if not stop:
            raise ValueError("stop cannot contain an empty string.")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"Each stop string may be at most {MAX_STOP_STRING_CHARS} characters long "
                f"(got {len(stop)})."
            )
        check_unicode(stop, "stop")


def check_unicode(text: str, name: str) -> None:
    """ValueError if `text` holds a lone surrogate (valid JSON, "\\ud800", but not text: UTF-8,
    msgpack and the tokenizer all refuse it)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text: it holds a lone surrogate "
            f"({ascii(text[e.start])} at character {e.start})."
        ) from None


class StopStrings:
    """A request's stop strings, matched incrementally: a stop string that was not in the text
    before can only end inside the newly added text, so each check scans the new text and the
    `len(stop) - 1` characters before it, and only for the stop strings whose last character is
    in the new text."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.include = include
        self.by_last: dict[str, list[tuple[int, str]]] = {}  # last character -> (index, stop)
        for index, stop in enumerate(stops):
            self.by_last.setdefault(stop[-1], []).append((index, stop))
        # While unfinished, hold back text that could still turn out to be a stop string's start.
        self.hold = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, new_len: int) -> tuple[str, int] | None:
        """The earliest stop string (the first listed among those that start at the same place)
        that ends inside the last `new_len` characters of `text`, and the length at which to cut
        the text (after the stop string when `include`)."""
        best: tuple[int, int, str] | None = None  # (where, index, stop)
        tail = len(text) - new_len
        for char in set(text[tail:]):
            for index, stop in self.by_last.get(char, ()):
                at = text.find(stop, max(0, tail - len(stop) + 1))
                if at != -1 and (best is None or (at, index) < best[:2]):
                    best = (at, index, stop)
        if best is None:
            return None
        at, _, stop = best
        return stop, at + len(stop) if self.include else at
