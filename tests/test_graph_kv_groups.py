"""Decode and mixed-step CUDA graphs for models with several KV cache groups (gpt-oss: sliding
and full layers): each group's block table and slot mapping are static graph inputs, laid out on
the host and copied per step. On CPU: the buffers a replay reads equal the eager step's metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpt_oss_model import make_gpt_oss

from pagedserve import LLM, SamplingParams
from pagedserve.frontend.llm import build_engine_config
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from pagedserve.worker.input_batch import StepInputs
from pagedserve.worker.models import build_model
from pagedserve.worker.step_features import step_features
from pagedserve.worker.step_metadata import attention_metadata

from tiny_models import make_tiny_model

BLOCK_SIZE, MAX_BLOCKS = 4, 16  # (mixed graphs pad up to 64 tokens over one table)


def _inputs(rng: np.random.Generator, q_lens: list[int], groups: int) -> StepInputs:
    """Rows adding `q_lens[i]` tokens each, over `groups` random block tables."""
    n, q = len(q_lens), np.asarray(q_lens)
    seq_lens = (q + rng.integers(0, BLOCK_SIZE * MAX_BLOCKS - q.max() + 1, n)).astype(np.int32)
    tables = [rng.integers(1, 50, (n, MAX_BLOCKS)).astype(np.int32) for _ in range(groups)]
    row = np.repeat(np.arange(n), q)
    pos = np.concatenate(
        [np.arange(s - k, s) for s, k in zip(seq_lens, q_lens, strict=True)]
    ).astype(np.int64)
    slots = [t[row, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for t in tables]
    return StepInputs(
        input_ids=rng.integers(0, 100, len(pos)), positions=pos, slot_mapping=slots[0],
        query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int32), seq_lens=seq_lens,
        block_tables=tables[0], logits_indices=np.arange(n), sample_rows=list(range(n)),
        group_slot_mappings=slots[1:], group_block_tables=tables[1:],
    )  # fmt: skip


def _check_groups(meta, inputs: StepInputs, groups: int) -> None:
    """Every group's layout over the graph's buffers equals the eager step's, its padding
    tokens writing nowhere; the cascade's shared prefix is group 0's only."""
    eager = attention_metadata(inputs, BLOCK_SIZE, torch.device("cpu"))
    t, n = len(inputs.input_ids), len(inputs.seq_lens)
    for g in range(groups):
        ours, theirs = meta.for_group(g), eager.for_group(g)
        assert (ours is meta) == (g == 0)
        assert torch.equal(ours.slot_mapping[:t], theirs.slot_mapping)
        assert (ours.slot_mapping[t:] == -1).all()
        assert torch.equal(ours.block_tables[:n], theirs.block_tables)
        assert torch.equal(ours.seq_lens[:n], theirs.seq_lens)
        assert torch.equal(ours.query_start_loc[: n + 1], theirs.query_start_loc)
        if g:
            assert ours.cascade_len == 0 and ours.cascade_len_dev is None


def test_decode_graph_inputs_hold_every_group():
    rng = np.random.default_rng(0)
    graphs = DecodeGraphs(
        lambda *a: None, max_batch=8, max_blocks=MAX_BLOCKS, max_model_len=64,
        block_size=BLOCK_SIZE, device=torch.device("cpu"), cascade=True, num_groups=3,
    )  # fmt: skip
    for n, key in [(3, (4, False)), (8, (8, True)), (1, (1, False))]:
        inputs = _inputs(rng, [1] * n, 3)
        inputs.cascade_len = 4 if key[1] else 0
        meta = graphs._meta(key)
        graphs._upload(key[0], *graphs.stage(inputs, key))
        _check_groups(meta, inputs, 3)
        assert meta.cascade_len_dev is (graphs.cascade_len if key[1] else None)
        for g in range(3):  # padding rows attend block 0
            assert (meta.for_group(g).block_tables[n:, 0] == 0).all()


def test_mixed_graph_inputs_hold_every_group():
    rng = np.random.default_rng(1)
    graphs = MixedGraphs(
        lambda *a: None, max_seqs=4, max_tokens=64, max_blocks=MAX_BLOCKS, max_model_len=64,
        block_size=BLOCK_SIZE, device=torch.device("cpu"), num_groups=2,
    )  # fmt: skip
    for q_lens in ([5, 1, 9], [1], [3, 3, 1, 7]):
        inputs = _inputs(rng, q_lens, 2)
        size = graphs.bucket(sum(q_lens), len(q_lens))
        meta = graphs._meta((size, False))
        graphs._upload(size, *graphs.stage(inputs, size))
        _check_groups(meta, inputs, 2)
        assert (meta.for_group(1).block_tables[-1] == 0).all()  # the padding row's table


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3"])
def test_graphs_equal_eager_with_two_groups_on_gpu(kind, tmp_path_factory):
    """On a GPU, gpt-oss's and Gemma 3's two KV cache groups keep CUDA graphs on, and decode and
    mixed-step graphs (a 24-token budget chunks the prompts beside running decodes; 4-token
    blocks, so rows run far past the 8-token window and the windowed group drops blocks) give
    the eager tokens, fp32."""
    base = tmp_path_factory.getbasetemp()
    path = make_gpt_oss(str(base / "gpt-oss")) if kind == "gpt-oss" else (
        make_tiny_model(kind, str(base / kind))
    )  # fmt: skip
    config = build_engine_config(path, device="cuda", dtype="float32")
    assert len(config.model.kv_group_windows) == 2
    model = build_model(config.model, torch.float32, torch.device("cpu"))  # (no GPU memory held)
    info = rank_info(config.parallel, 0)
    assert step_features(config, torch.device("cuda"), info, model, torch.float32).cuda_graphs
    gen = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 400, (n,), generator=gen).tolist()}
        for n in (5, 17, 40, 3, 29, 11)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    runs = []
    for eager in (True, False):
        with LLM(
            path, device="cuda", dtype="float32", enforce_eager=eager, block_size=4,
            max_num_batched_tokens=24, max_model_len=128, gpu_memory_utilization=0.3,
        ) as llm:  # fmt: skip
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
