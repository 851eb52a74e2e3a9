"""The per-step batch layout every attention backend reads (the bottom of kernels/attention/).

Rows are the step's sequences; their new tokens are flattened into one batch. Built once per step
(worker/model_runner.py from its persistent numpy arrays, `build_attention_metadata` from plain
lists in tests and warm-ups) and shared by every layer of the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout, shared by every layer of one forward pass.

    Rows are sequences; tokens of row i are `query_start_loc[i]:query_start_loc[i + 1]` of the
    flattened batch and sit at the end of the row's context of `seq_lens[i]` tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_start_loc_cpu: np.ndarray  # [B + 1] host copy, for loops without device syncs
    seq_lens_cpu: np.ndarray  # [B] host copy
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The other KV cache groups' layouts (groups 1..; `for_group`): the same rows and tokens
    # over their own block tables and slots. None: every group reads this one.
    group_metas: list[AttentionMetadata] | None = None
    # Cascade attention (kernels/attention/cascade.py): tokens of the leading blocks every row
    # shares, to attend once for the whole batch (0: none). `cascade_len_dev` [1] int32 holds the
    # exact value the kernels read; in a CUDA graph `cascade_len` is only an upper bound (the
    # switch and the prefix pass's split count) and each replay writes the step's value on the
    # device.
    cascade_len: int = 0
    cascade_len_dev: torch.Tensor | None = None
    # Models with recurrent state (linear attention): each row's state slot (core/state_pool.py),
    # [B] int64 on the device and on the host. None: the model keeps no such state.
    state_slots: torch.Tensor | None = None
    state_slots_cpu: np.ndarray | None = None
    # What a backend derives from the layout once per step and every layer reuses (the CPU
    # backend's padded groups and masks); a new step builds new metadata, so it never goes stale.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_host(
        cls,
        slot_mapping: np.ndarray,  # [T] int64
        query_start_loc: np.ndarray,  # [B + 1] int32
        seq_lens: np.ndarray,  # [B] int32
        block_tables: np.ndarray,  # [B, max_blocks] int32
        block_size: int,
        to_dev: Callable[[np.ndarray], torch.Tensor],
    ) -> AttentionMetadata:
        """The layout from host arrays, copied to the device by `to_dev` (the arrays stay as the
        host copies)."""
        return cls(
            slot_mapping=to_dev(slot_mapping),
            query_start_loc=to_dev(query_start_loc),
            seq_lens=to_dev(seq_lens),
            block_tables=to_dev(block_tables),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=int(np.diff(query_start_loc).max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_group(self, group: int) -> AttentionMetadata:
        """The layout a layer of KV cache group `group` attends over (config.kv_cache_groups)."""
        if group == 0 or self.group_metas is None:
            return self
        return self.group_metas[group - 1]


def build_attention_metadata(
    num_computed: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions [T] for rows that each add `num_new[i]` tokens after
    `num_computed[i]` cached ones, from plain lists (tests and simple callers; a model runner keeps
    persistent numpy arrays instead)."""
    q_lens = np.asarray(num_new, dtype=np.int64)
    seq_lens = np.asarray(num_computed, dtype=np.int64) + q_lens
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(c, c + n) for c, n in zip(num_computed, num_new, strict=True)] or [np.zeros(0)]
    ).astype(np.int64)
    seq_idx = np.repeat(np.arange(len(num_new)), q_lens)
    width = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[seq_idx, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    seq_lens = seq_lens.astype(np.int32)
    meta = AttentionMetadata.from_host(
        slots, qsl, seq_lens, tables, block_size, lambda a: torch.from_numpy(a).to(device)
    )
    return meta, torch.from_numpy(positions).to(device)
