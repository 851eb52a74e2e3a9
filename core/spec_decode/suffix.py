"""The `suffix` method: draft what followed the longest earlier occurrence of the sequence's tail,
found with a suffix automaton over the request's prompt and output.

A suffix automaton (the minimal automaton of all suffixes) grows by one token in amortized O(1)
and names, for the whole sequence, the longest suffix that also occurs earlier (the suffix link
of its last state) and where that earlier occurrence first ends (`first_end`). The match may be
as long as the sequence (no fixed n as in prompt lookup): a long match means a confident draft,
so the draft's length is at most `max_spec_factor` times the match's length (vLLM's rule), and
matches are cut at `max_depth` tokens. Earlier requests' outputs are not indexed.
"""

from __future__ import annotations

from collections.abc import Sequence


class SuffixProposer:
    def __init__(self, max_depth: int, max_spec_factor: float) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        # state i: its longest string's length, suffix link, transitions, first end position
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.first_end = [-1]
        self.last = 0
        self.num_indexed = 0

    def _append(self, token: int, pos: int) -> None:
        cur = len(self.length)
        self.length.append(self.length[self.last] + 1)
        self.link.append(0)
        self.next.append({})
        self.first_end.append(pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.length)
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.next.append(dict(self.next[q]))
                self.first_end.append(self.first_end[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for pos in range(self.num_indexed, len(tokens)):
            self._append(tokens[pos], pos)
        self.num_indexed = len(tokens)
        state = self.link[self.last]
        if state <= 0:  # no suffix of the sequence occurs earlier
            return []
        match = min(self.length[state], self.max_depth)
        num = min(k, int(self.max_spec_factor * match))
        start = self.first_end[state] + 1
        return list(tokens[start : start + num])
