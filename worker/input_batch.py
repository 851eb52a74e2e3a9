"""The persistent batch: every running request's tokens and block table, kept between steps.

A StepPlan is a delta against this state, so a step with thousands of running requests carries a
token and maybe a block id per request rather than whole prompts. Token ids and block tables live in
preallocated numpy arrays (one row per request) so that preparing a step's inputs is a handful of
vectorized gathers, with no Python loop over tokens.

Tokens come from two sides. The sampling ranks append what they sample at once (`append_sampled`):
under async scheduling the next plan feeds that token in before the core has seen it. The core's
deltas carry the tokens it learned since its last plan (what ranks that do not sample need); they
are written at the position the core counts from, so on a sampling rank they rewrite the same ids.

Speculative decoding: a plan's draft tokens are written after a row's known tokens for that step
only (`num_drafts`); the row's sampled tokens (the accepted drafts and one more) overwrite them.
A draft model's drafts (`num_model_drafts`) are not known to the host: the runner writes them
into the step's input ids on the device. The sampling ranks' own ngram drafts
(`num_sampler_drafts`, worker/sampler_drafts.py) are written by `set_sampler_drafts`, which
also moves the row back to where it really is (the plan counted every draft in flight as
accepted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan


@dataclass
class RequestRow:
    req_id: str
    row: int
    sampling: SamplingParams
    eos_token_ids: list[int]
    prompt_len: int
    output_token_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # models with recurrent state (core/state_pool.py)


@dataclass
class StepInputs:
    """Host-side inputs of one step (numpy), in the order of the plan's scheduled requests."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: np.ndarray  # [S + D] int64, the last token of each request that samples
    # (its last 1 + k tokens where it verifies k drafts: D drafts in all)
    sample_rows: list[int]  # [S] indices into the plan's scheduled requests
    # Input tokens the host does not know yet (sampled by the step still in flight): their
    # indices in input_ids, and whose they are; the runner copies them in on the device.
    unknown: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    unknown_ids: list[str] = field(default_factory=list)
    # KV cache groups 1.. (models mixing windowed and global layers): their [T] slot mappings
    # and [B, max_blocks] block tables; the fields above are group 0's.
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)
    group_block_tables: list[np.ndarray] = field(default_factory=list)
    # Models with recurrent state: each row's state slot, [B] int64 (None: no such state).
    state_slots: np.ndarray | None = None
    # Tokens of the common prefix the step attends once for all rows
    # (kernels/attention/cascade.py; the runner sets it after `prepare`); 0: none.
    cascade_len: int = 0
    # [S] draft tokens each sampling row verifies; empty: no row verifies drafts
    num_drafts: list[int] = field(default_factory=list)


