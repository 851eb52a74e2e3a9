"""KV cache groups 1.. inside CUDA graphs (worker/cuda_graphs.py), for models whose layers attend
over several block tables (gpt-oss and Gemma: sliding-window and full layers;
config.kv_cache_groups): each group's block table and slot mapping are static graph inputs.

A graph set lays them out after its own: int64 rows `groups_at..` hold the groups' slot mappings
(tokens past the step's write nowhere: -1), int32 holds group g's table `table_stride` entries
after group 0's, with the same rows. Each graph's metadata gets `group_metas` over those views
(the rows and lengths of group 0; the cascade's shared prefix stays group 0's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.input_batch import StepInputs


def with_groups(
    graphs: Any, meta: AttentionMetadata, num_tokens: int, num_rows: int
) -> AttentionMetadata:
    """`meta` with the other groups' layouts over `graphs`' static views (`group_slots`,
    `group_tables`; none: unchanged)."""
    if len(graphs.group_tables):
        meta.group_metas = [
            dataclasses.replace(
                meta,
                slot_mapping=slots[:num_tokens],
                block_tables=table[:num_rows],
                scratch={},
                cascade_len=0,
                cascade_len_dev=None,
            )  # fmt: skip
            for slots, table in zip(graphs.group_slots, graphs.group_tables, strict=True)
        ]
    return meta


def stage_groups(
    graphs: Any, a64: np.ndarray, a32: np.ndarray, inputs: StepInputs, rows: int, size: int
) -> tuple[tuple[int, int], ...]:
    """Write the other groups' slot mappings into the host sets `a64`, `a32` (padding up to
    `size` tokens) and the first `rows` rows of their tables (rows past the step's attend block
    0); the int32 ranges to copy."""
    num_tokens, ranges = len(inputs.input_ids), []
    stride, max_blocks = graphs.table_stride, graphs.max_blocks
    pairs = zip(inputs.group_slot_mappings, inputs.group_block_tables, strict=True)
    for g, (slots, table) in enumerate(pairs, start=1):
        a64[graphs.groups_at + g - 1, :num_tokens] = slots
        a64[graphs.groups_at + g - 1, num_tokens:size] = -1
        start = graphs.tables_at + g * stride
        view = a32[start : start + rows * max_blocks].reshape(rows, max_blocks)
        view[: len(table), : table.shape[1]] = table
        view[len(table) :, 0] = 0
        ranges.append((start, start + rows * max_blocks))
    return tuple(ranges)
