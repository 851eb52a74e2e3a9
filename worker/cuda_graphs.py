"""CUDA graphs: one captured forward per bucket, for decode-only steps and for small mixed steps.

A decode step of an 8B model launches ~500 kernels; replaying a graph launches them in one call,
so batch-1 latency is set by memory bandwidth instead of Python. Every bucket reads its inputs from
the same static buffers (a batch is padded up to its bucket: padding tokens write to slot -1, which
the cache-write kernel skips, and attend to one token of block 0) and all buckets share one memory
pool, captured largest first. Attention metadata in a graph holds only device tensors and host
upper bounds (max_query_len 1, max_seq_len = max_model_len), so the kernels need no host sync.

`MixedGraphs` does the same for steps that carry prompt chunks, bucketed by token count up to
`MIXED_MAX_TOKENS` (bigger steps run eagerly: their GPU time dwarfs their launches). Such a step
(a decode batch plus a new prompt, the common step of online serving) queues ~200 Triton and ~130
cuBLAS launches eagerly, which takes the host longer (~28 ms for 48 decodes and a 512-token
prompt on an H100 host) than the GPU takes to run them (~13 ms); replayed, 1.3 ms. Its graphs
have `max_seqs + 1` sequence slots: the real rows, then empty rows, then one row that owns the
padding tokens (they write nowhere and attend among themselves over block 0).

Every pipeline stage captures its own layers. A stage after the first reads the hidden states and
residual it receives from static buffers the runner owns (the forward it passes in slices them),
and a stage before the last returns both ([n, H] each), which the runner sends on from the graph's
outputs (parallel/groups.py: NCCL's stream, no host sync).

For batch-1 latency, a decode bucket up to `HEAD_MAX_BATCH` rows also runs the LM head and the
greedy argmax inside its graph (`head`).

Models with recurrent state (linear attention) replay decode graphs only: each row's state slot
is a fourth int64 input row, padding rows point at a scratch slot past the core's (`state_scratch`;
the model allocates it), and a step with a row that starts from zeros (a one-token prompt) runs
eagerly. Their prompt chunks run eagerly too (no mixed graphs: the chunked kernels' grids follow
the step's rows).

Cascade attention (kernels/attention/cascade.py): a decode step whose rows share a prefix of at
least CASCADE_MIN_TOKENS replays a second graph of its bucket, captured with the cascade on; the
step's prefix length travels in the int32 buffer, so one capture serves every prefix. Those variants
exist only for buckets of at least CASCADE_MIN_ROWS rows that are multiples of CASCADE_BUCKET_STEP
(and the largest bucket): a cascade step pads up to one of them (a decode step's GEMMs cost about
the same for a few more rows), which bounds the extra captures at start-up (4 for 256 rows). Smaller
batches, and steps without a shared prefix, replay the graphs of before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.config import EngineConfig
from pagedserve.kernels.attention.cascade import CASCADE_MIN_ROWS
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.graph_kv_groups import stage_groups, with_groups
from pagedserve.worker.graph_set import GraphKey, GraphOutputs, GraphSet, StageForward
from pagedserve.worker.input_batch import StepInputs

# Token buckets of mixed-step graphs, captured largest first: 128 apart up to 1024 (online
# serving's typical step: a decode batch plus a prompt of a few hundred tokens), coarser above.
MIXED_TOKEN_SIZES = (3072, 2560, 2048, 1792, 1536, 1280, *range(1024, 0, -128), 64)
MIXED_MAX_TOKENS = MIXED_TOKEN_SIZES[0]
DECODE_MAX_BATCH = 512  # the largest decode bucket
HEAD_MAX_BATCH = 8  # decode buckets up to this run the LM head and argmax in their graph
CASCADE_BUCKET_STEP = 64  # decode buckets with a cascade variant: multiples of this
CASCADE_SLOT = 16  # int32 slots for the prefix length (one used; keeps the tables 16-aligned)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM-like buckets), largest first."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes), reverse=True)


class DecodeGraphs(GraphSet):
    """Decode-only steps, one graph per batch-size bucket (and `cascade`: a cascade one per
    cascade bucket); int32 = [seq_lens | prefix length (CASCADE_SLOT) | block_tables per KV
    cache group (worker/graph_kv_groups.py)]. `head`:
    hidden [n, H] -> (logits [n, V] float32, argmax ids [n]), run inside the graphs of buckets up
    to HEAD_MAX_BATCH."""

    def __init__(
        self,
        forward: StageForward,
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        head: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        cascade: bool = False,
        state_scratch: int | None = None,
        num_groups: int = 1,
    ) -> None:
        self.head = head
        sizes = capture_sizes(max_batch)
        b = sizes[0]
        t = b + CASCADE_SLOT
        super().__init__(
            forward, sizes, b, t + num_groups * b * max_blocks, max_blocks, max_model_len,
            block_size, device, state_scratch, num_groups,
        )  # fmt: skip
        self.seq_lens = self.dev32[:b]
        self.seq_lens.fill_(1)
        self.cascade_len = self.dev32[b : b + 1]
        self._set_tables(t, b, num_groups)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.cascade_sizes = cascade_sizes(sizes) if cascade else []
        self.keys += [(s, True) for s in self.cascade_sizes]

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        size, cascade = key
        meta = self._metadata(size, size, 1, np.arange(size + 1, dtype=np.int32))
        if self.state_slots is not None:  # on the device only (kernels/gated_delta.py decode)
            meta.state_slots = self.state_slots[:size]
        with_groups(self, meta, size, size)  # (before the cascade: group 0's prefix only)
        if cascade:  # an upper bound on the host; each replay writes the step's value
            meta.cascade_len, meta.cascade_len_dev = self.max_model_len, self.cascade_len
        return meta

    def _graph_forward(self, key: GraphKey, *args: object) -> GraphOutputs:
        outputs = super()._graph_forward(key, *args)
        if self.head is None or key[0] > HEAD_MAX_BATCH:
            return outputs
        return (outputs[0], *self.head(outputs[0]))

    def bucket(self, num_seqs: int, cascade: bool = False) -> GraphKey | None:
        """The graph for a decode step of `num_seqs` rows: a cascade one when the step has a
        common prefix and a cascade bucket holds it, else the plain bucket (None: eager)."""
        fits = [s for s in self.cascade_sizes if s >= num_seqs] if cascade else []
        if fits:
            return (min(fits), True)
        size = self._smallest_fit(num_seqs)
        return None if size is None else (size, False)

    def run(
        self,
        inputs: StepInputs,
        key: GraphKey,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GraphOutputs:
        """Copy a decode batch into the static buffers, replay; hidden states [n, H] (and with
        the head, logits [n, V] and argmax ids [n]). `fill`: (token indices, ids) of input
        tokens that are only on the device. A cascade graph's padding rows attend the prefix
        too (their output is dropped)."""
        return self._replay(key, len(inputs.input_ids), *self.stage(inputs, key), fill=fill)

    def stage(self, inputs: StepInputs, key: GraphKey) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Lay a decode batch out in the next host set; the int32 extent `_upload` copies."""
        (size, cascade), t = key, self.tables_at
        n, b = len(inputs.input_ids), self.sizes[0]
        a64, a32 = self._host_buffers(inputs)
        a64[2, n:size] = -1  # padding rows: no cache write, attend to one token of block 0
        if self.state_slots is not None:
            a64[3, n:size] = self.state_scratch  # and step in the scratch state slot
        a32[:n], a32[n:size] = inputs.seq_lens, 1
        a32[b] = inputs.cascade_len if cascade else 0
        tables = a32[t : t + size * self.max_blocks].reshape(size, self.max_blocks)
        tables[:n, : inputs.block_tables.shape[1]] = inputs.block_tables
        tables[n:size, 0] = 0
        more32 = stage_groups(self, a64, a32, inputs, size, size)
        return t + size * self.max_blocks, more32


