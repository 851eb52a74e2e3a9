"""The draft model of `method: draft_model`: a smaller model with the target's vocabulary that
runs in every worker beside the target and proposes each speculating row's drafts.

Its KV cache mirrors the target's: one tensor per draft layer, indexed by the target's block ids
(the same block tables and slots), so the core allocates for both at once and a block costs the
target's bytes plus the draft's (the memory profile counts them, and the draft's weights are
loaded before it). It stays in step with the target by running over every token the target runs:

- forward 0: the step's inputs without the drafts (prompt chunks, plain decodes and each
  speculating row's last known token): writes their KV and gives each row's first draft logits;
- forward j = 1..k: draft j of each row that has that many (one token a row): writes its KV
  and, where the row has more drafts to make, gives the next draft's logits.

A rejected draft's KV is rewritten by a later step, as the target's is. Greedy rows draft the
argmax; the others sample from `q`, the draft's distribution after their temperature, min-p,
top-k and top-p (any `q` keeps the target's distribution, since verification knows it:
worker/spec_verify.py), a seeded row from its own (seed, position) noise, salted apart from the
target's draws. Every rank drafts alike (same logits, same generator state), as it samples.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedserve.config import EngineConfig
from pagedserve.worker.cuda_graphs import DECODE_MAX_BATCH
from pagedserve.worker.draft_graphs import DraftGraphs, DraftPlan
from pagedserve.worker.input_batch import StepInputs, _last_tokens
from pagedserve.worker.models import build_model
from pagedserve.worker.sampler import Sampler, SamplingRow, argmax_rows, filtered_probs, to_device
from pagedserve.worker.step_metadata import attention_metadata

DRAFT_SALT = 1  # seeded rows' noise for drafting (the target's own draws use salt 0)


@dataclasses.dataclass
class Drafted:
    """A step's drafts, in the order of the verified positions (row by row)."""

    fill: tuple[torch.Tensor, torch.Tensor]  # the drafts' input indices [D] and ids [D]
    token_ids: torch.Tensor  # [D] on the device
    probs: torch.Tensor | None  # [D, V] q of each draft (greedy rows: unused); None: all greedy

    def per_row(self, num_drafts: list[int]) -> list[list[int]]:
        """The drafts of each sampling row (waits for the device)."""
        flat = self.token_ids.tolist()
        ends = np.cumsum(num_drafts)
        return [flat[e - n : e] for e, n in zip(ends.tolist(), num_drafts, strict=True)]


def pick(x: torch.Tensor, rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Rows `rows` of `x` (all of them, in order: `x` itself, nothing to copy)."""
    if len(rows) == len(x):
        return x
    return x[to_device(rows, device)]


def merge_fills(
    a: tuple[torch.Tensor, torch.Tensor] | None, b: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two sets of (input indices, token ids) to copy into a step's inputs on the device."""
    if a is None or b is None:
        return a if b is None else b
    return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])


