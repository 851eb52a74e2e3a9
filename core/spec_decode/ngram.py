"""Prompt lookup (vLLM's `ngram` method): draft the continuation of the longest recent n-gram
match of the sequence's tail in its own prompt and output.

An incremental index, not a scan: for each n in [lo, hi], a dict from every n-gram to where its
most recent earlier continuation starts. Appending a token registers one n-gram per n, so a
proposal costs O(hi - lo) dict lookups whatever the sequence's length (a scan of a 2,000-token
code file per step would cost more than the forward it tries to save, on the core's one thread).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, lo: int, hi: int) -> None:
        assert 1 <= lo <= hi
        self.lo, self.hi = lo, hi
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(hi - lo + 1)]
        self.num_indexed = 0  # continuations starting before this are registered

    def _extend(self, tokens: Sequence[int]) -> None:
        """Register, for every position i not yet seen, the n-grams that end just before it
        (tokens[i - n : i] is followed by tokens[i])."""
        for i in range(max(self.num_indexed, self.lo), len(tokens)):
            for n, index in enumerate(self.index, self.lo):
                if n > i:
                    break
                index[tuple(tokens[i - n : i])] = i
        self.num_indexed = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens following `tokens` (none: no n-gram of the tail recurs)."""
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            start = self.index[n - self.lo].get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []
