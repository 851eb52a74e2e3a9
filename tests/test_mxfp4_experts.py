"""gpt-oss's MXFP4 experts kept packed (issue 42): the Triton kernels that decode them (the
few-token GEMVs and the grouped kernel) against the torch reference over the dequantized
weights, the packed load (each tensor-parallel rank's share equal to the dequantized load's),
the tiny checkpoint's logits with packed experts against transformers, dummy packed weights and
the switch. Under the Triton interpreter without a GPU (tiny sizes), compiled with one."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file
from triton_env import HAS_CUDA, needs_triton, tiny

from pagedserve import settings
from pagedserve.config import ModelConfig
from pagedserve.kernels.gpt_oss_moe import clamped_swiglu, gpt_oss_experts_ref, route
from pagedserve.kernels.mxfp4 import DUMMY_EXPONENT, dequantize_mxfp4
from pagedserve.worker.layers import gpt_oss_moe
from pagedserve.worker.models import build_model

pytestmark = needs_triton

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = dict(atol=1e-3, rtol=1e-3) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)  # float32
CLAMP = (1.702, 7.0)


def packed_experts(num_experts: int, n: int, k: int, gen: torch.Generator):
    """Random codes (every nibble) under scales 2^-7 .. 2^2."""
    blocks = torch.randint(0, 256, (num_experts, n, k // 32, 16), generator=gen).byte()
    scales = torch.randint(120, 130, (num_experts, n, k // 32), generator=gen).byte()
    return blocks.to(DEV), scales.to(DEV)


@tiny
@pytest.mark.parametrize("num_tokens", [1, 2, 9])
def test_mxfp4_kernels_equal_the_dequantized_reference(num_tokens):
    """Both MXFP4 paths equal gpt-oss's reference experts over `dequantize_mxfp4`'s weights:
    biases, a clamp that bites, unused experts, a K step wider than the rows (3 groups of 32)."""
    from pagedserve.kernels.triton_moe_decode import use_moe_decode
    from pagedserve.kernels.triton_moe_mxfp4 import triton_fused_moe_mxfp4
    from pagedserve.kernels.triton_moe_mxfp4_decode import triton_moe_mxfp4_decode

    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter = 4, 96, 64
    w13, w2 = packed_experts(4, 2 * inter, hidden, gen), packed_experts(4, hidden, inter, gen)
    d13, d2 = dequantize_mxfp4(*w13, torch.float32), dequantize_mxfp4(*w2, torch.float32)
    bias = torch.randn(num_experts, 2 * inter, generator=gen).to(DEV)
    x = (torch.randn(num_tokens, hidden, generator=gen) / 8).to(DEV)
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen).to(DEV), 2)
    ref = gpt_oss_experts_ref(x, d13, bias, d2, weights, ids, *CLAMP)
    if use_moe_decode(num_tokens, 2):
        out = triton_moe_mxfp4_decode(
            x, w13, w2, weights, ids, w13_bias=bias, clamp=CLAMP, tiles=(16, 2, 4, 3)
        )
        torch.testing.assert_close(out, ref, **TOL)
    if num_tokens > 1:
        act = functools.partial(clamped_swiglu, alpha=CLAMP[0], limit=CLAMP[1])
        out = triton_fused_moe_mxfp4(
            x, w13, w2, weights, ids, w13_bias=bias, activation=act, tiles=(32, 64, 4, 3)
        )
        torch.testing.assert_close(out, ref, **TOL)
        with pytest.raises(ValueError, match="MXFP4 down"):
            triton_fused_moe_mxfp4(x, w13, (w2[0], w2[1][:, :1]), weights, ids, activation=act)


def _experts(hf: dict, packed: bool, monkeypatch) -> gpt_oss_moe.GptOssExperts:
    monkeypatch.setattr(gpt_oss_moe, "keep_mxfp4", lambda device: packed)
    return gpt_oss_moe.GptOssExperts(hf, mxfp4=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_load_per_rank(gpt_oss_dir, tp, monkeypatch):
    """A rank's packed blocks and scales decode to exactly the dequantized load's weights (gate
    and up rows apart, the down projection's columns in whole scale blocks)."""
    import json

    with open(f"{gpt_oss_dir}/config.json") as f:
        hf = json.load(f)
    tensors = load_file(f"{gpt_oss_dir}/model.safetensors")
    stem = "model.layers.1.mlp.experts."
    monkeypatch.setattr(gpt_oss_moe, "tp_size", lambda: tp)
    for rank in range(tp):
        monkeypatch.setattr(gpt_oss_moe, "tp_rank", lambda rank=rank: rank)
        packed, plain = _experts(hf, True, monkeypatch), _experts(hf, False, monkeypatch)
        for module in (packed, plain):
            pairs = (("gate_up_proj", module.w13_weight), ("down_proj", module.w2_weight))
            for theirs, param in pairs:
                for part in ("blocks", "scales"):
                    param.weight_loader(param, tensors[f"{stem}{theirs}_{part}"], part)
        assert packed.w13_weight.dtype == torch.uint8 and not plain.packed_mxfp4
        got = dequantize_mxfp4(packed.w13_weight, packed.w13_scales, torch.float32)
        assert torch.equal(got, plain.w13_weight)
        got = dequantize_mxfp4(packed.w2_weight, packed.w2_scales, torch.float32)
        assert torch.equal(got, plain.w2_weight)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    from gpt_oss_model import make_gpt_oss

    return make_gpt_oss(str(tmp_path_factory.getbasetemp() / "gpt-oss-packed"))


@tiny
@pytest.mark.skipif(HAS_CUDA, reason="a CPU model under the interpreter (a GPU runs tests/gpu/)")
def test_packed_model_logits_equal_transformers(gpt_oss_dir, monkeypatch):
    """The tiny MXFP4 checkpoint with its experts packed (the GPU's form, here under the
    interpreter): logits through a chunked prefill and decodes equal transformers', decode rows
    on the GEMVs and larger steps on the grouped kernel; the packed experts hold ~4.25 bits a
    weight."""
    from gpt_oss_model import load_oracle
    from test_models import PagedRunner, check, random_seqs

    monkeypatch.setattr(gpt_oss_moe, "keep_mxfp4", lambda device: True)
    ours = build_model(ModelConfig(model=gpt_oss_dir), torch.float32, torch.device("cpu"))
    experts = ours.model.layers["0"].mlp.experts
    assert experts.packed_mxfp4 and experts.w13_weight.dtype == torch.uint8
    packed_bytes = sum(t.nbytes for t in (experts.w13_weight, experts.w13_scales))
    assert packed_bytes * 8 / experts.w13_weight[..., 0, 0].numel() / 64 == 4.25
    seqs = random_seqs([22, 11], seed=7)
    steps = [{0: 12, 1: 9}, {0: 1}, {0: 1, 1: 1}, {0: 8, 1: 1}]
    check(PagedRunner(ours, seqs), load_oracle(gpt_oss_dir), steps)


@tiny
def test_dummy_packed_weights(gpt_oss_dir, monkeypatch):
    """`--load-format dummy` draws packed codes (every byte value) under 2^-7 scales, so the
    experts' weights have the other dummy weights' size."""
    monkeypatch.setattr(gpt_oss_moe, "keep_mxfp4", lambda device: True)
    config = ModelConfig(model=gpt_oss_dir, load_format="dummy")
    experts = build_model(config, torch.float32, torch.device("cpu")).model.layers["1"].mlp.experts
    assert experts.w13_weight.unique().numel() == 256
    assert bool((experts.w2_scales == DUMMY_EXPONENT).all())
    rms = dequantize_mxfp4(experts.w13_weight, experts.w13_scales, torch.float32).pow(2).mean()
    assert 0.015 < rms.sqrt().item() < 0.03


def test_switch(monkeypatch):
    """Dequantized by default; `PAGEDSERVE_MXFP4_EXPERTS=packed` keeps them packed on CUDA with
    Triton (never on the CPU)."""
    cuda = torch.device("cuda")
    assert not gpt_oss_moe.keep_mxfp4(cuda)
    monkeypatch.setenv("PAGEDSERVE_MXFP4_EXPERTS", "packed")
    settings.forget()
    try:
        assert gpt_oss_moe.keep_mxfp4(cuda) and not gpt_oss_moe.keep_mxfp4(torch.device("cpu"))
    finally:
        monkeypatch.delenv("PAGEDSERVE_MXFP4_EXPERTS")
        settings.forget()
