"""Tensor and pipeline parallelism on CPU with gloo: greedy outputs at tp/pp > 1 equal tp=1 pp=1
token for token (fp32), including GQA with fewer KV heads than TP ranks (replicated KV heads)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import ParallelConfig
from pagedserve.frontend.llm import build_engine_config
from pagedserve.parallel.groups import layer_range, rank_info, split_layers

from tiny_models import make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()}
            for n in (4, 19, 40, 9, 27)]  # fmt: skip


def generate(path: str, tp: int, pp: int, **kw) -> list[list[int]]:
    with LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp,
             pipeline_parallel_size=pp, **kw) as llm:  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("par-llama")))
    return path, generate(path, 1, 1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_equals_single(llama, tp, pp):
    path, want = llama
    # A small budget makes several chunked steps, so pp=2 really keeps two plans in flight.
    assert generate(path, tp, pp, max_num_batched_tokens=24) == want


def test_kv_heads_fewer_than_tp_are_replicated(tmp_path_factory):
    path = make_tiny_model("qwen3", str(tmp_path_factory.mktemp("par-qwen3")))  # 2 KV heads
    assert generate(path, 4, 1) == generate(path, 1, 1)


def test_layer_split_and_rank_layout():
    assert split_layers(10, 3) == [4, 3, 3]
    assert split_layers(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="pp-layer-partition"):
        split_layers(4, 2, [2, 3])
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    infos = [rank_info(parallel, r) for r in range(4)]
    assert [(i.pp_stage, i.tp_rank) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [i.is_driver for i in infos] == [False, False, True, False]
    assert layer_range(5, infos[2], None) == (3, 5)


def test_indivisible_sizes_are_refused(tmp_path_factory):
    path = make_tiny_model("llama", str(tmp_path_factory.mktemp("par-bad")))
    with pytest.raises(ValueError, match="does not divide"):
        build_engine_config(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="exceeds"):
        build_engine_config(path, pipeline_parallel_size=5)
