"""A step's attention metadata on the device, from the host arrays the persistent batch prepared
(worker/input_batch.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.sampler import to_device


def attention_metadata(
    inputs: StepInputs, block_size: int, device: torch.device
) -> AttentionMetadata:
    """The step's layout on the device: group 0's, with the cascade's shared prefix, and
    every other KV cache group's over its own block tables and slots."""

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return to_device(a, device)

    meta = AttentionMetadata.from_host(
        inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens, inputs.block_tables,
        block_size, to_dev,
    )  # fmt: skip
    if inputs.cascade_len:
        meta.cascade_len = inputs.cascade_len
        meta.cascade_len_dev = to_dev(np.array([inputs.cascade_len], dtype=np.int32))
    if inputs.state_slots is not None:
        meta.state_slots_cpu = inputs.state_slots
        meta.state_slots = to_dev(inputs.state_slots)
    if inputs.group_block_tables:  # KV cache groups 1..: the same rows over their own tables
        meta.group_metas = [
            dataclasses.replace(
                meta,
                slot_mapping=to_dev(slots),
                block_tables=to_dev(table),
                scratch={},
                cascade_len=0,
                cascade_len_dev=None,  # group 0's prefix only
            )
            for slots, table in zip(
                inputs.group_slot_mappings, inputs.group_block_tables, strict=True
            )
        ]
    return meta