class InputBatch:
    def __init__(
        self, max_num_seqs: int, max_model_len: int, block_size: int, num_kv_groups: int = 1
    ) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # known: sampled here or told
        self.num_told = np.zeros(max_num_seqs, dtype=np.int64)  # tokens the core's deltas gave
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        # [G, max_num_seqs, max_blocks]: one table per KV cache group (config.kv_cache_groups)
        self.block_tables = np.zeros((num_kv_groups, max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_drafts = np.zeros(max_num_seqs, dtype=np.int64)  # this step's, after num_tokens
        self._draft_rows: list[int] = []
        self.requests: dict[str, RequestRow] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def apply(self, plan: StepPlan) -> None:
        for req_id in plan.finished_ids:
            req = self.requests.pop(req_id, None)
            if req is not None:
                self._free_rows.append(req.row)
        for new in plan.new_requests:
            self._add(new)
        for delta in plan.cached:
            self._update(delta)
        self.num_drafts[self._draft_rows] = 0
        self._draft_rows = []
        for req_id, drafts in plan.draft_token_ids.items():
            row = self.requests[req_id].row
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(drafts)] = drafts
            self.num_drafts[row] = len(drafts)
            self._draft_rows.append(row)
        for req_id, num in plan.num_model_drafts.items():  # the draft model fills them in
            row = self.requests[req_id].row
            self.num_drafts[row] = num
            self._draft_rows.append(row)

    def set_sampler_drafts(
        self, req_id: str, propose: Callable, k: int, token_in_flight: bool = False
    ) -> list[int]:
        """The sampling ranks draft for `req_id` (up to `k`: `propose(req_id, tokens, k)`) from
        all its tokens this rank holds: it runs from its last token, the only one not computed,
        then its drafts, which it returns. `token_in_flight`: its last token is still on the
        device (the step before is not kept), so it runs that one alone, copied in there."""
        req = self.requests[req_id]
        row, n = req.row, int(self.num_tokens[req.row])
        # the plan's count assumed every draft in flight accepted; this is where the row is
        self.num_computed[row] = n if token_in_flight else n - 1
        if token_in_flight:
            return []
        drafts = propose(req_id, self.token_ids[row, :n], k)
        if drafts:
            self.token_ids[row, n : n + len(drafts)] = drafts
            self.num_drafts[row] = len(drafts)
            self._draft_rows.append(row)
        return drafts

    def _add(self, new: NewRequest) -> None:
        assert new.req_id not in self.requests, f"{new.req_id} is already in the batch"
        row = self._free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = self.num_told[row] = len(tokens)
        self.num_computed[row] = new.num_computed_tokens
        ids = self._per_group(new.block_ids, new.group_block_ids)
        for table, group_ids in zip(self.block_tables, ids, strict=True):
            table[row, : len(group_ids)] = group_ids
        self.num_blocks[row] = len(new.block_ids)
        self.requests[new.req_id] = RequestRow(
            new.req_id,
            row,
            new.sampling,
            new.eos_token_ids,
            len(new.prompt_token_ids),
            list(new.output_token_ids),
            new.state_slot,
        )

    def _update(self, delta: CachedDelta) -> None:
        req = self.requests[delta.req_id]
        row = req.row
        if delta.new_token_ids:
            start, known = int(self.num_told[row]), int(self.num_tokens[row])
            end = start + len(delta.new_token_ids)
            self.token_ids[row, start:end] = delta.new_token_ids
            self.num_told[row] = end
            if end > known:  # tokens this rank did not sample itself
                req.output_token_ids.extend(delta.new_token_ids[known - start :])
                self.num_tokens[row] = end
        if delta.new_block_ids or delta.num_blocks_before is not None:
            b = delta.num_blocks_before
            b, n = int(self.num_blocks[row]) if b is None else b, len(delta.new_block_ids)
            ids = self._per_group(delta.new_block_ids, delta.new_group_block_ids)
            for table, group_ids in zip(self.block_tables, ids, strict=True):
                table[row, b : b + n] = group_ids
            self.num_blocks[row] = b + n
        self.num_computed[row] = delta.num_computed_tokens

    def _per_group(self, block_ids: list[int], group_block_ids: list[list[int]]) -> list[list[int]]:
        ids = [block_ids, *group_block_ids]
        assert len(ids) == len(self.block_tables), "one block list per KV cache group"
        return ids

    def append_sampled(self, members: list[RequestRow], token_ids: list[list[int]]) -> None:
        """Record a step's sampled tokens (one per row that sampled; several where it verified
        drafts). A row that has left the batch since (a later plan was applied first) is
        skipped: its tokens are of no use."""
        max_len = self.token_ids.shape[1]
        for req, ids in zip(members, token_ids, strict=True):
            if self.requests.get(req.req_id) is not req:
                continue
            n = int(self.num_tokens[req.row])
            end = min(n + len(ids), max_len)  # at max_model_len the core finishes it
            self.token_ids[req.row, n:end] = ids[: end - n]
            self.num_tokens[req.row] = end
            req.output_token_ids.extend(ids)

    def prepare(self, req_ids: list[str], num_scheduled: list[int]) -> StepInputs:
        rows = np.fromiter((self.requests[r].row for r in req_ids), np.int64, len(req_ids))
        n = np.asarray(num_scheduled, dtype=np.int64)  # [B]
        start = self.num_computed[rows]  # [B] tokens already in the cache
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(n, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(len(rows)), n)  # [T] which request each token is
        positions = np.arange(total) - np.repeat(query_start_loc[:-1] - start, n)  # [T]
        token_rows = rows[token_req]
        input_ids = self.token_ids[token_rows, positions]
        known = self.num_tokens + self.num_drafts  # [max_num_seqs]
        unknown = np.nonzero(positions >= known[token_rows])[0]
        block_idx, offsets = positions // self.block_size, positions % self.block_size
        slot_mappings = [
            table[token_rows, block_idx].astype(np.int64) * self.block_size + offsets
            for table in self.block_tables
        ]  # [G][T]
        seq_lens = start + n
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if len(rows) else 0
        samples = seq_lens >= self.num_tokens[rows]  # the prompt (or decode) is complete
        sample_rows = np.nonzero(samples)[0]
        self.num_computed[rows] = seq_lens
        ends = query_start_loc[1:][sample_rows]  # [S]
        num_drafts = self.num_drafts[rows][sample_rows] if self._draft_rows else None
        tables = [table[rows, :max_blocks] for table in self.block_tables]  # [G][B, max_blocks]
        state_slots = None
        if req_ids and self.requests[req_ids[0]].state_slot is not None:
            state_slots = np.fromiter(
                (self.requests[r].state_slot for r in req_ids), np.int64, len(req_ids)
            )
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mappings[0],
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=tables[0],
            logits_indices=ends - 1 if num_drafts is None else _last_tokens(ends, num_drafts + 1),
            sample_rows=sample_rows.tolist(),
            unknown=unknown,
            unknown_ids=[req_ids[i] for i in token_req[unknown]],
            group_slot_mappings=slot_mappings[1:],
            group_block_tables=tables[1:],
            state_slots=state_slots,
            num_drafts=[] if num_drafts is None else num_drafts.tolist(),
        )


def _last_tokens(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last `counts[i]` token indices before each `ends[i]`, concatenated."""
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(ends - counts, counts) + offsets