class MixedGraphs(GraphSet):
    """Steps with prompt chunks, one graph per token bucket (see the module docstring); int32 =
    [query_start_loc (slots + 1) | seq_lens (slots) | block_tables (slots x max_blocks) per KV
    cache group (worker/graph_kv_groups.py)]."""

    def __init__(
        self,
        forward: StageForward,
        max_seqs: int,
        max_tokens: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        # Buckets up to the first that holds a whole step (`max_tokens`), if one does.
        fits = [t for t in MIXED_TOKEN_SIZES if t >= max_tokens]
        cap = min(fits) if fits else MIXED_MAX_TOKENS
        sizes = [t for t in MIXED_TOKEN_SIZES if t <= cap]
        s = self.slots = max_seqs + 1  # real rows, empty rows, the padding row last
        int32_len = 2 * s + 1 + num_groups * s * max_blocks
        super().__init__(
            forward, sizes, sizes[0], int32_len, max_blocks, max_model_len, block_size, device,
            num_groups=num_groups,
        )  # fmt: skip
        self.query_start_loc = self.dev32[: s + 1]
        self.seq_lens = self.dev32[s + 1 : 2 * s + 1]
        self._set_tables(2 * s + 1, s, num_groups)

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        unknown = np.zeros(self.slots + 1, dtype=np.int32)  # set per replay, on the device only
        meta = self._metadata(key[0], self.slots, key[0], unknown)
        return with_groups(self, meta, key[0], self.slots)

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        pad_capacity = self.max_blocks * self.block_size
        return mixed_bucket(self.sizes, self.slots, pad_capacity, num_tokens, num_seqs)

    def run(
        self,
        inputs: StepInputs,
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GraphOutputs:
        """Copy a mixed batch into the static buffers, replay; hidden states [T, H] (and on a
        stage before the last, the residual [T, H])."""
        staged = self.stage(inputs, size)
        return self._replay((size, False), len(inputs.input_ids), *staged, fill=fill)

    def stage(self, inputs: StepInputs, size: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Lay a mixed batch out in the next host set; the int32 extent `_upload` copies."""
        a64, a32 = self._host_buffers(inputs)
        end = lay_out_mixed(a64, a32, inputs, size, self.slots, self.max_blocks)
        return end, stage_groups(self, a64, a32, inputs, len(inputs.seq_lens), size)


def max_graph_tokens(config: EngineConfig) -> int:
    """The most tokens any graph of `capture_graphs` runs (the size of a later pipeline stage's
    static buffers for the hidden states it receives)."""
    sched = config.scheduler
    max_tokens = min(sched.max_num_batched_tokens, config.max_model_len)
    fits = [t for t in MIXED_TOKEN_SIZES if t >= max_tokens]
    return max(min(fits) if fits else MIXED_MAX_TOKENS, min(sched.max_num_seqs, DECODE_MAX_BATCH))


def capture_graphs(
    forward: StageForward,
    config: EngineConfig,
    max_blocks: int,
    device: torch.device,
    head: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
    cascade: bool,
    state_scratch: int | None = None,
    mixed: bool | int = True,
    num_groups: int = 1,
) -> tuple[DecodeGraphs, MixedGraphs | None]:
    """Both kinds, captured for the engine's limits: the mixed-step graphs first (the largest
    activations first: one pool for all), then the decode graphs into the same pool. A model
    with recurrent state (`state_scratch`: its scratch slot) or whose prompt attention reads
    host lengths (`mixed` False) gets decode graphs only; `mixed` a number: mixed graphs up to
    that many tokens (MLA: its device-layout path, kernels/mla.py). `num_groups`: the model's
    KV cache groups (each one's block table and slot mapping a graph input)."""
    shape = dict(
        max_blocks=max_blocks,
        max_model_len=config.max_model_len,
        block_size=config.cache.block_size,
        device=device,
    )
    sched = config.scheduler
    max_tokens = min(sched.max_num_batched_tokens, config.max_model_len)
    if not isinstance(mixed, bool):  # a token cap: no bucket past it
        max_tokens = min(max_tokens, max(t for t in MIXED_TOKEN_SIZES if t <= int(mixed)))
    mixed_graphs = None
    if state_scratch is None and mixed:
        mixed_graphs = MixedGraphs(
            forward, max_seqs=sched.max_num_seqs, max_tokens=max_tokens, num_groups=num_groups,
            **shape,
        )  # fmt: skip
        mixed_graphs.capture()
    max_batch = min(sched.max_num_seqs, DECODE_MAX_BATCH)
    decode = DecodeGraphs(
        forward, max_batch=max_batch, head=head, cascade=cascade, state_scratch=state_scratch,
        num_groups=num_groups, **shape,
    )  # fmt: skip
    decode.capture(pool=mixed_graphs.pool if mixed_graphs is not None else None)
    return decode, mixed_graphs


def cascade_sizes(sizes: list[int]) -> list[int]:
    """Decode buckets that get a cascade variant: multiples of CASCADE_BUCKET_STEP from
    CASCADE_MIN_ROWS rows on, and the largest (so every batch the cascade applies to has one)."""
    picked = [s for s in sizes if s >= CASCADE_MIN_ROWS and s % CASCADE_BUCKET_STEP == 0]
    if sizes and sizes[0] >= CASCADE_MIN_ROWS and sizes[0] not in picked:
        picked.append(sizes[0])
    return sorted(picked, reverse=True)


def mixed_bucket(
    sizes: list[int], slots: int, pad_capacity: int, num_tokens: int, num_seqs: int
) -> int | None:
    """The smallest token bucket for a mixed step whose padding fits the padding row's block
    table (`pad_capacity` = max_blocks x block_size tokens: with a small max_model_len a bigger
    gap would read past the table); None: run eagerly."""
    if num_seqs >= slots:
        return None
    fits = [s for s in sizes if num_tokens <= s <= num_tokens + pad_capacity]
    return min(fits) if fits else None


def lay_out_mixed(
    a64: np.ndarray, a32: np.ndarray, inputs: StepInputs, size: int, slots: int, max_blocks: int
) -> int:
    """Write a mixed step's padding and sequence metadata into the host staging arrays (int64
    [3, >= size], int32 as MixedGraphs lays it out); the int32 length to copy. Real rows first,
    then empty rows, then the padding row: `size - T` tokens that write nowhere and attend among
    themselves over its table, which stays zeros (block 0)."""
    t, n, s = len(inputs.input_ids), len(inputs.seq_lens), slots
    a64[0, t:size] = a64[1, t:size] = 0
    a64[2, t:size] = -1  # padding tokens write nowhere
    qsl, seq_lens = a32[: s + 1], a32[s + 1 : 2 * s + 1]
    qsl[: n + 1], qsl[n + 1 : s], qsl[s] = inputs.query_start_loc, t, size
    seq_lens[:n], seq_lens[n : s - 1], seq_lens[s - 1] = inputs.seq_lens, 0, size - t
    tables = a32[2 * s + 1 : 2 * s + 1 + s * max_blocks].reshape(s, max_blocks)  # group 0's
    tables[:n, : inputs.block_tables.shape[1]] = inputs.block_tables
    return 2 * s + 1 + n * max_blocks
