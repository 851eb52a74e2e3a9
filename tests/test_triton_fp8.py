"""FP8 Triton kernels against their torch references: activation quantization, the w8a8
block-FP8 GEMM, the small-M weight-only kernel, the FP8 cache write and attention over an FP8
cache; on a GPU also torch's row-wise FP8 GEMM (`torch._scaled_mm`), Llama-3-8B sizes and CUDA
graph capture of the small-M kernel.

Without a GPU the kernels run under the Triton interpreter, as in test_triton_kernels.py. The
interpreter reads FP8 exactly but rounds float32 -> e4m3 wrongly where rounding carries into
the exponent (e.g. 31.6 -> 16 instead of 32: a few percent of values), so there the kernels that
write FP8 are held to their scales and to all but those elements; on a GPU, to every bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from triton_env import HAS_CUDA, HAS_TRITON, needs_triton, tiny

pytestmark = needs_triton

if HAS_TRITON:
    from pagedserve import settings
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch, relative_error
    from pagedserve.kernels import fp8, triton_fp8
    from pagedserve.kernels.attention.reference import paged_attention_ref, write_kv_cache_ref
    from pagedserve.kernels.attention.triton import triton_paged_attention
    from pagedserve.kernels.triton_activation import triton_silu_and_mul
    from pagedserve.kernels.triton_cache import triton_write_kv_cache
    from pagedserve.kernels.triton_fp8 import (
        block_config,
        triton_quantize_rows,
        triton_silu_mul_quantize,
        triton_w8a8_block_matmul,
    )
    from pagedserve.kernels.triton_fp8_gemv import CONFIG_FILE as GEMV_CONFIGS
    from pagedserve.kernels.triton_fp8_gemv import gemv_config, triton_fp8_gemv

DEV = "cuda" if HAS_CUDA else "cpu"
FP8 = torch.float8_e4m3fn
MIXED = ([0, 37, 70, 5, 100, 16], [9, 1, 1, 20, 1, 16])


def same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal on a GPU; under the interpreter all but its mis-rounded elements (< 5%)."""
    differ = (got.float() != want.float()).float().mean().item()
    assert differ == 0 if HAS_CUDA else differ < 0.05, differ


@tiny
@pytest.mark.parametrize("group", [None, 128, 32])
def test_quantize_rows(group, monkeypatch):
    x = torch.randn(9, 300, device=DEV) * torch.logspace(-3, 2, 9, device=DEV)[:, None]
    if group is None:  # the chunked two-pass path too (rows wider than ONE_PASS_COLS)
        monkeypatch.setattr(triton_fp8, "ONE_PASS_COLS", 128)
        torch.testing.assert_close(triton_quantize_rows(x)[1], fp8.quantize_rows(x)[1])
        monkeypatch.undo()
    q, scale = triton_quantize_rows(x, group)
    q_ref, scale_ref = fp8.quantize_rows(x, group)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    same_fp8(q, q_ref)


@tiny
@pytest.mark.parametrize("one_pass", [True, False])
def test_silu_mul_quantize_is_silu_and_mul_then_quantize(one_pass, monkeypatch):
    """The fused kernel writes what silu_and_mul followed by the per-token quantizer writes,
    bit for bit, in one pass over the row or in chunks (rows wider than ONE_PASS_COLS)."""
    if not one_pass:
        monkeypatch.setattr(triton_fp8, "ONE_PASS_COLS", 128)
    gate_up = (torch.randn(7, 600, device=DEV) * 3).to(torch.bfloat16)
    q, scale = triton_silu_mul_quantize(gate_up)
    q_ref, scale_ref = triton_quantize_rows(triton_silu_and_mul(gate_up))
    assert q.shape == (7, 300) and scale.shape == (7, 1)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())
    assert relative_error(fp8.dequantize(q, scale, None), triton_silu_and_mul(gate_up)) < 0.1
    with pytest.raises(ValueError, match="gate/up"):
        triton_silu_mul_quantize(gate_up[:, :-1])


