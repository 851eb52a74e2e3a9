"""The grouped Triton MoE kernel's variants for gpt-oss and DeepSeek-V3 (issue 42) against the
torch references: gate/up biases with gpt-oss's clamped SwiGLU, and FP8 weights scaled per
square block (DeepSeek's experts kept in FP8). Under the Triton interpreter without a GPU (tiny
sizes), compiled with one."""

from __future__ import annotations

import functools

import pytest
import torch
from triton_env import HAS_CUDA, needs_triton, tiny

pytestmark = needs_triton

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = dict(atol=1e-3, rtol=1e-3) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)  # float32


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype), gen


@tiny
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_gpt_oss_biases_and_clamped_swiglu(num_tokens):
    """gpt-oss's experts through the grouped kernel (bias in the first GEMM, clamped SwiGLU
    between) equal transformers' per-expert loop, with unused experts and a clamp that bites."""
    from pagedserve.kernels.gpt_oss_moe import clamped_swiglu, gpt_oss_experts_ref, route
    from pagedserve.kernels.triton_moe import triton_fused_moe

    dtype = torch.float32
    w13, w2, gen = experts(8, 64, 32, dtype)
    w13 = w13 * 8  # gate/up values beyond the limit of 7
    bias = torch.randn(8, 64, generator=gen).to(DEV, dtype)
    x = torch.randn(num_tokens, 64, generator=gen).to(DEV, dtype)
    weights, ids = route(torch.randn(num_tokens, 8, generator=gen).to(DEV), 3)
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    out = triton_fused_moe(x, w13, w2, weights, ids, w13_bias=bias, activation=act)
    ref = gpt_oss_experts_ref(x, w13, bias, w2, weights, ids, 1.702, 7.0)
    torch.testing.assert_close(out, ref, **TOL)


@tiny
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_decode_gemvs_equal_the_references(num_tokens):
    """The few-token path (two GEMVs, the activation in the first one's epilogue, the K slots
    summed in the second): gpt-oss's clamped SwiGLU with biases, a clamp that bites, and plain
    SiLU-and-mul, against the torch references; tile edges that do not divide the sizes."""
    from pagedserve.kernels.gpt_oss_moe import gpt_oss_experts_ref, route
    from pagedserve.kernels.moe import fused_moe_ref
    from pagedserve.kernels.triton_moe_decode import triton_moe_decode, use_moe_decode

    assert use_moe_decode(num_tokens, 3) and not use_moe_decode(64, 4)
    w13, w2, gen = experts(8, 48, 40, torch.float32)
    w13 = w13 * 8  # gate/up values beyond the limit of 7
    bias = torch.randn(8, 80, generator=gen).to(DEV)
    x = torch.randn(num_tokens, 48, generator=gen).to(DEV)
    weights, ids = route(torch.randn(num_tokens, 8, generator=gen).to(DEV), 3)
    tiles = (16, 32, 4, 3)
    out = triton_moe_decode(
        x, w13, w2, weights, ids, w13_bias=bias, clamp=(1.702, 7.0), tiles=tiles
    )
    ref = gpt_oss_experts_ref(x, w13, bias, w2, weights, ids, 1.702, 7.0)
    torch.testing.assert_close(out, ref, **TOL)
    out = triton_moe_decode(x, w13 / 8, w2, weights, ids, tiles=tiles)
    torch.testing.assert_close(out, fused_moe_ref(x, w13 / 8, w2, weights, ids), **TOL)


@tiny
def test_fp8_block_scaled_experts():
    """FP8 expert weights with one float32 scale per 32 x 32 block equal the reference over
    the dequantized weights; malformed scales are refused."""
    from pagedserve.kernels.fp8 import FP8
    from pagedserve.kernels.moe import fused_moe_ref, select_experts
    from pagedserve.kernels.triton_moe import triton_fused_moe

    block, dtype = 32, torch.float32
    w13, w2, gen = experts(4, 96, 64, torch.float32, seed=1)

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, n, k = w.shape
        tiles = w.view(e, n // block, block, k // block, block)
        scale = tiles.abs().amax(dim=(2, 4)) / 448.0  # [E, N/B, K/B]
        q = (tiles / scale[:, :, None, :, None]).to(FP8).view(e, n, k)
        deq = (q.float().view_as(tiles) * scale[:, :, None, :, None]).view(e, n, k)
        return q, scale.float().contiguous(), deq.to(dtype)

    q13, s13, d13 = quantize(w13)
    q2, s2, d2 = quantize(w2)
    x = torch.randn(9, 96, generator=gen).to(DEV, dtype)
    weights, ids = select_experts(torch.randn(9, 4, generator=gen).to(DEV), 2, True)
    out = triton_fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, fused_moe_ref(x, d13, d2, weights, ids), **TOL)
    with pytest.raises(ValueError, match="square blocks"):
        triton_fused_moe(x, q13, q2, weights, ids, w13_scale=s13[:, :1], w2_scale=s2)


