"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of an 8B model launches ~500 kernels; replaying a graph launches them in one call,
so batch-1 latency is set by memory bandwidth instead of Python. Every bucket reads its inputs from
the same static buffers (a batch is padded up to its bucket: padding tokens write to slot -1, which
the cache-write kernel skips, and attend to one token of block 0) and all buckets share one memory
pool, captured largest first. Attention metadata in a graph holds only device tensors and host
upper bounds (max_query_len 1, max_seq_len = max_model_len), so the kernels need no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.worker.input_batch import StepInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM-like buckets), largest first."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes), reverse=True)


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        b = self.sizes[0]
        self.input_ids = torch.zeros(b, **i64)
        self.positions = torch.zeros(b, **i64)
        self.slot_mapping = torch.full((b,), -1, **i64)
        self.query_start_loc = torch.arange(b + 1, **i32)
        self.seq_lens = torch.ones(b, **i32)
        self.block_tables = torch.zeros((b, max_blocks), **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int32),
            seq_lens_cpu=np.full(size, self.max_model_len, dtype=np.int32),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for size in self.sizes:
            meta = self._meta(size)
            args = (self.input_ids[:size], self.positions[:size], meta)
            self.forward(*args)  # warm-up: autotuning and lazy init stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.forward(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int) -> int | None:
        fits = [s for s in self.sizes if s >= num_seqs]
        return min(fits) if fits else None

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """Copy a decode batch into the static buffers, replay; hidden states [n, H]."""
        n = len(inputs.input_ids)
        self.input_ids[:n].copy_(torch.from_numpy(inputs.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(inputs.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(inputs.seq_lens), non_blocking=True)
        width = inputs.block_tables.shape[1]
        tables = torch.from_numpy(np.ascontiguousarray(inputs.block_tables))
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        if n < size:  # padding rows: no cache write, attend to one token of block 0
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(0)
        self.graphs[size].replay()
        return self.outputs[size][:n]