@tiny
@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 300), (33, 64, 256), (5, 200, 128)])
def test_w8a8_block_matmul(m, n, k):
    gen = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, generator=gen, device=DEV)
    w = torch.randn(n, k, generator=gen, device=DEV)
    xq, xs = fp8.quantize_rows(x, 128)
    wq, ws = fp8.quantize_rows(w, 128)  # per row and block: the row-expanded layout
    ref = fp8.dequantize(xq, xs, 128) @ fp8.dequantize(wq, ws, 128).t()
    for config in (None, dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=4, num_stages=2)):
        out = triton_w8a8_block_matmul(xq, xs, wq, ws, 128, torch.float32, config=config)
        assert relative_error(out, ref) < 1e-5


def test_block_configs_cover_every_m():
    assert block_config(1, 4096, 4096)["BLOCK_M"] == 16
    assert block_config(10**6, 1, 1)["BLOCK_M"] >= 64  # unknown shape: the default table


# Llama-3-8B's (N, K) scaled down 32x (qkv, o, gate_up, down), and an odd one.
GEMV_SHAPES = [(192, 128), (128, 128), (896, 128), (128, 448), (70, 300)]
ELEMENTWISE_SPLIT = dict(  # the hand-prefetched loop, K split in 2 (atomics)
    BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, USE_DOT=0, PREFETCH=1, num_warps=4, num_stages=1
)
DOT = dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, USE_DOT=1, PREFETCH=0, num_warps=4, num_stages=2)


def gemv_case(m: int, n: int, k: int, group: int | None, dtype: torch.dtype, seed: int = 0):
    """(x, fp8 weight, scales, bias) as a checkpoint would have them: weight ~0.02, bias small."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
    wq, ws = fp8.quantize_rows(torch.randn(n, k, generator=gen, device=DEV) * 0.02, group)
    return x, wq, ws, (torch.randn(n, generator=gen, device=DEV) * 0.1).to(dtype)


@tiny
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("group", [None, 128])
def test_fp8_gemv_matches_weight_only_reference(m, group):
    """Stored configs (element-wise without prefetch up to M = 4), a prefetching K split
    (atomics) and the tl.dot form, per channel and per block."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    tol = 1e-2 if HAS_CUDA else 1e-5
    for n, k in GEMV_SHAPES:
        x, wq, ws, bias = gemv_case(m, n, k, group, dtype, seed=n + k)
        ref = fp8.fp8_weight_only_ref(x, wq, ws, bias, group)
        for config in (None, ELEMENTWISE_SPLIT, DOT) if n in (70, 128) else (None,):
            out = triton_fp8_gemv(x, wq, ws, bias, group, config=config)
            assert out.dtype == dtype and out.shape == (m, n)
            assert relative_error(out, ref) < tol, (n, k, config)
    x, wq, ws, _ = gemv_case(m, 96, 512, group, torch.bfloat16)  # bf16, element-wise form
    got = triton_fp8_gemv(x, wq, ws, None, group, config=ELEMENTWISE_SPLIT)
    assert relative_error(got, fp8.fp8_weight_only_ref(x, wq, ws, None, group)) < 1e-2


def test_gemv_configs_cover_every_small_m():
    """Every stored config is launchable (tl.dot needs 16-wide tiles) and every M up to
    SMALL_M has one for the 8B shapes and for unknown ones."""
    with open(GEMV_CONFIGS) as f:
        table = {key: v for key, v in json.load(f).items() if key != "_doc"}
    keys = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_DOT", "PREFETCH", "num_warps", "num_stages"}
    for entries in table.values():
        assert entries[-1][0] >= fp8.SMALL_M and [e[0] for e in entries] == sorted(
            e[0] for e in entries
        )
        for _, cfg in entries:
            assert set(cfg) == keys and cfg["BLOCK_K"] >= 16, cfg
            assert not cfg["USE_DOT"] or cfg["BLOCK_N"] >= 16, cfg
    assert set(gemv_config(16, 10**6, 1)) == keys
    with pytest.raises(ValueError, match="M <= 16"):
        triton_fp8_gemv(*gemv_case(17, 16, 32, None, torch.float32)[:3])


@tiny
def test_fp8_cache_write_matches_reference():
    kv = torch.zeros(6, 2, 16, 2, 16, device=DEV, dtype=FP8)
    key, value = torch.randn(5, 2, 16, device=DEV) * 3, torch.randn(5, 2, 16, device=DEV)
    slots = torch.tensor([3, -1, 40, 94, -1], device=DEV)
    expected = kv.clone()
    write_kv_cache_ref(key, value, expected, slots, 2.0, 0.5)
    triton_write_kv_cache(key, value, kv, slots, 2.0, 0.5)
    same_fp8(kv, expected)


