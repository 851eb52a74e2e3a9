"""CUDA graphs of the drafter's own (on by default; `PAGEDSERVE_DRAFT_CUDA_GRAPHS=0`: none): the
draft model's or EAGLE head's one-token forward, captured per batch-size bucket and replayed once
per draft.

Measured on an H100 80GB (2026-11-27; `STEPS="draft-graphs draft-smoke draft-graphs-smoke" bash
tests/gpu/spec_decode_run.sh`): their GPU tests pass (tests/test_spec_draft_graphs_gpu.py, 13);
per draft token (tests/gpu/draft_graphs_bench.py, the drafter alone, k = 4), a Llama-1B-shaped
draft of the 8B shape 21.70 -> 1.83 ms at batch 1 and 12.80 -> 2.14 at batch 32, a one-layer
EAGLE head 2.25 -> 0.90 and 2.39 -> 1.10; end to end (a one-layer draft of the 8B shape, k = 3,
batch 1, nothing accepted with random weights) 8.50 / 8.67 -> 7.18 / 7.16 ms a token, two runs
of each in one lease (speculation off: 5.84).

Drafting k tokens is k forwards of one token a speculating row; eager, each launches every
kernel of the draft (hundreds), which on a GPU costs more than the small draft's weight reads.
As vLLM does, the one-token forward is captured once per bucket (the target's decode buckets,
`cuda_graphs.capture_sizes`, up to max_num_seqs) by a `DecodeGraphs` of the draft (its static
buffers, staging, padding and pool), and a step replays it for every draft:

- a decode-shaped forward (a token a row: the draft model's forward 0 of a plain decode step,
  an EAGLE head's pairs where each row has one) replays the same graphs (`forward`);
- replay 1 of the drafts stages the rows' block tables and first positions, slots and lengths
  as a decode step does (`DecodeGraphs.run`), with the first drafts copied in on the device;
- replays 2.. take their positions, slots and lengths from a plan uploaded once per step
  (`replay_plan`: all are known on the host, only the tokens are not) by two device copies,
  and their tokens from the draws of the replay before, on the device: no host sync between
  the k drafts (random rows draw on the device too);
- an EAGLE head also reads a hidden state per row (`hidden_in`, a static buffer the forward
  reads): the head's output of the replay before.

Every row of the bucket replays every draft: a row with fewer drafts writes nowhere past them
(slot -1, its position held at its last one, so rotary tables and block tables stay in range)
and its outputs are dropped, like the padding rows'. A step whose speculating rows outnumber the
largest bucket drafts eagerly, as do forwards of several tokens a row (the draft's prompt
chunks, an EAGLE head's pairs after accepted drafts): their shape, not their launches, sets
their cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.graph_set import GraphKey
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.sampler import to_device

# (input ids [n], positions [n], metadata, the hidden states a head reads [n, H] or None)
DraftForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], torch.Tensor
]


@dataclasses.dataclass
class DraftPlan:
    """One step's replays: the bucket, the first replay's inputs (host) and the later ones'
    positions and slots [J - 1, 2, size] and lengths [J - 1, size] on the device."""

    key: GraphKey
    num_rows: int
    first: StepInputs
    later64: torch.Tensor | None
    later32: torch.Tensor | None


def replay_plan(
    inputs: StepInputs, first_idx: np.ndarray, counts: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions, slots [J, size] int64 and lengths [J, size] int32 of J = max(counts) replays
    for rows whose replay j reads input index `first_idx[r] + j - 1` while j <= counts[r];
    past it a row holds its last position and writes nowhere; padding rows (past len(counts))
    sit at position 0, write nowhere and attend one token."""
    num_replays, num_rows = int(counts.max()), len(counts)
    j = np.arange(num_replays)[:, None]  # [J, 1]
    last = np.maximum(counts - 1, 0)  # [R] the last replay (from 0) with a token of its own
    idx = first_idx[None, :] + np.minimum(j, last[None, :])  # [J, R]
    positions = np.zeros((num_replays, size), dtype=np.int64)
    slots = np.full((num_replays, size), -1, dtype=np.int64)
    positions[:, :num_rows] = inputs.positions[idx]
    slots[:, :num_rows] = np.where(j < counts[None, :], inputs.slot_mapping[idx], -1)
    seq_lens = np.ones((num_replays, size), dtype=np.int32)
    seq_lens[:, :num_rows] = positions[:, :num_rows] + 1
    return positions, slots, seq_lens


