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

For batch-1 latency, a decode bucket up to `HEAD_MAX_BATCH` rows also runs the LM head and the
greedy argmax inside its graph (`head`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.worker.input_batch import StepInputs

# Token buckets of mixed-step graphs, captured largest first: 128 apart up to 1024 (online
# serving's typical step: a decode batch plus a prompt of a few hundred tokens), coarser above.
MIXED_TOKEN_SIZES = (3072, 2560, 2048, 1792, 1536, 1280, *range(1024, 0, -128), 64)
MIXED_MAX_TOKENS = MIXED_TOKEN_SIZES[0]
HEAD_MAX_BATCH = 8  # decode buckets up to this run the LM head and argmax in their graph

GraphOutputs = tuple[torch.Tensor, ...]  # hidden [n, H], then (head) logits [n, V], ids [n]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM-like buckets), largest first."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes), reverse=True)


class _GraphSet:
    """What both kinds share: pinned staging, capture into one pool, replay.

    Inputs travel in two host->device copies per step, from pinned staging buffers: int64
    [input_ids | positions | slot_mapping] and an int32 buffer each kind lays out itself (sequence
    metadata, then block tables). The static tensors the graphs read are views of the device side.
    Two host sets alternate, so a step's writes never touch a buffer whose copy may still be
    queued (the worker starts a step before it has waited for the one before).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        sizes: list[int],
        max_tokens: int,
        int32_len: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.sizes = sizes  # largest first
        self.max_blocks = max_blocks
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.dev64 = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(int32_len, dtype=torch.int32, device=device)
        self.host64 = [torch.zeros_like(self.dev64, device="cpu").pin_memory() for _ in range(2)]
        self.host32 = [torch.zeros_like(self.dev32, device="cpu").pin_memory() for _ in range(2)]
        self._flip = 0
        self.input_ids, self.positions, self.slot_mapping = self.dev64
        self.slot_mapping.fill_(-1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by bucket size
        self.outputs: dict[int, GraphOutputs] = {}
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def _graph_forward(self, size: int, *args: object) -> GraphOutputs:
        return (self.forward(*args),)

    def _metadata(
        self, num_tokens: int, num_seqs: int, max_query_len: int, query_start_loc_cpu: np.ndarray
    ) -> AttentionMetadata:
        """Metadata over the static buffers: device views and host upper bounds (the host arrays
        serve the torch reference only; the capturable Triton kernels never read them)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=np.full(num_seqs, self.max_model_len, dtype=np.int32),
            max_query_len=max_query_len,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _smallest_fit(self, n: int) -> int | None:
        """The smallest bucket that holds `n` (None: none does, run eagerly)."""
        fits = [s for s in self.sizes if s >= n]
        return min(fits) if fits else None

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into `pool` (shared with other graph sets)."""
        self.pool = pool
        for size in self.sizes:
            args = (self.input_ids[:size], self.positions[:size], self._meta(size))
            self._graph_forward(size, *args)  # warm-up: autotuning, lazy init out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._graph_forward(size, *args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _host_buffers(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """The next host set (int64, int32) as numpy, with the token columns written."""
        self._flip ^= 1
        a64, a32 = self.host64[self._flip].numpy(), self.host32[self._flip].numpy()
        n = len(inputs.input_ids)
        a64[0, :n], a64[1, :n], a64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        return a64, a32

    def _replay(
        self,
        size: int,
        num_tokens: int,
        int32_end: int,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> GraphOutputs:
        """Copy the staged host set (tokens up to the bucket, int32 up to `int32_end`), fill
        the tokens only on the device, replay bucket `size`'s graph; its outputs for the real tokens
        (static buffers: valid until the next replay of that graph)."""
        h64, h32 = self.host64[self._flip], self.host32[self._flip]
        self.dev64[:, :size].copy_(h64[:, :size], non_blocking=True)
        self.dev32[:int32_end].copy_(h32[:int32_end], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[size].replay()
        return tuple(out[:num_tokens] for out in self.outputs[size])


class DecodeGraphs(_GraphSet):
    """Decode-only steps, one graph per batch-size bucket; int32 = [seq_lens | block_tables].
    `head`: hidden [n, H] -> (logits [n, V] float32, argmax ids [n]), run inside the graphs of
    buckets up to HEAD_MAX_BATCH."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        head: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.head = head
        sizes = capture_sizes(max_batch)
        b = sizes[0]
        super().__init__(
            forward, sizes, b, b + b * max_blocks, max_blocks, max_model_len, block_size, device
        )
        self.seq_lens = self.dev32[:b]
        self.seq_lens.fill_(1)
        self.block_tables = self.dev32[b:].view(b, max_blocks)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)

    def _meta(self, size: int) -> AttentionMetadata:
        return self._metadata(size, size, 1, np.arange(size + 1, dtype=np.int32))

    def _graph_forward(self, size: int, *args: object) -> GraphOutputs:
        hidden = self.forward(*args)
        if self.head is None or size > HEAD_MAX_BATCH:
            return (hidden,)
        return (hidden, *self.head(hidden))

    def bucket(self, num_seqs: int) -> int | None:
        return self._smallest_fit(num_seqs)

    def run(
        self,
        inputs: StepInputs,
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GraphOutputs:
        """Copy a decode batch into the static buffers, replay; hidden states [n, H] (and with
        the head, logits [n, V] and argmax ids [n]). `fill`: (token indices, ids) of input
        tokens that are only on the device."""
        n, b, width = len(inputs.input_ids), self.sizes[0], inputs.block_tables.shape[1]
        a64, a32 = self._host_buffers(inputs)
        a64[2, n:size] = -1  # padding rows: no cache write, attend to one token of block 0
        a32[:n], a32[n:size] = inputs.seq_lens, 1
        tables = a32[b : b + size * self.max_blocks].reshape(size, self.max_blocks)
        tables[:n, :width] = inputs.block_tables
        tables[n:size, 0] = 0
        return self._replay(size, n, b + size * self.max_blocks, fill)


class MixedGraphs(_GraphSet):
    """Steps with prompt chunks, one graph per token bucket (see the module docstring); int32 =
    [query_start_loc (slots + 1) | seq_lens (slots) | block_tables (slots x max_blocks)]."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_seqs: int,
        max_tokens: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        # Buckets up to the first that holds a whole step (`max_tokens`), if one does.
        fits = [t for t in MIXED_TOKEN_SIZES if t >= max_tokens]
        cap = min(fits) if fits else MIXED_MAX_TOKENS
        sizes = [t for t in MIXED_TOKEN_SIZES if t <= cap]
        s = self.slots = max_seqs + 1  # real rows, empty rows, the padding row last
        int32_len = 2 * s + 1 + s * max_blocks
        super().__init__(
            forward, sizes, sizes[0], int32_len, max_blocks, max_model_len, block_size, device
        )
        self.query_start_loc = self.dev32[: s + 1]
        self.seq_lens = self.dev32[s + 1 : 2 * s + 1]
        self.block_tables = self.dev32[2 * s + 1 :].view(s, max_blocks)

    def _meta(self, size: int) -> AttentionMetadata:
        unknown = np.zeros(self.slots + 1, dtype=np.int32)  # set per replay, on the device only
        return self._metadata(size, self.slots, size, unknown)

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        pad_capacity = self.max_blocks * self.block_size
        return mixed_bucket(self.sizes, self.slots, pad_capacity, num_tokens, num_seqs)

    def run(
        self,
        inputs: StepInputs,
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Copy a mixed batch into the static buffers, replay; hidden states [T, H]."""
        a64, a32 = self._host_buffers(inputs)
        end = lay_out_mixed(a64, a32, inputs, size, self.slots, self.max_blocks)
        return self._replay(size, len(inputs.input_ids), end, fill)[0]


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
    tables = a32[2 * s + 1 :].reshape(s, max_blocks)
    tables[:n, : inputs.block_tables.shape[1]] = inputs.block_tables
    return 2 * s + 1 + n * max_blocks
