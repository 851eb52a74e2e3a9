"""Triton kernels against their torch references.

Without a GPU the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, which
tests/conftest.py sets before anything imports triton) at tiny sizes; with one, the same tiny
tests run compiled, and the `gpu`-marked tests add Llama-3-8B sizes in bf16, a CUDA-graph capture
and a timing printout.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from triton_env import HAS_CUDA, HAS_TRITON, needs_triton, tiny

if not HAS_TRITON and sys.platform == "linux":  # the test extra has it there: never skip
    raise ImportError("triton is not installed (pip install -e '.[test]')")

pytestmark = needs_triton

if HAS_TRITON:
    from pagedserve import settings
    from pagedserve.benchmarks.kernels.bench_kernels import random_batch, relative_error
    from pagedserve.kernels.activation import silu_and_mul_ref
    from pagedserve.kernels.attention.reference import paged_attention_ref, write_kv_cache_ref
    from pagedserve.kernels.attention.selection import select_backend
    from pagedserve.kernels.attention.triton import choose_num_splits, triton_paged_attention
    from pagedserve.kernels.moe import fused_moe_ref, select_experts
    from pagedserve.kernels.norm import rms_norm
    from pagedserve.kernels.rotary import rope_config
    from pagedserve.kernels.triton_activation import triton_silu_and_mul
    from pagedserve.kernels.triton_cache import triton_write_kv_cache
    from pagedserve.kernels.triton_moe import align_by_expert, triton_fused_moe
    from pagedserve.kernels.triton_norm import triton_rms_norm
    from pagedserve.kernels.triton_rotary import triton_rotary_embedding
    from pagedserve.worker.layers.attention import Attention
    from pagedserve.worker.layers.norm import RMSNorm
    from pagedserve.worker.layers.rotary import RotaryEmbedding

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = dict(atol=2e-2, rtol=2e-2) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)  # tf32 dots on GPU
LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}

# (cached tokens, new tokens) per row: decodes, prefill chunks with and without earlier context.
MIXED = ([0, 37, 70, 5, 100, 16], [9, 1, 1, 20, 1, 16])


@tiny
@pytest.mark.parametrize(
    ("block_size", "hq", "num_splits", "window", "block_m", "softcap"),
    [
        (16, 4, 1, None, None, None),
        (16, 4, 2, 9, None, 0.5),  # Gemma 2: soft-capped scores, windowed
        (16, 4, 3, None, None, None),  # split-K forced on a mixed batch
        (32, 4, 2, 7, 32, None),  # sliding window, larger tiles
        (16, 6, 1, None, 16, None),  # GQA group 3: padded to 4 rows per token
        (32, 2, 4, None, None, None),  # MHA; more splits than some rows have KV tiles
    ],
)
def test_attention_mixed_batch(block_size, hq, num_splits, window, block_m, softcap):
    q, kv, meta = random_batch(*MIXED, hq, 2, 16, block_size, torch.float32, DEV, seed=hq)
    ref = paged_attention_ref(q, kv, meta, 0.25, window, softcap)
    out = triton_paged_attention(
        q, kv, meta, 0.25, window, softcap, num_splits=num_splits, block_m=block_m
    )
    torch.testing.assert_close(out, ref, **TOL)


@tiny
def test_attention_decode_auto_splits():
    computed = [700, 5, 64]
    q, kv, meta = random_batch(computed, [1, 1, 1], 4, 2, 16, 16, torch.float32, DEV, seed=1)
    assert choose_num_splits(3, 2, 1, meta.max_seq_len, num_sms=132) > 1
    out = triton_paged_attention(q, kv, meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, kv, meta, 0.25), **TOL)


def test_choose_num_splits_fills_resident_slots():
    """Decode programs x splits come near 3 per SM (132 SMs, 8 KV heads): W5's 24 rows at 16k
    take 2 splits, not 1; batches past the slots, prefills and short rows stay unsplit."""
    picks = {rows: choose_num_splits(rows, 8, 1, 32768, 132) for rows in (1, 12, 16, 24, 40, 256)}
    assert picks == {1: 32, 12: 4, 16: 3, 24: 2, 40: 1, 256: 1}
    assert choose_num_splits(24, 8, 2, 32768, 132) == 1  # a prompt in the batch
    assert choose_num_splits(1, 8, 1, 600, 132) == 2  # 256 keys a split at least


@tiny
def test_attention_module_writes_then_attends():
    """Through `Attention` (write, then attend): the Triton backend sees the step's own K/V."""
    computed, new = [20, 0, 7], [1, 12, 3]
    _, kv, meta = random_batch(computed, new, 4, 2, 16, 16, torch.float32, DEV, seed=2)
    q, k, v = (torch.randn(sum(new), h * 16, device=DEV) for h in (4, 2, 2))
    kv_ref = kv.clone()
    ref = Attention(4, 2, 16, 0.25, backend=paged_attention_ref)(q, k, v, kv_ref, meta)
    out = Attention(4, 2, 16, 0.25, backend=triton_paged_attention)(q, k, v, kv, meta)
    torch.testing.assert_close(out, ref, **TOL)