class DraftGraphs:
    """The drafter's one-token forward in decode graphs; `hidden`: (H, dtype) of the hidden
    states an EAGLE head reads beside its tokens (None: a draft model reads none)."""

    def __init__(
        self,
        forward: DraftForward,
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        hidden: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.device = device
        self.decode = DecodeGraphs(
            self._forward, max_batch, max_blocks, max_model_len, block_size, device
        )
        size = self.decode.sizes[0]
        self.hidden_in = None  # [size, H] static: what each replay's rows read
        if hidden is not None:
            self.hidden_in = torch.zeros(size, hidden[0], dtype=hidden[1], device=device)
        self.draft_forward = forward

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata):
        hidden = None if self.hidden_in is None else self.hidden_in[: len(ids)]
        return self.draft_forward(ids, pos, meta, hidden)

    def capture(self, pool=None) -> None:
        self.decode.capture(pool=pool)

    def forward(
        self, inputs: StepInputs, ids: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A decode-shaped forward (a token a row: forward 0 of a plain decode step, an EAGLE
        head's one pair a row) replayed in its bucket's graph, over tokens `ids` [n] (and a
        head's `hidden` [n, H]): hidden states [n, H], a static buffer; None: not decode-shaped
        or no bucket holds it (run it eagerly)."""
        n = len(inputs.seq_lens)
        if len(inputs.input_ids) != n:
            return None
        if hidden is not None and hidden.shape[-1] != self.hidden_in.shape[-1]:
            return None  # an EAGLE-3 head's pairs read the target's three states (3H): eager
        key = self.decode.bucket(n)
        if key is None:
            return None
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden)
        return self.decode.run(inputs, key, (slice(0, n), ids))[0]

    def plan(
        self, inputs: StepInputs, rows: np.ndarray, first_idx: np.ndarray, counts: np.ndarray
    ) -> DraftPlan | None:
        """The replays of batch rows `rows` (see `replay_plan`); None: none to run, or more
        rows than the largest bucket (draft eagerly)."""
        if not len(rows) or int(counts.max()) == 0:
            return None
        key = self.decode.bucket(len(rows))
        if key is None:
            return None
        positions, slots, seq_lens = replay_plan(inputs, first_idx, counts, key[0])
        n = len(rows)
        first = dataclasses.replace(
            inputs,
            input_ids=np.zeros(n, dtype=np.int64),  # the drafts: on the device only
            positions=positions[0, :n],
            slot_mapping=slots[0, :n],
            query_start_loc=np.arange(n + 1, dtype=np.int32),
            seq_lens=seq_lens[0, :n],
            block_tables=inputs.block_tables[rows],
            unknown=np.zeros(0, dtype=np.int64),
            unknown_ids=[],
            group_slot_mappings=[],  # (a drafter runs with one KV cache group)
            group_block_tables=[],
            cascade_len=0,
        )
        later64 = later32 = None
        if len(positions) > 1:
            later64 = to_device(np.stack([positions[1:], slots[1:]], axis=1), self.device)
            later32 = to_device(seq_lens[1:], self.device)
        return DraftPlan(key, n, first, later64, later32)

    def replay(
        self,
        plan: DraftPlan,
        j: int,
        live: np.ndarray,
        ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay j (from 1) of `plan` over tokens `ids` [L] of rows `live` (the others keep
        their last token) and, for a head, `hidden` [R, H] of every row; the output [R, H]
        (a static buffer: valid until the next replay)."""
        n, size = plan.num_rows, plan.key[0]
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden[:n])
        where = self._rows(live, n)
        if j == 1:
            return self.decode.run(plan.first, plan.key, (where, ids))[0]
        self.decode.dev64[1:3, :size].copy_(plan.later64[j - 2])  # positions, slots
        self.decode.seq_lens[:size].copy_(plan.later32[j - 2])
        self.decode.input_ids[where] = ids
        self.decode.graphs[plan.key].replay()
        return self.decode.outputs[plan.key][0][:n]

    def _rows(self, live: np.ndarray, n: int) -> torch.Tensor | slice:
        """The live rows' indices on the device (all rows: a slice, nothing to copy)."""
        if len(live) == n:
            return slice(0, n)
        return to_device(live, self.device)