@tiny
@pytest.mark.parametrize(("num_splits", "block_m"), [(3, None), (1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_fp8_cache(num_splits, block_m, dtype):
    """bf16 queries over an FP8 cache dot in float16 (decode and prefill tiles), float32
    queries in float32."""
    q, kv, meta = random_batch(*MIXED, 4, 2, 16, 16, dtype, DEV, seed=num_splits)
    kv8 = kv.to(FP8)
    ref = paged_attention_ref(q, kv8, meta, 0.25, k_scale=0.7, v_scale=1.3)
    out = triton_paged_attention(
        q, kv8, meta, 0.25, num_splits=num_splits, block_m=block_m, k_scale=0.7, v_scale=1.3
    )
    exact = dtype == torch.float32 and not HAS_CUDA
    torch.testing.assert_close(out, ref, atol=1e-4 if exact else 2e-2, rtol=2e-2)
    if dtype == torch.bfloat16:
        assert relative_error(out, ref) < 1e-2


# GPU: Llama-3-8B linear shapes (N, K), bf16 activations.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 2048])
def test_gpu_fp8_linear_paths(m):
    """`fp8_linear`'s GPU paths against their references: up to SMALL_M rows the weight-only
    kernel, above it activation quantization and scaled_mm (per channel) or Triton (per block)."""
    small = m <= fp8.SMALL_M
    ref_fn = fp8.fp8_weight_only_ref if small else fp8.fp8_linear_ref
    for n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda") * 0.02
        for group in (None, 128):
            wq, ws = fp8.quantize_rows(w, group)
            out = fp8.fp8_linear(x, wq, ws, None, group)
            ref = ref_fn(x, wq, ws, None, group)
            assert out.dtype == torch.bfloat16
            assert relative_error(out, ref) < 1e-2, (m, n, k, group)
            if small:  # and not what activation quantization would give (~3% off)
                assert relative_error(out, fp8.fp8_linear_ref(x, wq, ws, None, group)) > 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 512])
def test_gpu_fp8_silu_mul_linear_is_unfused(m):
    """The down projection with silu fused into its input quantization (M > SMALL_M) gives
    exactly the unfused result, per channel and per block."""
    from pagedserve.kernels.activation import silu_and_mul

    gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device="cuda") * 0.02
    for group in (None, 128):
        wq, ws = fp8.quantize_rows(w, group)
        fused = fp8.fp8_silu_mul_linear(gate_up, wq, ws, None, group)
        assert torch.equal(fused, fp8.fp8_linear(silu_and_mul(gate_up), wq, ws, None, group))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, ELEMENTWISE_SPLIT, DOT])
def test_gpu_fp8_gemv_in_cuda_graph(config):
    """Captured once, replayed on new activations: the eager result (a K split's zeroed
    float32 buffer and cast are captured too)."""
    for m in (1, 8):
        x, wq, ws, bias = gemv_case(m, 4096, 4096, None, torch.bfloat16)
        triton_fp8_gemv(x, wq, ws, bias, None, config)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_fp8_gemv(x, wq, ws, bias, None, config)
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = triton_fp8_gemv(x, wq, ws, bias, None, config)
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
        assert relative_error(out, fp8.fp8_weight_only_ref(x, wq, ws, bias, None)) < 1e-2


