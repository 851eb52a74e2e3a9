"""Speculative decoding's numerics on CUDA (issue 38): a verification step (k + 1 query tokens a
row, the multi-token attention tiles) and a plain decode step (decode tiles, split-K, CUDA graphs)
must give a float32 model the same logprobs to float32 rounding, and both the CPU reference's.
A wrong position, stale KV or a rejected draft's KV read would show as a difference far above
rounding; TF32 dots in a float32 model's attention (Triton's default) showed as 1.9e-4.
Skipped without CUDA (tests/gpu/spec_numerics.py measures the same on SmolLM2's shape)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.tests.gpu.spec_numerics import NGRAM, compare, generate, prompts

from tiny_models import tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = 1e-4  # float32 logprobs; H100: IEEE attention passes, TF32 attention gave 1.9e-4


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    path = tiny_model_dir("llama", tmp_path_factory.mktemp("spec-numerics"))
    batch = prompts(512, 4)
    kw = dict(dtype="float32", max_model_len=512, max_num_seqs=4, kv_cache_memory=256 << 20)
    off = generate(path, None, batch, 64, **kw)
    on = generate(path, NGRAM, batch, 64, **kw)
    return path, batch, off, on


def test_float32_verification_matches_decode(arms):
    _, _, off, on = arms
    assert on["verifications"] > 0
    for row in compare(off, on):
        assert row["noise"] < TOL, row
        # a flip only where the two best tokens tie to rounding
        assert row["first"] is None or row["margin_off"] < TOL, row


def test_float32_cuda_logprobs_match_the_cpu_reference(arms):
    from transformers import AutoModelForCausalLM

    path, batch, off, _ = arms
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, run in zip(batch, off["runs"], strict=True):
        ids = torch.tensor([prompt + run["tokens"]])
        with torch.no_grad():
            logp = model(ids).logits[0].log_softmax(-1)
        n = len(prompt)
        ref = logp[n - 1 : -1].gather(1, torch.tensor(run["tokens"])[:, None])[:, 0]
        diff = (ref - torch.tensor(run["chosen"])).abs().max().item()
        assert diff < TOL, diff