class DraftRunner:
    def __init__(
        self,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        sampler: Sampler,
        model: torch.nn.Module | None = None,  # built elsewhere (an EAGLE head: worker/eagle.py)
    ) -> None:
        self.mc = config.speculative.draft_model_config(config.model)
        self.dtype, self.device, self.sampler = dtype, device, sampler
        self.block_size = config.cache.block_size
        self.model = model if model is not None else build_model(self.mc, dtype, device)
        self.kv_caches: list[torch.Tensor] = []
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.graphs: DraftGraphs | None = None  # capture_graphs (none if DRAFT_CUDA_GRAPHS=0)

    def capture_graphs(self, max_blocks: int, pool=None) -> None:
        """The drafter's one-token forward in CUDA graphs of its own (worker/draft_graphs.py),
        over its allocated KV cache, into `pool` (the target's, where it has graphs)."""
        self.graphs = DraftGraphs(
            self._graph_forward, min(self.max_num_seqs, DECODE_MAX_BATCH), max_blocks,
            self.mc.max_model_len, self.block_size, self.device, self._graph_hidden(),
        )  # fmt: skip
        self.graphs.capture(pool)

    def _graph_forward(self, ids, positions, meta, hidden) -> torch.Tensor:
        return self.model(ids, positions, self.kv_caches, meta)  # [n, H]

    def _graph_hidden(self) -> tuple[int, torch.dtype] | None:
        """The hidden states each graphed forward reads beside its tokens (a head's)."""
        return None

    def _graph_plan(
        self, inputs: StepInputs, rows: np.ndarray, first_idx: np.ndarray, counts: np.ndarray
    ) -> DraftPlan | None:
        """This step's replays (worker/draft_graphs.py); None: draft eagerly."""
        return None if self.graphs is None else self.graphs.plan(inputs, rows, first_idx, counts)

    def after_target(
        self,
        req_ids: list[str],
        inputs: StepInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        hidden: torch.Tensor,
    ) -> None:
        """The target's hidden states of the step (an EAGLE head reads them; a draft model
        runs over the tokens themselves)."""

    def forget(self, finished_ids: list[str]) -> None:
        """Requests that left (an EAGLE head keeps their hidden states until then)."""

    def block_bytes(self) -> int:
        """The draft's KV bytes per block, all layers."""
        m = self.model
        return 2 * self.block_size * m.num_kv_heads_per_rank * m.head_dim * (
            self.mc.num_layers * self.dtype.itemsize
        )  # fmt: skip

    def init_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, 2, self.block_size, self.model.num_kv_heads_per_rank,
                 self.model.head_dim)  # fmt: skip
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.mc.num_layers)
        ]

    def before_profile(self, inputs: StepInputs) -> None:
        """What the drafter keeps from one step for the next, as of a step like `inputs`, held
        through the profiled step (a draft model keeps nothing but its KV cache)."""

    def profile(self, inputs: StepInputs, num_blocks: int) -> None:
        """The memory profile's worst step through the draft too (its activations and a logits
        row per sampling row), over a throwaway cache, so that the peak counts them."""
        self.init_cache(num_blocks)
        ids = to_device(inputs.input_ids, self.device)
        self._forward(inputs, ids, inputs.logits_indices)
        self.kv_caches = []

    def _forward(
        self, inputs: StepInputs, input_ids: torch.Tensor, logits_idx: np.ndarray
    ) -> torch.Tensor | None:  # [len(logits_idx), V] float32
        hidden = self.graphs.forward(inputs, input_ids) if self.graphs is not None else None
        if hidden is None:  # not decode-shaped (or no graphs): eager
            meta = attention_metadata(inputs, self.block_size, self.device)
            positions = to_device(inputs.positions, self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, H]
        if not len(logits_idx):
            return None
        return self.model.compute_logits(hidden[to_device(logits_idx, self.device)])

    def run(
        self,
        inputs: StepInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        rows: dict[int, SamplingRow],
        req_ids: list[str],
    ) -> Drafted | None:
        """Keep the draft's KV in step with this step's inputs and draft for the rows that
        verify (`rows`: the sampling row of each batch row that does); None: none does.
        `req_ids`: the batch rows' requests."""
        num_rows = len(inputs.seq_lens)
        k = np.zeros(num_rows, dtype=np.int64)  # [B] drafts per batch row
        if inputs.num_drafts:
            k[inputs.sample_rows] = inputs.num_drafts
        ends = inputs.query_start_loc[1:].astype(np.int64)  # [B]
        draft_idx = _last_tokens(ends, k)  # [D] the drafts' input indices, row by row
        first, ids0 = self._without_drafts(inputs, fill, k, draft_idx)
        spec = np.nonzero(k)[0]  # batch rows that verify drafts
        logits = self._forward(first, ids0, first.query_start_loc[1:][spec] - 1)  # [R, V]
        if not len(spec):
            return None
        spec_rows = [rows[b] for b in spec]
        out = torch.empty(len(draft_idx), dtype=torch.int64, device=self.device)  # [D]
        random = any(not r.params.greedy for r in spec_rows)
        probs = None
        if random:
            probs = torch.zeros(len(draft_idx), logits.shape[1], device=self.device)
        offsets = np.cumsum(k[spec]) - k[spec]  # [R] each row's first draft in `out`
        live = np.arange(len(spec))  # rows of `spec` still drafting
        first = ends[spec] - k[spec]  # [R] each row's first draft's input index
        plan = self._graph_plan(inputs, spec, first, k[spec])
        for j in range(1, int(k.max()) + 1):
            slots = to_device(offsets[live] + j - 1, self.device)
            ids, q = self._draw(logits, [spec_rows[i] for i in live], j - 1)
            out[slots] = ids
            if q is not None:
                probs[slots] = q
            more = k[spec[live]] > j  # rows with a further draft to make
            logits = self._next_logits(inputs, spec, first, live, more, j, ids, plan)
            live = live[more]
        fill_idx = to_device(draft_idx, self.device)
        return Drafted((fill_idx, out), out, probs)

    def _next_logits(
        self,
        inputs: StepInputs,
        spec: np.ndarray,
        first: np.ndarray,  # [R] each row's first draft's input index
        live: np.ndarray,
        more: np.ndarray,
        j: int,
        ids: torch.Tensor,
        plan: DraftPlan | None,
    ) -> torch.Tensor | None:
        """Forward j over draft j (`ids`) of rows `spec[live]`, which writes its KV; the logits
        of the rows with a further draft to make (`more`; None: none has)."""
        if plan is not None:  # every row of the plan replays; the live ones' outputs are read
            hidden = self.graphs.replay(plan, j, live, ids)  # [R, H]
            if not more.any():
                return None
            return self.model.compute_logits(pick(hidden, live[more], self.device))
        idx = first[live] + j - 1  # [L] draft j's input index
        return self._forward(self._one_token(inputs, spec[live], idx), ids, np.nonzero(more)[0])

    def _draw(
        self, logits: torch.Tensor, rows: list[SamplingRow], num_before: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's next draft from the draft's logits [L, V], and its distribution q (None
        for an all-greedy batch). `num_before`: the row's drafts before this one."""
        ids = argmax_rows(logits)  # [L]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random:
            return ids, None
        # the noise's position: the row's outputs and drafts so far (only the count matters)
        sub = [
            dataclasses.replace(rows[i], output_token_ids=range(len(rows[i].output_token_ids)
                                                                + num_before))
            for i in random
        ]  # fmt: skip
        index = to_device(random, self.device)
        q = torch.zeros_like(logits)  # [L, V]
        q[index] = filtered_probs(logits[index], sub)
        ids[index] = self.sampler.draw(q[index], sub, DRAFT_SALT)
        return ids, q

    def _without_drafts(
        self,
        inputs: StepInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        k: np.ndarray,
        draft_idx: np.ndarray,
    ) -> tuple[StepInputs, torch.Tensor]:
        """Forward 0's inputs: the step's without the drafts, and its input ids on the device
        (tokens the host does not know yet copied in, as the target's are)."""
        keep = np.ones(len(inputs.input_ids), dtype=bool)
        keep[draft_idx] = False
        qsl = np.zeros(len(k) + 1, dtype=np.int64)
        np.cumsum(np.diff(inputs.query_start_loc) - k, out=qsl[1:])
        sub = dataclasses.replace(
            inputs,
            input_ids=inputs.input_ids[keep],
            positions=inputs.positions[keep],
            slot_mapping=inputs.slot_mapping[keep],
            query_start_loc=qsl.astype(np.int32),
            seq_lens=(inputs.seq_lens - k).astype(np.int32),
            cascade_len=0,
        )
        input_ids = to_device(sub.input_ids, self.device)
        if fill is not None and len(inputs.unknown):
            new_index = np.cumsum(keep) - 1  # an input index -> its index without drafts
            input_ids[to_device(new_index[inputs.unknown], self.device)] = fill[1]
        return sub, input_ids

    @staticmethod
    def _one_token(inputs: StepInputs, rows: np.ndarray, idx: np.ndarray) -> StepInputs:
        """The inputs of one token for each of `rows` (batch rows), at input indices `idx`."""
        positions = inputs.positions[idx]
        return dataclasses.replace(
            inputs,
            input_ids=inputs.input_ids[idx],
            positions=positions,
            slot_mapping=inputs.slot_mapping[idx],
            query_start_loc=np.arange(len(idx) + 1, dtype=np.int32),
            seq_lens=(positions + 1).astype(np.int32),
            block_tables=inputs.block_tables[rows],
            unknown=np.zeros(0, dtype=np.int64),
            unknown_ids=[],
            cascade_len=0,
        )