@pytest.mark.gpu
def test_gpu_fp8_decode_attention():
    q, kv, meta = random_batch([4000, 17, 900], [1, 1, 1], 32, 8, 128, 16, torch.bfloat16, "cuda")
    kv8 = kv.to(FP8)
    out = triton_paged_attention(q, kv8, meta, 128**-0.5, k_scale=0.5, v_scale=2.0)
    ref = paged_attention_ref(q, kv8, meta, 128**-0.5, k_scale=0.5, v_scale=2.0)
    assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_fp8_gemm_timing():
    from triton.testing import do_bench_cudagraph

    for n, k in SHAPES:
        for m in (1, 256, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            times = {"bf16": do_bench_cudagraph(lambda x=x, w=w: x @ w.t(), return_mode="median")}
            for name, group in (("fp8 ch", None), ("fp8 blk", 128)):
                wq, ws = fp8.quantize_rows(w, group)
                times[name] = do_bench_cudagraph(
                    lambda x=x, wq=wq, ws=ws, g=group: fp8.fp8_linear(x, wq, ws, None, g),
                    return_mode="median",
                )
            cols = "  ".join(f"{key} {ms * 1e3:8.1f} us" for key, ms in times.items())
            print(f"\nGEMM M={m:>5} N={n:>5} K={k:>5}: {cols}")


@tiny
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantize_is_norm_then_quantize(with_residual):
    """The quantizing RMSNorm hands over exactly what per-token quantization makes of the plain
    norm's output (scales to the bit), and the same new residual."""
    from pagedserve.kernels.triton_norm import triton_rms_norm

    dtype = torch.bfloat16
    x = (torch.randn(7, 300, device=DEV) * torch.logspace(-2, 2, 7, device=DEV)[:, None]).to(dtype)
    r = torch.randn_like(x) if with_residual else None
    w = (torch.rand(300, device=DEV) + 0.5).to(dtype)
    plain = triton_rms_norm(x, w, 1e-5, r)
    fused = triton_rms_norm(x, w, 1e-5, r, quantize=True)
    if with_residual:
        (plain, plain_r), (fused, fused_r) = plain, fused
        assert torch.equal(fused_r, plain_r)
    assert isinstance(fused, fp8.Fp8Rows) and fused.dtype == dtype
    q_ref, scale_ref = triton_quantize_rows(plain)
    torch.testing.assert_close(fused.scale, scale_ref, rtol=0, atol=0)
    same_fp8(fused.q, q_ref)


def test_fp8_linear_takes_rows_quantized_before():
    """`fp8_linear` of `Fp8Rows` is the per-token path on the same quantized rows (CPU: the
    reference; a GPU runs _scaled_mm on them, checked in the model test below)."""
    x = torch.randn(20, 64)
    wq, ws = fp8.quantize_rows(torch.randn(48, 64) * 0.1)
    bias = torch.randn(48)
    q, scale = fp8.quantize_rows(x)
    got = fp8.fp8_linear(fp8.Fp8Rows(q, scale, x.dtype), wq, ws, bias)
    torch.testing.assert_close(got, fp8.fp8_linear_ref(x, wq, ws, bias, None))
    assert not fp8.takes_fp8_rows(x, None)  # a CPU tensor: the norm never quantizes


@pytest.mark.gpu
def test_gpu_model_with_quantizing_norms_is_unchanged(tmp_path, monkeypatch):
    """A tiny Llama with `--quantization fp8` on the GPU: the norms hand the qkv and gate/up
    layers quantized rows above SMALL_M tokens (counted), and the logits are bit-equal to the
    model with that fusion off."""
    from pagedserve.config import ModelConfig
    from pagedserve.kernels import triton_norm
    from pagedserve.kernels.attention.metadata import build_attention_metadata
    from pagedserve.tests.tiny_models import tiny_model_dir
    from pagedserve.worker.models import build_model

    path = tiny_model_dir("llama", str(tmp_path))
    model = build_model(ModelConfig(model=path, quantization="fp8"), torch.bfloat16, "cuda")
    calls = []
    real = triton_norm.triton_rms_norm
    monkeypatch.setattr(triton_norm, "triton_rms_norm", lambda *a: calls.append(a[4]) or real(*a))

    layers = len(model.model.layers)

    def logits(fusions_off: str) -> torch.Tensor:
        monkeypatch.setenv("PAGEDSERVE_DISABLE_FUSIONS", fusions_off)
        settings.forget()
        tokens = torch.randint(3, 100, (40,), device="cuda")
        meta, positions = build_attention_metadata([0], [40], [list(range(5))], 8, device="cuda")
        shape = (5, 2, 8, model.num_kv_heads_per_rank, model.head_dim)
        caches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        with torch.no_grad():
            return model.compute_logits(model(tokens, positions, caches, meta))

    torch.manual_seed(0)
    fused = logits("")
    assert sum(calls) == 2 * layers, calls
    torch.manual_seed(0)
    assert torch.equal(fused, logits("norm-quant"))
    settings.forget()
