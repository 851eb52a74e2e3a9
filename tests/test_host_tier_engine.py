"""The host KV tier end to end on CPU (worker/host_tier.py: a second pool of plain copies): under
a KV cache small enough to force preemption and prefix-cache eviction, greedy outputs with the
tier on (swap, or recompute with spills and host hits) equal those with it off, at tp=2 and pp=2
too, and the stats show the tier was used."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# 20 blocks of 4 tokens cannot hold 8 running requests of 20-43 tokens (each needs up to 11):
# requests are preempted; a shared 16-token prefix, evicted and hit again, spills to the host.
TIGHT = dict(dtype="float32", block_size=4, num_gpu_blocks_override=20,
             max_model_len=64, max_num_batched_tokens=16)  # fmt: skip
TIER = dict(kv_offloading_size=0.001)  # 1 MiB: 64 blocks of this model's 16 KiB


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 500, (16,), generator=gen).tolist()
    rest = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (8, 27, 4, 19, 11)]
    return [shared + r for r in rest] + rest[1:4]


def generate(path: str, device: str = "cpu", **kw) -> tuple[list[list[int]], object]:
    with LLM(path, device=device, **TIGHT, **kw) as llm:
        batch = [{"prompt_token_ids": p} for p in prompts()]
        first = llm.generate(batch, GREEDY)
        again = llm.generate(batch[:3], GREEDY)  # their prefixes were evicted meanwhile
        return [o.outputs[0].token_ids for o in first + again], llm.last_stats


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("tier-llama")))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    path = tiny_path
    want, stats = generate(path)
    assert stats.num_preemptions > 0
    return path, want


@pytest.mark.parametrize("mode,tp,pp", [("recompute", 2, 1), ("swap", 1, 2)])
def test_tier_changes_no_output(tiny, mode, tp, pp):
    """Swap runs without the prefix cache: every copy is a swap (none a spill or a host hit)."""
    path, want = tiny
    got, stats = generate(
        path, **TIER, preemption_mode=mode, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        enable_prefix_caching=mode != "swap",
    )  # fmt: skip
    assert got == want
    assert stats.kv_swap_out_bytes > 0 and stats.kv_swap_in_bytes > 0
    assert (stats.host_cache_hits > 0) == (mode == "recompute")


@pytest.mark.gpu
def test_tier_changes_no_output_on_a_gpu(tiny_path):
    """The copy stream's ordering against the compute stream (float32, CUDA graphs on)."""
    path = tiny_path
    want, _ = generate(path, "cuda")
    for mode in ("swap", "recompute"):
        got, stats = generate(path, "cuda", **TIER, preemption_mode=mode)
        assert got == want, mode
        assert stats.kv_swap_out_bytes > 0 and stats.kv_swap_in_bytes > 0