@tiny
def test_attention_rejects_bad_inputs():
    q, kv, meta = random_batch([3], [1], 4, 2, 16, 16, torch.float32, DEV)
    with pytest.raises(ValueError, match="dtype"):
        triton_paged_attention(q.half(), kv, meta, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        triton_paged_attention(q[:, :3], kv, meta, 0.25)


@tiny
def test_write_kv_cache_skips_padding():
    kv = torch.randn(6, 2, 16, 2, 16, device=DEV)
    key, value = torch.randn(5, 2, 16, device=DEV), torch.randn(5, 2, 16, device=DEV)
    slots = torch.tensor([3, -1, 40, 94, -1], device=DEV)
    expected = kv.clone()
    write_kv_cache_ref(key, value, expected, slots)
    assert torch.equal(expected[5, :, 15], kv[5, :, 15])  # -1 did not wrap to the last slot
    strided = torch.randn(5, 6, 16, device=DEV)[:, 1:3]  # [T, Hkv, D] view with a row stride
    write_kv_cache_ref(strided, value, expected, slots)
    triton_write_kv_cache(key, value, kv, slots)
    triton_write_kv_cache(strided, value, kv, slots)
    assert torch.equal(kv, expected)


@tiny
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    w = torch.randn(48, device=DEV, dtype=dtype)
    x, r = (torch.randn(7, 48, device=DEV, dtype=dtype) for _ in range(2))
    tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)  # interpreter truncates
    out, new_r = triton_rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(out, rms_norm(x + r, w, 1e-5), **tol)
    torch.testing.assert_close(new_r, x + r, **tol)
    heads = torch.randn(5, 24, device=DEV, dtype=dtype)[:, 4:20].unflatten(-1, (2, 8))  # qk-norm
    w8 = torch.randn(8, device=DEV, dtype=dtype)
    torch.testing.assert_close(triton_rms_norm(heads, w8, 1e-6), rms_norm(heads, w8, 1e-6), **tol)
    assert isinstance(RMSNorm(8).to(DEV)(heads.float()), torch.Tensor)  # the dispatching module


@tiny
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_in_place_on_qkv_views(partial):
    cfg = rope_config({**LLAMA3_ROPE, "partial_rotary_factor": partial})
    rope = RotaryEmbedding(16, 128, cfg)
    qkv = torch.randn(6, (4 + 2 + 2) * 16)
    pos = torch.randint(0, 128, (6,))
    ref_q, ref_k = rope(pos, qkv[:, :64], qkv[:, 64:96])  # CPU: the reference
    qkv = qkv.to(DEV)
    q, k = qkv[:, :64], qkv[:, 64:96]  # strided views, as the model passes them
    v_before = qkv[:, 96:].clone()
    out_q, out_k = triton_rotary_embedding(pos.to(DEV), q, k, rope.cos_sin_cache.to(DEV), 16)
    assert out_q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :64].cpu(), ref_q, **TOL)
    torch.testing.assert_close(qkv[:, 64:96].cpu(), ref_k, **TOL)
    assert torch.equal(qkv[:, 96:], v_before)


