"""The decode-latency kernels against their torch references: the small-batch GEMV (plain, with a
bias, with silu_and_mul folded in) and rotary fused with the KV-cache write; plus the switches
that turn each fusion off (`PAGEDSERVE_DISABLE_FUSIONS`).

Without a GPU the kernels run under the Triton interpreter, as in test_triton_kernels.py, in
float32 and float16 (the interpreter's bfloat16 `tl.dot` returns garbage); with one, the same
tiny tests run compiled and the `gpu`-marked tests add Llama-3-8B shapes in bf16 and a CUDA-graph
capture.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import HAS_CUDA, HAS_TRITON, needs_triton, tiny

pytestmark = needs_triton

from pagedserve import settings  # noqa: E402
from pagedserve.kernels import backend  # noqa: E402
from pagedserve.kernels.activation import silu_and_mul_ref  # noqa: E402
from pagedserve.kernels.attention.reference import write_kv_cache_ref  # noqa: E402
from pagedserve.kernels.linear import gated_linear, linear  # noqa: E402
from pagedserve.kernels.rotary import rope_config  # noqa: E402
from pagedserve.worker.layers.rotary import RotaryEmbedding  # noqa: E402

if HAS_TRITON:
    from pagedserve.kernels.triton_gemv import triton_gemv
    from pagedserve.kernels.triton_rope_cache import triton_rope_and_cache

DEV = "cuda" if HAS_CUDA else "cpu"
SMALL = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2)  # several K steps at tiny sizes


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return dict(atol=2e-2, rtol=2e-2) if HAS_CUDA else dict(atol=1e-4, rtol=1e-4)
    return dict(atol=3e-2, rtol=2e-2)


@tiny
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 200), (3, 64, 128), (8, 33, 130), (21, 40, 70)])
def test_gemv(dtype, m, n, k):
    """Rows 1-21 (16- and 32-row tiles), N not a multiple of the tile, K with a ragged last
    step; bias; gated input."""
    gen = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b, xg = torch.randn(n, generator=gen), torch.randn(m, 2 * k, generator=gen)
    x, w, b, xg = (t.to(DEV, dtype) for t in (x, w, b, xg))
    want = F.linear(x.float(), w.float(), b.float())
    got = triton_gemv(x, w, b, config=SMALL)
    torch.testing.assert_close(got.float(), want, **_tol(dtype))
    wide = triton_gemv(x, w, b, out_dtype=torch.float32, config=SMALL)  # the LM head's logits
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())  # rounded, then cast
    want = F.linear(silu_and_mul_ref(xg).float(), w.float())
    got = triton_gemv(xg, w, None, gated=True, config=SMALL).float()
    torch.testing.assert_close(got, want, **_tol(dtype))
    strided = torch.randn(m, k + 8, generator=gen).to(DEV, dtype)[:, 8:]  # a row stride
    torch.testing.assert_close(
        triton_gemv(strided, w).float(), F.linear(strided.float(), w.float()), **_tol(dtype)
    )


@tiny
def test_gemv_rejects_bad_inputs():
    w = torch.randn(16, 32, device=DEV)
    with pytest.raises(ValueError, match="at most"):
        triton_gemv(torch.randn(33, 32, device=DEV), w)
    with pytest.raises(ValueError, match="does not fit"):
        triton_gemv(torch.randn(2, 32, device=DEV), w, gated=True)


def test_linear_dispatch_on_cpu():
    """CPU keeps the torch reference: `linear` is F.linear, `gated_linear` the unfused pair."""
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, None), F.linear(x, w))
    xg = torch.randn(2, 16, dtype=torch.bfloat16)
    assert torch.equal(gated_linear(xg, w, None), F.linear(silu_and_mul_ref(xg), w))


def _rope_case(partial: float, cache_dtype: torch.dtype, model_dtype: torch.dtype):
    cfg = rope_config({"rope_theta": 10000.0, "partial_rotary_factor": partial})
    rope = RotaryEmbedding(16, 64, cfg)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen).to(model_dtype)
    positions = torch.randint(0, 64, (5,), generator=gen)
    slots = torch.tensor([3, -1, 40, 63, 17])  # -1: CUDA-graph padding, writes nowhere
    kv = torch.randn(4, 2, 16, 2, 16, generator=gen).to(cache_dtype)
    return rope, qkv, positions, slots, kv


def _rope_reference(rope, qkv, positions, slots, kv, scales=(1.0, 1.0)):
    """Rotary on the CPU, then the reference cache write: the unfused pair."""
    q, k = rope(positions, qkv[:, :64], qkv[:, 64:96])
    kv = kv.clone()
    v = qkv[:, 96:]
    write_kv_cache_ref(k.view(5, 2, 16), v.reshape(5, 2, 16), kv, slots, *scales)
    return q, kv


@tiny
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_cache(partial, dtype):
    rope, qkv, positions, slots, kv = _rope_case(partial, dtype, dtype)
    want_q, want_kv = _rope_reference(rope, qkv, positions, slots, kv)
    qkv_d, kv_d = qkv.to(DEV), kv.to(DEV)
    k_before = qkv_d[:, 64:96].clone()
    q = triton_rope_and_cache(
        positions.to(DEV), qkv_d[:, :64], qkv_d[:, 64:96], qkv_d[:, 96:], kv_d, slots.to(DEV),
        rope.cos_sin_cache.to(DEV),
    )  # fmt: skip
    assert q.data_ptr() == qkv_d.data_ptr()  # rotated in place
    torch.testing.assert_close(q.cpu(), want_q, **_tol(dtype))
    torch.testing.assert_close(kv_d.cpu(), want_kv, **_tol(dtype))
    assert torch.equal(qkv_d[:, 64:96], k_before)  # keys go to the cache only


def _qkv_rope_reference(x, w, bias, rope, positions, slots, kv, heads, scales):
    """F.linear, rotary on the CPU, the reference cache write: what the fused kernel replaces."""
    hq, hkv, d = heads
    qkv = F.linear(x, w, bias)
    q, k = rope(positions, qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d])
    kv = kv.clone()
    v = qkv[:, (hq + hkv) * d :]
    write_kv_cache_ref(k.view(-1, hkv, d), v.reshape(-1, hkv, d), kv, slots, *scales)
    return q, kv


@tiny
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("m", "head_dim", "bias", "block_h"),
    [
        (1, 32, False, 16),
        (5, 64, True, 16),
        (20, 32, True, 16),
        (1, 32, False, 8),
        (5, 64, True, 8),
    ],  # fmt: skip
)
def test_qkv_rope_cache(dtype, m, head_dim, bias, block_h):
    """The qkv GEMV with rotary and the cache write in its epilogue: the unfused reference's
    query and cache, padding rows (slot -1) writing nothing, a bias (Qwen2), 32-row tiles, and
    8-pair programs (a config's BLOCK_H)."""
    from pagedserve.kernels.triton_qkv_rope import qkv_rope_applies, triton_qkv_rope_cache

    heads, k = (4, 2, head_dim), 72  # K not a multiple of BLOCK_K: the masked loads
    n = (heads[0] + 2 * heads[1]) * head_dim
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(m, k, generator=gen) / k**0.5).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    rope = RotaryEmbedding(head_dim, 64, rope_config({"rope_theta": 10000.0}))
    positions = torch.randint(0, 64, (m,), generator=gen)
    slots = torch.randperm(64, generator=gen)[:m]
    slots[m // 2] = -1
    kv = torch.randn(4, 2, 16, heads[1], head_dim, generator=gen).to(dtype)
    want_q, want_kv = _qkv_rope_reference(x, w, b, rope, positions, slots, kv, heads, (1.0, 1.0))
    assert qkv_rope_applies(x, w, head_dim, head_dim) and not qkv_rope_applies(x, w, 16, 32)
    kv_d = kv.to(DEV)
    q = triton_qkv_rope_cache(
        x.to(DEV), w.to(DEV), b.to(DEV) if bias else None, positions.to(DEV),
        rope.cos_sin_cache.to(DEV), kv_d, slots.to(DEV), heads[0],
        config=dict(BLOCK_K=32, num_warps=4, num_stages=2, BLOCK_H=block_h),
    )  # fmt: skip
    torch.testing.assert_close(q.cpu(), want_q, **_tol(dtype))
    torch.testing.assert_close(kv_d.cpu(), want_kv, **_tol(dtype))
    with pytest.raises(ValueError, match="heads"):
        triton_qkv_rope_cache(x, w[:-1], None, positions, rope.cos_sin_cache, kv, slots, 4)


def test_qkv_rope_config_keeps_more_in_flight_when_programs_are_few():
    """80 pair programs (Llama-3-70B's qkv at `--tp 4`) on 132 SMs: 4 tiles of 512 columns in
    flight; 192 (Llama-3-8B's): 3 of 256; float32 rows (tests) and 32-row inputs: the GEMV's."""
    from pagedserve.kernels.triton_gemv import gemv_config
    from pagedserve.kernels.triton_qkv_rope import qkv_rope_config

    few = qkv_rope_config(2560, 8192, 80, 1, 2, 132)
    many = qkv_rope_config(6144, 4096, 192, 1, 2, 132)
    assert (few["BLOCK_K"], few["num_stages"]) == (512, 4)
    assert (many["BLOCK_K"], many["num_stages"]) == (256, 3)
    assert qkv_rope_config(2560, 8192, 80, 1, 4, 132) == gemv_config(2560, 8192, elem_bytes=4)
    assert qkv_rope_config(2560, 8192, 80, 32, 2, 132) == gemv_config(2560, 8192, m=32)


TINY_LLAMA = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    num_hidden_layers=2, vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=256,
    rope_theta=10000.0, model_type="llama",
)  # fmt: skip


