"""ngram drafts proposed by the sampling ranks right after they sample (vLLM's way for ngram).

Prompt lookup needs only token ids, and the ranks that sample hold each row's tokens as soon as
they are sampled, while the core learns them only from a result. So with one pipeline stage the
core plans a speculating row without its drafts (`StepPlan.num_sampler_drafts`: at most `k`, and
`1 + k` slots from where the row would be if every draft in flight were accepted), and planned
again before its result returns, as async scheduling does for a plain row; here, when the plan is
applied, the row's tokens include everything sampled before (the step before is kept first), the
proposer drafts the continuation of the tokens just accepted, and the row runs from where it
really is: its last token and its drafts (`1 + len(drafts)` tokens, maybe just one). Every
sampling rank (the TP ranks of the one stage) holds the same tokens, so they draft alike.

The proposer is the core's (core/spec_decode/ngram.py: an incremental index), one per row, fed
the row's tokens as they grow; a row that leaves the batch (finished, aborted, preempted) is
forgotten, since a preempted row comes back with the core's tokens only.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pagedserve.core.spec_decode.ngram import NgramProposer


class SamplerDrafts:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.rows: dict[str, tuple[list[int], NgramProposer]] = {}  # req_id -> tokens, index

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.rows.pop(req_id, None)

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        """Up to `k` drafts following the row's known `tokens` [n] (a prefix of them was seen
        before: known tokens never change)."""
        entry = self.rows.get(req_id)
        if entry is None:
            entry = self.rows[req_id] = ([], NgramProposer(self.lo, self.hi))
        seq, proposer = entry
        seq.extend(tokens[len(seq) :].tolist())
        return proposer.propose(seq, k)