@tiny
def test_silu_and_mul():
    x = torch.randn(3, 2, 80, device=DEV)
    torch.testing.assert_close(triton_silu_and_mul(x), silu_and_mul_ref(x), **TOL)


def moe_case(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEV, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEV, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEV, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEV)
    return x, w13, w2, *select_experts(logits, top_k, renormalize=True)


@tiny
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(7, 4, 2, 16), (40, 8, 3, 16)])
def test_fused_moe(num_tokens, num_experts, top_k, block_m):
    """Grouped GEMMs over tokens sorted by expert equal the per-expert loop (experts left unused
    by a small batch included); the alignment puts each expert's pairs in whole row blocks."""
    x, w13, w2, weights, ids = moe_case(num_tokens, num_experts, top_k, 32, 24, torch.float32)
    out = triton_fused_moe(x, w13, w2, weights, ids, block_m=block_m)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **TOL)
    pairs, experts = align_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    for b, expert in enumerate(experts.tolist()):
        rows = pairs[b * block_m : (b + 1) * block_m]
        real = rows[rows < flat.numel()]
        assert expert >= 0 or real.numel() == 0
        assert (flat[real] == expert).all()
    assert sorted(pairs[pairs < flat.numel()].tolist()) == list(range(flat.numel()))


def test_backend_choice(monkeypatch):
    from pagedserve.kernels.attention.cpu import cpu_paged_attention

    assert select_backend(torch.device("cpu")) is cpu_paged_attention
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    settings.forget()
    assert select_backend(torch.device("cpu")) is paged_attention_ref
    for value, error in (("flash2", "not one of"), ("triton", "CUDA device")):
        monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", value)
        settings.forget()
        with pytest.raises(ValueError, match=error):
            select_backend(torch.device("cpu"))
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND")
    settings.forget()
    if HAS_CUDA:  # every step kind on Triton (eager mixed steps split into decode + prompt)
        chosen = select_backend(torch.device("cuda"))
        assert set(chosen.backends.values()) == {triton_paged_attention}


# GPU: Llama-3-8B shapes (32 q heads, 8 kv heads, head_dim 128), bf16.


def _check_gpu_attention(computed, new, seed=0, **kwargs):
    q, kv, meta = random_batch(computed, new, 32, 8, 128, 16, torch.bfloat16, "cuda", seed)
    out = triton_paged_attention(q, kv, meta, 128**-0.5, **kwargs)
    err = relative_error(out, paged_attention_ref(q, kv, meta, 128**-0.5))
    assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_decode_batch():
    rng = torch.Generator().manual_seed(0)
    computed = torch.randint(1, 4096, (64,), generator=rng).tolist()
    _check_gpu_attention(computed, [1] * 64)
    _check_gpu_attention([4000], [1])  # one long row: split-K
    _check_gpu_attention([3000, 17], [1, 1], num_splits=8)


