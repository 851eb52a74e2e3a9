"""What decode and mixed-step CUDA graphs share (worker/cuda_graphs.py): static input buffers
fed from pinned host staging, capture into one memory pool, replay.

Every bucket of a set reads its inputs from the same static buffers, so a replay costs two
host->device copies and one graph launch; a subclass lays its int32 buffer out itself and builds
each bucket's attention metadata (`_meta`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.input_batch import StepInputs

# hidden [n, H]; then on a stage that is not the last its residual [n, H], or on the last stage
# with the head its logits [n, V] and argmax ids [n]
GraphOutputs = tuple[torch.Tensor, ...]
StageForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor | tuple[torch.Tensor, ...]
]
GraphKey = tuple[int, bool]  # (bucket size, cascade)


class GraphSet:
    """What both kinds share: pinned staging, capture into one pool, replay.

    Inputs travel in two host->device copies per step, from pinned staging buffers: int64
    [input_ids | positions | slot_mapping] and an int32 buffer each kind lays out itself (sequence
    metadata, then block tables). The static tensors the graphs read are views of the device side.
    Two host sets alternate, and a set is rewritten only once the copy that read it last has
    run (its event): the worker queues steps ahead of the device, and with pipeline stages a
    stage may have several steps queued (a pinned copy reads the host buffer when it runs, so
    overwriting it earlier fed step N the inputs of step N+2: --pp 4 on GPUs, 2026-11-26).
    """

    def __init__(
        self,
        forward: StageForward,
        sizes: list[int],
        max_tokens: int,
        int32_len: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        state_scratch: int | None = None,
        num_groups: int = 1,
    ) -> None:
        self.forward = forward
        self.sizes = sizes  # largest first
        self.keys: list[GraphKey] = [(s, False) for s in sizes]  # what `capture` captures
        self.max_blocks = max_blocks
        self.max_model_len = max_model_len
        self.block_size = block_size
        rows64 = 3 if state_scratch is None else 4  # + the rows' state slots
        self.groups_at = rows64  # then KV cache groups 1..'s slot mappings
        rows64 += num_groups - 1
        self.dev64 = torch.zeros((rows64, max_tokens), dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(int32_len, dtype=torch.int32, device=device)
        pin = dict(device="cpu", pin_memory=device.type == "cuda")  # (CPU: layout tests)
        self.host64 = [torch.zeros_like(self.dev64, **pin) for _ in range(2)]
        self.host32 = [torch.zeros_like(self.dev32, **pin) for _ in range(2)]
        self._flip = 0
        # each host set's last copy (an event not yet recorded is complete)
        self._copied = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else None
        self.input_ids, self.positions, self.slot_mapping = self.dev64[:3]
        self.slot_mapping.fill_(-1)
        self.state_scratch = state_scratch
        self.state_slots = None if state_scratch is None else self.dev64[3].fill_(state_scratch)
        self.group_slots = self.dev64[self.groups_at :].fill_(-1)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, GraphOutputs] = {}
        # Each graph's metadata, kept: what layers derive from it in the warm-up before capture
        # (its `scratch`, e.g. kernels/gated_delta.py's decode layout) is read by the replays.
        self.metas: dict[GraphKey, AttentionMetadata] = {}
        self.pool = None

    def _set_tables(self, tables_at: int, rows: int, num_groups: int) -> None:
        """The block tables, one [rows, max_blocks] per KV cache group from `tables_at` in the
        int32 buffer (worker/graph_kv_groups.py)."""
        self.tables_at, self.table_stride = tables_at, rows * self.max_blocks
        end = tables_at + num_groups * self.table_stride
        tables = self.dev32[tables_at:end].view(num_groups, rows, self.max_blocks)
        self.block_tables, self.group_tables = tables[0], tables[1:]

    def _meta(self, key: GraphKey) -> AttentionMetadata:
        raise NotImplementedError

    def _graph_forward(self, key: GraphKey, *args: object) -> GraphOutputs:
        out = self.forward(*args)
        return out if isinstance(out, tuple) else (out,)

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
        """Capture every bucket, largest first (a cascade variant before its plain one), into
        `pool` (shared with other graph sets)."""
        self.pool = pool
        for key in sorted(self.keys, reverse=True):
            size = key[0]
            self.metas[key] = meta = self._meta(key)
            args = (self.input_ids[:size], self.positions[:size], meta)
            self._graph_forward(key, *args)  # warm-up: autotuning, lazy init out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._graph_forward(key, *args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def _host_buffers(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """The next host set (int64, int32) as numpy, with the token columns written."""
        self._flip ^= 1
        if self._copied is not None:
            self._copied[self._flip].synchronize()  # its last copy has run (returns at once if so)
        a64, a32 = self.host64[self._flip].numpy(), self.host32[self._flip].numpy()
        n = len(inputs.input_ids)
        a64[0, :n], a64[1, :n], a64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        if self.state_slots is not None:  # decode: one token per row
            a64[3, :n] = inputs.state_slots
        return a64, a32

    def _upload(self, size: int, int32_end: int, more32: tuple[tuple[int, int], ...]) -> None:
        """Copy the staged host set: tokens up to `size`, int32 up to `int32_end` and the
        ranges `more32` (other KV cache groups' tables)."""
        h64, h32 = self.host64[self._flip], self.host32[self._flip]
        self.dev64[:, :size].copy_(h64[:, :size], non_blocking=True)
        self.dev32[:int32_end].copy_(h32[:int32_end], non_blocking=True)
        for start, end in more32:
            self.dev32[start:end].copy_(h32[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied[self._flip].record()

    def _replay(
        self,
        key: GraphKey,
        num_tokens: int,
        int32_end: int,
        more32: tuple[tuple[int, int], ...] = (),
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GraphOutputs:
        """Copy the staged host set (tokens up to the bucket, int32 up to `int32_end`), fill
        the tokens only on the device, replay graph `key`; its outputs for the real tokens
        (static buffers: valid until the next replay of that graph)."""
        self._upload(key[0], int32_end, more32)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[key].replay()
        return tuple(out[:num_tokens] for out in self.outputs[key])