def _decode_logits(monkeypatch, fast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A tiny fp16 Llama prefills three prompts, then decodes one token each (3 rows: GEMV
    sizes); with `fast` every op takes its Triton path (on a CPU, interpreted)."""
    from pagedserve.kernels import activation, linear, rotary
    from pagedserve.kernels.attention import cache_write
    from pagedserve.kernels.attention.metadata import build_attention_metadata
    from pagedserve.kernels.attention.reference import paged_attention_ref
    from pagedserve.kernels.attention.triton import triton_paged_attention
    from pagedserve.worker.layers import norm
    from pagedserve.worker.models import _default_dtype
    from pagedserve.worker.models.llama import LlamaForCausalLM

    for module in (norm, rotary, activation, linear):
        monkeypatch.setattr(module, "use_triton", lambda x: fast)
    monkeypatch.setattr(cache_write, "use_triton_cache_write", lambda kv: fast)
    torch.manual_seed(0)
    backend = triton_paged_attention if fast else paged_attention_ref
    with _default_dtype(torch.float16), torch.device(DEV):  # as build_model makes it
        model = LlamaForCausalLM(TINY_LLAMA, backend)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    tables = [[0, 1], [2], [3, 4, 5]]
    kv = [torch.zeros(8, 2, 16, 2, 32, dtype=torch.float16, device=DEV) for _ in range(2)]
    meta, pos = build_attention_metadata([0, 0, 0], [7, 9, 30], tables, 16, DEV)
    model(torch.arange(46, device=DEV) + 3, pos, kv, meta)
    meta, pos = build_attention_metadata([7, 9, 30], [1, 1, 1], tables, 16, DEV)
    hidden = model(torch.tensor([5, 6, 7], device=DEV), pos, kv, meta)
    return model.compute_logits(hidden), kv


@tiny
def test_decoder_through_fused_kernels(monkeypatch):
    """The whole decoder with rotary fused into the cache write (the prefill) and into the qkv
    GEMV (the decode), the GEMV for every other projection and the LM head, silu_and_mul inside
    the down projection: the torch reference's logits and cache."""
    from pagedserve.kernels import triton_gemv, triton_qkv_rope, triton_rope_cache

    calls: list[str] = []
    for module, name in (
        (triton_gemv, "triton_gemv"),
        (triton_rope_cache, "triton_rope_and_cache"),
        (triton_qkv_rope, "triton_qkv_rope_cache"),
    ):
        fn = getattr(module, name)

        def traced(*a, fn=fn, name=name, **k):
            calls.append(name + ("-gated" if k.get("gated") else ""))
            return fn(*a, **k)

        monkeypatch.setattr(module, name, traced)
    want_logits, want_kv = _decode_logits(monkeypatch, fast=False)
    assert not calls
    logits, kv = _decode_logits(monkeypatch, fast=True)
    assert sorted(set(calls)) == [
        "triton_gemv", "triton_gemv-gated", "triton_qkv_rope_cache", "triton_rope_and_cache",
    ]  # fmt: skip
    torch.testing.assert_close(logits, want_logits, atol=1e-2, rtol=1e-2)
    for got, want in zip(kv, want_kv, strict=True):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_fusion_switches(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_DISABLE_FUSIONS", "gemv, rope-cache")
    settings.forget()
    try:
        assert not backend.fusion_enabled("gemv") and backend.fusion_enabled("graph-head")
        monkeypatch.setenv("PAGEDSERVE_DISABLE_FUSIONS", "all")
        settings.forget()
        assert not any(backend.fusion_enabled(name) for name in backend.FUSIONS)
        monkeypatch.setenv("PAGEDSERVE_DISABLE_FUSIONS", "gemv,rotary")
        settings.forget()
        with pytest.raises(ValueError, match="rotary"):
            backend.fusion_enabled("gemv")
    finally:
        monkeypatch.delenv("PAGEDSERVE_DISABLE_FUSIONS")
        settings.forget()


# GPU: Llama-3-8B shapes, bf16.
SHAPES_8B = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
def test_gpu_gemv_8b_shapes(n, k):
    from pagedserve.benchmarks.kernels.bench_kernels import relative_error

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    for m in (1, 2, 4, 8, 16, 24, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert relative_error(triton_gemv(x, w), F.linear(x, w)) < 1e-2
    xg = torch.randn(3, 2 * k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(silu_and_mul_ref(xg), w)
    assert relative_error(triton_gemv(xg, w, gated=True), ref) < 1e-2


@pytest.mark.gpu
def test_gpu_gemv_cuda_graph():
    """Captured once, replayed on new inputs: the GEMV reads its operands through the graph."""
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    linear(x, w, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, F.linear(x, w), atol=0.5, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_rope_and_cache(cache_dtype):
    rope, qkv, positions, slots, kv = _rope_case(1.0, torch.float32, torch.bfloat16)
    kv = kv.to(cache_dtype)
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    want_q, want_kv = _rope_reference(rope.cuda(), qkv.cuda(), positions.cuda(), slots.cuda(),
                                      kv.cuda(), scales)  # fmt: skip
    qkv_d, kv_d = qkv.cuda(), kv.cuda()
    q = triton_rope_and_cache(
        positions.cuda(), qkv_d[:, :64], qkv_d[:, 64:96], qkv_d[:, 96:], kv_d, slots.cuda(),
        rope.cos_sin_cache.cuda(), *scales,
    )  # fmt: skip
    torch.testing.assert_close(q, want_q)
    assert torch.equal(kv_d.float(), want_kv.float())


def test_l2_prefetch_only_on_gpu_decode_batches():
    """CPU tensors never fork a prefetch (and joining is then a no-op)."""
    from pagedserve.kernels import prefetch

    x = torch.randn(1, 64)
    assert not prefetch.prefetch_wanted(x)
    prefetch.prefetch_weight(x, torch.randn(64, 64))
    prefetch.join_prefetches(x)
    assert not prefetch._FORKED


@pytest.mark.gpu
def test_gpu_l2_prefetch_in_graph():
    """A prefetch forked on the side stream and joined, captured and replayed: the matmul after
    it reads the same weight and gives the same result; every fork is joined."""
    from pagedserve.kernels import prefetch
    from pagedserve.kernels.triton_prefetch import l2_prefetch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk L2 prefetch needs compute capability 9.0+")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert prefetch.prefetch_wanted(x) and not prefetch.prefetch_wanted(x.repeat(9, 1))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), 1 << 20, 1)

    def step():
        prefetch.prefetch_weight(x, w)
        out = linear(x, w, None)
        prefetch.join_prefetches(x)
        return out

    torch.testing.assert_close(step(), F.linear(x, w), atol=0.5, rtol=2e-2)
    assert not prefetch._FORKED
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert not prefetch._FORKED
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, F.linear(x, w), atol=0.5, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 7, 24])
def test_gpu_qkv_rope_cache_8b(cache_dtype, m):
    """Llama-3-8B's qkv (32 + 8 + 8 heads of 128) fused with rotary and the cache write, against
    the GEMV then the rotary + cache kernel, bf16 and FP8 caches; then captured in a graph and
    replayed on new rows."""
    from pagedserve.kernels.triton_qkv_rope import triton_qkv_rope_cache

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    rope = RotaryEmbedding(128, 4096, rope_config({"rope_theta": 500000.0})).cuda()
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
    slots = torch.randperm(1024, device="cuda", generator=gen)[:m]
    slots[-1] = -1
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    kv = torch.zeros(64, 2, 16, 8, 128, device="cuda", dtype=cache_dtype)

    def reference():
        q, k, v = triton_gemv(x, w).split([4096, 1024, 1024], dim=-1)
        want_kv = kv.clone()
        q = triton_rope_and_cache(positions, q, k, v, want_kv, slots, rope.cos_sin_cache, *scales)
        return q, want_kv

    def fused():
        return triton_qkv_rope_cache(
            x, w, None, positions, rope.cos_sin_cache, kv, slots, 32, *scales
        )

    want_q, want_kv = reference()
    torch.testing.assert_close(fused(), want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kv.float(), want_kv.float(), atol=0.07, rtol=0.13)  # 1 FP8 ulp
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = fused()
    x.copy_(torch.randn_like(x))
    positions.copy_(torch.randint(0, 4096, (m,), device="cuda", generator=gen))
    graph.replay()
    want_q, want_kv = reference()
    torch.testing.assert_close(q, want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kv.float(), want_kv.float(), atol=0.07, rtol=0.13)  # 1 FP8 ulp
