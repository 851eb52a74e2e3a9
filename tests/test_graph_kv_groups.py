"""Decode CUDA graphs for models with several KV cache groups (gpt-oss: sliding and full
layers): each group's block table and slot mapping are static graph inputs, laid out on the host
and copied per step. On CPU: the buffers a replay reads equal the eager step's metadata."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.step_metadata import attention_metadata

BLOCK_SIZE, MAX_BLOCKS = 4, 5


def _inputs(rng: np.random.Generator, n: int, groups: int) -> StepInputs:
    seq_lens = rng.integers(1, BLOCK_SIZE * MAX_BLOCKS, n).astype(np.int32)
    tables = [rng.integers(1, 50, (n, MAX_BLOCKS)).astype(np.int32) for _ in range(groups)]
    pos = seq_lens.astype(np.int64) - 1
    slots = [t[np.arange(n), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for t in tables]
    return StepInputs(
        input_ids=rng.integers(0, 100, n), positions=pos, slot_mapping=slots[0],
        query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=seq_lens,
        block_tables=tables[0], logits_indices=np.arange(n), sample_rows=list(range(n)),
        group_slot_mappings=slots[1:], group_block_tables=tables[1:],
    )  # fmt: skip


def test_decode_graph_inputs_hold_every_group():
    rng = np.random.default_rng(0)
    graphs = DecodeGraphs(
        lambda *a: None, max_batch=8, max_blocks=MAX_BLOCKS, max_model_len=64,
        block_size=BLOCK_SIZE, device=torch.device("cpu"), cascade=True, num_groups=3,
    )  # fmt: skip
    for n, key in [(3, (4, False)), (8, (8, True)), (1, (1, False))]:
        inputs = _inputs(rng, n, 3)
        inputs.cascade_len = 4 if key[1] else 0
        meta = graphs._meta(key)
        graphs._upload(key[0], *graphs.stage(inputs, key))
        eager = attention_metadata(inputs, BLOCK_SIZE, torch.device("cpu"))
        assert meta.cascade_len_dev is (graphs.cascade_len if key[1] else None)
        for g in range(3):
            ours, theirs = meta.for_group(g), eager.for_group(g)
            assert ours is not meta or g == 0
            assert torch.equal(ours.slot_mapping[:n], theirs.slot_mapping)
            assert torch.equal(ours.block_tables[:n], theirs.block_tables)
            assert torch.equal(ours.seq_lens[:n], theirs.seq_lens)
            assert (ours.slot_mapping[n:] == -1).all()  # padding rows write nowhere
            assert (ours.block_tables[n:, 0] == 0).all()
            if g:  # the cascade's shared prefix is group 0's only
                assert ours.cascade_len == 0 and ours.cascade_len_dev is None
