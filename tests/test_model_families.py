"""The further model families (MoE, Gemma 2/3, Phi-3, YaRN/longrope) against transformers.

Per family, on a tiny random model (tests/tiny_models.py `FAMILY_KINDS`): logits through the paged
KV cache with chunked prefill and decodes in one batch (fp32, CPU, 8-token blocks); then the
engine at tp=2 with 4-token blocks, a 16-token step budget and prefix-cache hits, greedy token for
token against transformers' `generate` (so tp=2 equals tp=1, which equals transformers)."""

from __future__ import annotations

import pytest
import torch
from test_llm import hf_greedy
from test_models import PagedRunner, check, random_seqs

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.worker.models import build_model

from tiny_models import FAMILY_KINDS, make_tiny_model

NUM_NEW = 8


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(request.param, str(tmp_path_factory.getbasetemp() / request.param))
    ours = build_model(ModelConfig(model=path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, ours, theirs


def test_chunked_prefill_and_decode_logits(family):
    """Lengths stay within 32 positions: transformers switches Phi-3's longrope factors for the
    whole sequence when run at once, which the incremental engine test below covers instead."""
    _, ours, theirs = family
    seqs = random_seqs([30, 21, 9], seed=5)
    steps = [{0: 11, 2: 9}, {0: 13, 1: 7, 2: 0}, {0: 6, 1: 14}]
    check(PagedRunner(ours, seqs), theirs, steps)


def test_engine_tp2_prefix_cache_equals_transformers(family):
    path, _, _ = family
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 500, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 12, 7)]
    want, _ = hf_greedy(path, prompts, NUM_NEW)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    with LLM(
        path, device="cpu", dtype="float32", tensor_parallel_size=2, block_size=4,
        max_num_batched_tokens=16,
    ) as llm:  # fmt: skip
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    assert all(o.num_cached_tokens == 16 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == want