@pytest.mark.gpu
def test_gpu_mixed_batch():
    computed = [1024, 1024] + torch.randint(1, 4096, (30,)).tolist()
    _check_gpu_attention(computed, [512, 512] + [1] * 30)
    _check_gpu_attention([0, 1024], [700, 512], seed=1)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph():
    """Captured once at the longest context, replayed with new lengths: no host syncs inside."""
    q, kv, meta = random_batch(
        [4095, 100, 2000, 9], [1] * 4, 32, 8, 128, 16, torch.bfloat16, "cuda"
    )
    triton_paged_attention(q, kv, meta, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged_attention(q, kv, meta, 0.1)
    meta.seq_lens.copy_(torch.tensor([50, 4096, 1, 300], dtype=torch.int32))
    meta.seq_lens_cpu[:] = [50, 4096, 1, 300]
    graph.replay()
    assert relative_error(out, paged_attention_ref(q, kv, meta, 0.1)) < 1e-2


@pytest.mark.gpu
def test_gpu_one_attention_variant_for_eager_and_graph_layouts():
    """A step's table width and its metadata's alignment do not pick a new compile: an eager
    prefill chunk with a width that is a multiple of 16 reuses what a graph's layout (metadata at
    unaligned offsets of one buffer) compiled, so no compile waits for a long prompt mid-serving."""
    from pagedserve.kernels.attention.triton_kernels import _paged_attention_kernel

    def compiled() -> int:
        return sum(len(cache[0]) for cache in _paged_attention_kernel.device_caches.values())

    q, kv, meta = random_batch([40, 0], [1, 300], 32, 8, 128, 16, torch.bfloat16, "cuda")
    ref = triton_paged_attention(q, kv, meta, 0.1)  # width 19
    before = compiled()
    buf = torch.zeros(1 + 3 + 2 + 2 * 32, dtype=torch.int32, device="cuda")
    qsl, seq_lens = buf[1:4], buf[4:6]  # 4-byte offsets: not 16-byte aligned
    tables = buf[6:].view(2, 32)  # width 32
    qsl.copy_(meta.query_start_loc)
    seq_lens.copy_(meta.seq_lens)
    tables[:, : meta.block_tables.shape[1]] = meta.block_tables
    eager = replace(meta, block_tables=torch.nn.functional.pad(meta.block_tables, (0, 13)))
    graph = replace(meta, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables)
    for m in (eager, graph):
        torch.testing.assert_close(triton_paged_attention(q, kv, m, 0.1), ref)
    assert compiled() == before


@pytest.mark.gpu
def test_gpu_elementwise_kernels():
    x, r = (torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, new_r = triton_rms_norm(x, w, 1e-5, r)
    assert torch.equal(new_r, x + r)
    assert relative_error(out, rms_norm(x + r, w, 1e-5)) < 1e-2
    gu = torch.randn(512, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    assert relative_error(triton_silu_and_mul(gu), silu_and_mul_ref(gu)) < 1e-2


# Decode attention streams the KV cache: at batch 256 x 2048 tokens (1 GiB of bf16 K/V) any
# datacenter GPU since the A100 (1.5-4.8 TB/s) gives a sound kernel well over this; a kernel that
# serializes or falls back to the torch reference gets far less.
MIN_DECODE_GBPS = 300


@pytest.mark.gpu
def test_gpu_decode_timing():
    from triton.testing import do_bench_cudagraph

    gbps = 0.0
    for batch in (1, 64, 256):
        q, kv, meta = random_batch([2047] * batch, [1] * batch, 32, 8, 128, 16, torch.bfloat16, DEV)
        fn = lambda q=q, kv=kv, meta=meta: triton_paged_attention(q, kv, meta, 0.1)  # noqa: E731
        ms = do_bench_cudagraph(fn, return_mode="median")
        gbps = batch * 2048 * 8 * 128 * 2 * 2 / ms / 1e6
        print(f"\ndecode attention batch {batch:>3} ctx 2048: {ms * 1e3:8.1f} us {gbps:6.0f} GB/s")
    assert gbps > MIN_DECODE_GBPS, f"decode attention at batch 256 reads only {gbps:.0f} GB/s"


@pytest.mark.gpu
def test_gpu_fused_moe_qwen3_30b_a3b_shape():
    """Qwen3-30B-A3B's MoE layer (128 experts, top 8, hidden 2048, expert intermediate 768) in
    bf16: equal to the reference, and timed (weight bandwidth at small batches, TFLOP/s at large;
    H100 SXM peaks: ~3.35 TB/s, ~990 dense bf16 TFLOP/s)."""
    from triton.testing import do_bench_cudagraph

    for batch in (1, 64, 2048):
        case = moe_case(batch, 128, 8, 2048, 768, torch.bfloat16)
        assert relative_error(triton_fused_moe(*case), fused_moe_ref(*case)) < 1e-2
        ms = do_bench_cudagraph(lambda case=case: triton_fused_moe(*case), return_mode="median")
        ids = case[-1]
        touched = ids.unique().numel()
        gbs = touched * 3 * 768 * 2048 * 2 / ms / 1e6
        tflops = batch * 8 * 3 * 2 * 768 * 2048 / ms / 1e9
        print(f"\nfused moe batch {batch:>4} ({touched:>3} experts): {ms * 1e3:8.1f} us "
              f"{gbs:6.0f} GB/s of expert weights {tflops:6.1f} TFLOP/s")  # fmt: skip
