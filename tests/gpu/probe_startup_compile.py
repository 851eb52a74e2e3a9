"""Probe (issue 18, W4): what the first prompt-sized forward compiles at start-up, and whether a
second process finds it on disk: times a fresh process's first quack SwiGLU GEMM and first FA4
prefill call (run it twice; the second run should load both from their caches).

    python tests/gpu/probe_startup_compile.py
"""

from __future__ import annotations

import os
import time

import torch


def _timed(label: str, fn) -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"{label:<40} {time.perf_counter() - t0:7.2f} s", flush=True)


def main() -> None:
    from pagedserve.kernels import swiglu_gemm
    from pagedserve.kernels.attention import flash as flash_attention

    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    _timed("import quack", swiglu_gemm._gemm_act)
    _timed("first swiglu_linear", lambda: swiglu_gemm.swiglu_linear(x, w))
    _timed("second swiglu_linear", lambda: swiglu_gemm.swiglu_linear(x, w))
    q = torch.randn(8192, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8192, 8, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 8192], device="cuda", dtype=torch.int32)
    fa = flash_attention._varlen_func
    _timed("import flash_attn.cute", fa)
    lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8192, max_seqlen_k=8192)
    _timed("first FA4 varlen", lambda: fa()(q, k, k, causal=True, **lens))
    print("QUACK_CACHE_DIR", os.environ.get("QUACK_CACHE_DIR"))
    print("FA4 cache", os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"))


if __name__ == "__main__":
    main()
