"""ngram drafts proposed by the sampling ranks right after they sample (vLLM's way for ngram).
Built for any proposer of core/spec_decode/ that drafts from token ids; only ngram uses it
(suffix stays in the core for now).

Prompt lookup needs only token ids, and the ranks that sample hold each row's tokens as soon as they
are sampled, while the core learns them only from a result. So with one pipeline stage the core
plans a speculating row without its drafts (`StepPlan.num_sampler_drafts`: at most `k`, and `1 + k`
slots from where the row would be if every draft in flight were accepted), and plans it again before
its result returns, as async scheduling does for a plain row; here, when the plan is applied, the
row's tokens include everything sampled before (the step before is kept first), the proposer drafts
the continuation of the tokens just accepted, and the row runs from where it really is: its last
token and its drafts (`1 + len(drafts)` tokens, maybe just one). Every sampling rank (the TP ranks
of the one stage) holds the same tokens, so they draft alike.

On a GPU the step before may still run when the plan is applied: keeping its ids waits for it,
and loses the overlap of the host's work with the device's that async scheduling brings. So the
runner keeps it only where a row of it has a draft in sight (the tokens known before its token
in flight already draft something: a copy is under way, as the core's `_in_sight` rule); else
such rows decode their token in flight plainly, copied in on the device (`in_flight`).

The proposer is the core's (core/spec_decode/ngram.py, suffix.py: incremental indexes), one per
row, fed the row's tokens as they grow; a row that leaves the batch (finished, aborted,
preempted) is forgotten, since a preempted row comes back with the core's tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

import numpy as np

from pagedserve.core.spec_decode.ngram import NgramProposer
from pagedserve.core.spec_decode.suffix import SuffixProposer
from pagedserve.ipc.messages import StepPlan
from pagedserve.worker.input_batch import InputBatch

Proposer = NgramProposer | SuffixProposer


class SamplerDrafts:
    def __init__(self, new_proposer: Callable[[], Proposer]) -> None:
        self.new_proposer = new_proposer  # one per row
        self.rows: dict[str, tuple[list[int], Proposer]] = {}  # req_id -> tokens, index

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.rows.pop(req_id, None)

    def propose(self, req_id: str, tokens: np.ndarray, k: int) -> list[int]:
        """Up to `k` drafts following the row's known `tokens` [n] (a prefix of them was seen
        before: known tokens never change)."""
        entry = self.rows.get(req_id)
        if entry is None:
            entry = self.rows[req_id] = ([], self.new_proposer())
        seq, proposer = entry
        seq.extend(tokens[len(seq) :].tolist())
        return proposer.propose(seq, k)

    def in_sight(self, plan: StepPlan, batch: InputBatch, in_flight: Container[str]) -> bool:
        """Whether a row of `plan` with a token in flight already drafts from its known tokens."""
        for req_id in plan.num_sampler_drafts:
            if req_id in in_flight:
                req = batch.requests[req_id]
                if self.propose(req_id, batch.token_ids[req.row, : batch.num_tokens[req.row]], 1):
                    return True
        return False

    def draft(
        self, plan: StepPlan, batch: InputBatch, in_flight: Container[str]
    ) -> tuple[list[int], dict[str, list[int]]]:
        """Write each speculating row's drafts into the batch (none for a row whose last token
        is `in_flight`: it runs that token alone); each row's tokens this step, the drafts."""
        counts, drafts = list(plan.num_scheduled_tokens), {}
        for i, req_id in enumerate(plan.scheduled_ids):
            k = plan.num_sampler_drafts.get(req_id)
            if k is not None:
                ahead = req_id in in_flight
                drafts[req_id] = batch.set_sampler_drafts(req_id, self.propose, k, ahead)
                counts[i] = 1 + len(drafts[req_id])
        return counts, drafts
