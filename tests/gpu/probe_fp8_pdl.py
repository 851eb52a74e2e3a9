"""GPU probe for the FP8 prefill GEMM and for programmatic dependent launch (PDL) at batch 1.

Part A (issue 17): at prefill M, `torch._scaled_mm` with row-wise scales (what fp8_linear runs)
against tensor-wise scales, each with and without fast accumulation, bf16 for reference; and the
kernel each one launches (torch profiler).
Part B (issue 18, W3): a W3-shaped chain of 32 layers of bf16 GEMVs (the 8B shapes) with small
one-program kernels between them (as norms, rotary, attention are), captured in one CUDA graph,
timed without PDL, with PDL (each kernel may launch while the one before drains), and with PDL
plus an L2 prefetch of each GEMV's first weight columns before it waits. Prints ms per chain
against the weight bytes at 3.0 TB/s.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _time_ms(fn, reps: int = 20) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=reps * 10, return_mode="median")


def _variants(m: int, n: int, k: int) -> dict:
    """The GEMMs of one (M, N, K): bf16, then fp8 with row-wise / tensor-wise scales, each with
    exact and fast accumulation."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    row = (torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5)
    one = torch.ones((), device="cuda")
    fns = {"bf16": lambda: x @ w.t()}
    for label, (sa, sb) in (("row", row), ("tensor", (one, one))):
        for fast in (False, True):
            fns[label + ("+fast" if fast else "")] = lambda sa=sa, sb=sb, fast=fast: (
                torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
            )
    return fns


def part_a() -> None:
    from torch.profiler import ProfilerActivity, profile

    keys = ("bf16", "row", "row+fast", "tensor", "tensor+fast")
    print(f"{'M':>5} {'N':>6} {'K':>6} " + " ".join(f"{key:>11}" for key in keys)
          + "  TFLOP/s row / row+fast, fast's max error")  # fmt: skip
    names = {}
    for m in (2048, 8192):
        for n, k in SHAPES:
            fns = _variants(m, n, k)
            ref = fns["row"]().float()
            err = (fns["row+fast"]().float() - ref).abs().max() / ref.abs().max()
            t = {key: _time_ms(fn) for key, fn in fns.items()}
            tf = {key: 2 * m * n * k / 1e9 / t[key] for key in keys}
            print(f"{m:>5} {n:>6} {k:>6} " + " ".join(f"{t[key] * 1e3:>11.0f}" for key in keys)
                  + f"  {tf['row']:.0f} / {tf['row+fast']:.0f}, {err:.1e}")  # fmt: skip
            if (m, n) == (8192, 6144):
                for key in keys[1:]:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fns[key]()
                        torch.cuda.synchronize()
                    names[key] = [e.key for e in prof.key_averages() if "sm90" in e.key]
    for key, kernels in names.items():
        print(f"kernel of {key}: {kernels}")


def graph_ms(fn, reps: int = 5) -> float:
    """Median ms of `fn` captured once in a CUDA graph: 7 samples of `reps` replays each (the
    probes' timer: probe_l2_prefetch.py and probe_gemm_silu.py import it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return sorted(times)[3]


@triton.jit
def _small_kernel(x_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tlc.gdc_launch_dependents()
        tlc.gdc_wait()
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + 1e-6)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    if PDL:
        tlc.gdc_launch_dependents()
        if PREFETCH > 0:  # the first PREFETCH tiles' 128-byte lines, one per row and 64 columns
            for p in tl.static_range(PREFETCH):
                lines = w_ptr + rn[:, None].to(tl.int64) * stride_w + p * BLOCK_K
                lines += tl.arange(0, BLOCK_K // 64)[None, :] * 64
                _prefetch_l2(lines)
        tlc.gdc_wait()
    x_ptrs = x_ptr + rm[:, None] * 0 + rk[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs, mask=(rm[:, None] < 1), other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(acc, 0)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty))


def part_b() -> None:
    torch.manual_seed(0)
    layers = 32
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01 for n, k in SHAPES]
               for _ in range(layers)]  # fmt: skip
    total_bytes = sum(n * k * 2 for n, k in SHAPES) * layers
    bufs = {n: torch.zeros(n, device="cuda", dtype=torch.bfloat16) for n in (4096, 6144, 28672)}
    tmp = torch.zeros(16384, device="cuda", dtype=torch.bfloat16)
    bufs[4096].normal_()

    def gemv(x, w, y, pdl, prefetch):
        n, k = w.shape
        block_n = 16 if n <= 8192 else 32
        _gemv_kernel[(n // block_n,)](
            x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=256, PDL=pdl,
            PREFETCH=prefetch, num_warps=4, num_stages=4, launch_pdl=pdl,
        )  # fmt: skip

    def small(x, y, n, pdl):
        _small_kernel[(1,)](x, y, N=n, PDL=pdl, num_warps=4, launch_pdl=pdl)

    def chain(pdl: bool, prefetch: int, smalls: int) -> None:
        h = bufs[4096]
        for qkv, o, gate_up, down in weights:
            small(h, tmp, 4096, pdl)  # input norm
            gemv(tmp, qkv, bufs[6144], pdl, prefetch)
            for _ in range(smalls):  # rotary + cache write, attention, merge
                small(bufs[6144], tmp, 4096, pdl)
            gemv(tmp, o, h, pdl, prefetch)
            small(h, tmp, 4096, pdl)  # post-attention norm
            gemv(tmp, gate_up, bufs[28672], pdl, prefetch)
            gemv(bufs[28672], down, h, pdl, prefetch)

    print(
        f"\nW3-shaped chain, 32 layers, {total_bytes / 1e9:.2f} GB of bf16 weights: "
        f"{total_bytes / 3.0e9:.3f} ms at 3.0 TB/s"
    )
    print(f"{'variant':<28} {'ms':>7} {'TB/s':>6}")
    for label, pdl, prefetch, smalls in [
        ("GEMVs only", False, 0, -1), ("no PDL", False, 0, 3), ("PDL", True, 0, 3),
        ("PDL + prefetch 1 tile", True, 1, 3), ("PDL + prefetch 2 tiles", True, 2, 3),
        ("PDL + prefetch 4 tiles", True, 4, 3), ("GEMVs only, PDL", True, 0, -1),
    ]:  # fmt: skip
        if smalls < 0:

            def fn(pdl=pdl, prefetch=prefetch):
                for ws in weights:
                    gemv(tmp, ws[0], bufs[6144], pdl, prefetch)
                    gemv(tmp, ws[1], bufs[4096], pdl, prefetch)
                    gemv(tmp, ws[2], bufs[28672], pdl, prefetch)
                    gemv(bufs[28672], ws[3], bufs[4096], pdl, prefetch)
        else:

            def fn(pdl=pdl, prefetch=prefetch, smalls=smalls):
                chain(pdl, prefetch, smalls)

        ms = graph_ms(fn)
        print(f"{label:<28} {ms:>7.3f} {total_bytes / ms / 1e9:>6.2f}")


if __name__ == "__main__":
    parts = sys.argv[1:] or ["a", "b"]
    if "a" in parts:
        part_a()
    if "b" in parts:
        part_b()