@tiny
def test_deepseek_fp8_experts_kept(tmp_path, monkeypatch):
    """A block-FP8 DeepSeek checkpoint's routed experts stay FP8 (the GPU path, forced here on
    the CPU under the interpreter): scales stacked per rank as the weights are, and the MoE
    layer's output is that of the dequantized experts (`w_fp8 * scale` of each 16 x 16 block)."""
    from tiny_deepseek import make_fp8_deepseek, make_tiny_deepseek

    from pagedserve.config import ModelConfig
    from pagedserve.kernels.fp8 import FP8
    from pagedserve.kernels.moe import fused_moe_ref
    from pagedserve.worker.models import build_model
    from pagedserve.worker.models.deepseek_v3 import DeepseekV3MoE

    fp8 = make_fp8_deepseek(make_tiny_deepseek(str(tmp_path / "bf16")), str(tmp_path / "fp8"))
    if not HAS_CUDA:  # where a GPU would keep them
        monkeypatch.setattr(DeepseekV3MoE, "after_loading", DeepseekV3MoE.stack_expert_scales)
    moe = (
        build_model(ModelConfig(model=fp8), torch.float32, torch.device(DEV)).model.layers["2"].mlp
    )
    assert moe.w13_weight.dtype == FP8 and moe.w13_scale.shape == (8, 4, 4)

    def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return w.float() * scale.repeat_interleave(16, 1).repeat_interleave(16, 2)

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5)).to(DEV)
    moe.shared_experts = None  # FP8 dense MLPs: tests/test_fp8.py
    weights, ids = moe.gate(x)
    w13, w2 = dequantized(moe.w13_weight, moe.w13_scale), dequantized(moe.w2_weight, moe.w2_scale)
    torch.testing.assert_close(moe(x), fused_moe_ref(x, w13, w2, weights, ids), **TOL)


@tiny
def test_latent_cache_write_skips_padding_slots():
    """MLA's Triton cache write (what decode graphs run) stores each token's latent row in its
    slot and leaves the cache alone for a padding row's slot -1."""
    from pagedserve.kernels.triton_mla import triton_write_latent_cache

    cache = torch.zeros(4, 1, 8, 1, 72, device=DEV)
    latent = torch.randn(5, 72, device=DEV)
    slots = torch.tensor([3, 17, -1, 0, -1], device=DEV)
    triton_write_latent_cache(latent, cache, slots)
    want = torch.zeros(32, 72, device=DEV)
    want[[3, 17, 0]] = latent[[0, 1, 3]]
    torch.testing.assert_close(cache.view(32, 72), want, atol=0, rtol=0)


def timed_moe(label: str, fn, reference: torch.Tensor, weight_bytes: float) -> None:
    """Equal to `reference` (bf16 relative error < 1e-2), captured and timed in a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    from pagedserve.benchmarks.kernels.bench_kernels import relative_error

    assert relative_error(fn(), reference) < 1e-2
    ms = do_bench_cudagraph(fn, return_mode="median")
    print(f"\n{label}: {ms * 1e3:8.1f} us, {weight_bytes / ms / 1e6:6.0f} GB/s of expert weights")


@pytest.mark.gpu
def test_gpu_gpt_oss_20b_moe_shape():
    """gpt-oss-20b's experts (32 of 2880 x 2880, top 4, biases, clamped SwiGLU) in bf16."""
    from pagedserve.kernels.gpt_oss_moe import clamped_swiglu, gpt_oss_experts_ref, route
    from pagedserve.kernels.triton_moe import triton_fused_moe

    w13, w2, gen = experts(32, 2880, 2880, torch.bfloat16)
    bias = (torch.randn(32, 5760, generator=gen) * 0.1).to(DEV, torch.bfloat16)
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    for batch in (1, 64):
        x = torch.randn(batch, 2880, generator=gen).to(DEV, torch.bfloat16)
        weights, ids = route(torch.randn(batch, 32, generator=gen).to(DEV), 4)
        ref = gpt_oss_experts_ref(x, w13, bias, w2, weights, ids, 1.702, 7.0)
        fn = functools.partial(
            triton_fused_moe, x, w13, w2, weights, ids, w13_bias=bias, activation=act
        )
        touched = ids.unique().numel()
        timed_moe(f"gpt-oss-20b moe batch {batch:>3} ({touched} experts)", fn, ref,
                  touched * 3 * 2880 * 2880 * 2)  # fmt: skip


@pytest.mark.gpu
def test_gpu_deepseek_v3_fp8_moe_shape():
    """DeepSeek-V3's routed experts (256 of 7168 x 2048, top 8) in FP8 with 128 x 128 block
    scales against the bf16 reference over the same weights dequantized."""
    from pagedserve.kernels.fp8 import FP8
    from pagedserve.kernels.moe import fused_moe_ref, select_experts
    from pagedserve.kernels.triton_moe import triton_fused_moe

    gen = torch.Generator(DEV).manual_seed(0)
    e, h, i = 256, 7168, 2048
    q13 = torch.empty(e, 2 * i, h, device=DEV, dtype=FP8)
    q2 = torch.empty(e, h, i, device=DEV, dtype=FP8)
    for q in (*q13, *q2):  # one expert at a time: float32 stacks would not fit
        q.copy_(torch.randn(q.shape, device=DEV, generator=gen))
    s13 = torch.rand(e, 2 * i // 128, h // 128, device=DEV, generator=gen) / h**0.5
    s2 = torch.rand(e, h // 128, i // 128, device=DEV, generator=gen) / i**0.5

    def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        return torch.stack([(q[k].float() * full[k]).bfloat16() for k in range(e)])

    d13, d2 = dequantized(q13, s13), dequantized(q2, s2)
    for batch in (1, 64):
        x = torch.randn(batch, h, device=DEV, generator=gen).bfloat16()
        weights, ids = select_experts(torch.randn(batch, e, device=DEV, generator=gen), 8, True)
        ref = fused_moe_ref(x, d13, d2, weights, ids)
        fn = functools.partial(
            triton_fused_moe, x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2
        )
        touched = ids.unique().numel()
        timed_moe(f"deepseek-v3 fp8 moe batch {batch:>3} ({touched} experts)", fn, ref,
                  touched * 3 * h * i)  # fmt: skip
