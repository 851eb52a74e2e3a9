"""`x @ W^T (+ b)` for a few rows of bf16/fp16 (decode at batch <= 32), in Triton.

Why: at batch 1 a decode step is bound by reading the weights once, and cuBLAS' heuristics pick
split-K kernels for these shapes, which add a reduce kernel per matmul (four per layer, 128 launches
per token of Llama-3-8B). Here each program owns `BLOCK_N` output features and streams their whole
`[BLOCK_N, K]` slice of the weight, `BLOCK_K` columns at a time, into one `tl.dot` per step with the
rows of `x` padded to 16 (the smallest dot; the padding rows are never loaded), or to 32 above 16
rows: up to there a decode step still streams the weights at memory speed, where cuBLAS' small-M
kernels reach 2.2-2.7 TB/s (W5's batches of ~24 rows). The dot lets Triton's pipeliner keep
`num_stages` weight tiles in flight, and no program shares an output, so there is no reduce. The
weight is `[N, K]` row-major (the checkpoint's layout), read transposed.

`GATED`: the input is a merged gate/up output `[M, 2K]` and the kernel applies
`silu(gate) * up` (rounded to the model dtype like `silu_and_mul_ref`) while loading it, so the
MLP's down projection needs no separate activation kernel at small batches. With one row the
activation is computed once per tile, not for the 15 padding rows too (which made the gated form
~4x slower than the plain one: `bench_gemv --sweep`, 154 against 42 us for Llama-3-8B's down).

Launch configurations per weight shape come from `gemv_config`; `python -m
pagedserve.benchmarks.kernels.bench_gemv --sweep` times the candidates on a GPU, weights out of L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 32  # rows up to this may take the GEMV; more go to cuBLAS (a real GEMM)


@triton.jit
def _gemv_tile(
    x_ptr, w_ptr, bias_ptr, out_ptr, pid, M, N, K, stride_xm, stride_wn, stride_om, bias_n,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ONE_ROW: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        x_mask = m_ok[:, None] & k_ok[None, :]
        if GATED and ONE_ROW:  # silu(gate) * up of the one real row only (not of 16 padded)
            gate = tl.load(x_ptr + k * BLOCK_K + rk, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + k * BLOCK_K + rk, mask=k_ok, other=0.0)
            act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
            row = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            x = tl.where(rm[:, None] == 0, row[None, :], 0.0).to(up.dtype)  # [BM, BK]
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BM, BK]
        if GATED and not ONE_ROW:  # silu(gate) * up, each rounded to the model dtype as torch
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        if EVEN:  # N and K whole tiles (every 8B shape): unmasked, fully vectorized loads
            w = tl.load(w_ptrs)  # [BN, BK]
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < bias_n, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # rounded as x, then cast
    tl.store(o_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, h_ptr, M, N, K, NA, stride_xm, stride_wn, stride_om,
    stride_hm, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ONE_ROW: tl.constexpr,
    EVEN: tl.constexpr, SHRINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Programs past the weight's tiles (`SHRINK`) take the LoRA slots' A `[NA, K]` instead:
    `h = x A^T` beside `out = x W^T`, the same tile walk (A rows out of L2 or HBM like W's).
    One inlined walk with its operands chosen per program: two walks (an if and an else) each
    held their pipeline stages, 256 KB of shared memory for qkv, over an H100's 227 KB."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, BLOCK_N)
    bias_n = N  # (a shrink's tile has no bias: 0)
    if SHRINK:  # noqa: SIM102 (compile time) one tile walk for both: two would double the smem
        if pid >= tiles:
            pid, N, stride_wn, stride_om, bias_n = pid - tiles, NA, K, stride_hm, 0 * N
            w_ptr, out_ptr = a_ptr, h_ptr
    _gemv_tile(
        x_ptr, w_ptr, bias_ptr, out_ptr, pid, M, N, K, stride_xm, stride_wn, stride_om, bias_n,
        HAS_BIAS, GATED, ONE_ROW, EVEN, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


def gemv_config(
    n: int, k: int, gated: bool = False, m: int = 1, elem_bytes: int = 2
) -> dict[str, int]:
    """BLOCK_N, BLOCK_K, warps and stages for an `[n, k]` weight: 32 x 512 tiles, 3 stages, 5
    for wide layers (gate/up, the LM head; the gated form pipelines two input tiles too, and at
    5 stages overflows an H100's shared memory, as do 32-row inputs). At M = 1 with the weights
    out of L2, as the decode chain reads them (`python -m
    pagedserve.benchmarks.kernels.bench_gemv --sweep`, H100, us per GEMV against cuBLAS): o_proj
    14.1 vs 15.6, down 41.6 vs 44.4, gate_up 79.6 vs 81.5, LM head 336.6 vs 374.7; the former
    16 x 256 x 4 stages: 14.7, 43.2, 84.0, 342.7."""
    stages = 5 if n > 8192 and not gated and m <= 16 else 3
    block_k = 512 if elem_bytes <= 2 else 256  # float32 tiles (tests) take half the columns
    return {"BLOCK_N": 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": stages}


def triton_gemv(
    x: torch.Tensor,  # [M, K] (GATED: [M, 2K]), M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,  # None: x.dtype
    config: dict[str, int] | None = None,  # bench sweeps
    shrink: tuple[torch.Tensor, torch.Tensor] | None = None,  # LoRA A [NA, K], h [M, NA]
) -> torch.Tensor:  # [M, N] in out_dtype
    """`F.linear(x, weight, bias)`, or with `gated` `F.linear(silu_and_mul(x), weight, bias)`;
    with `out_dtype` that result (rounded to x.dtype) cast to it. `shrink` (a, h): also
    `h = x a^T` (gated: of the activated x) in x's dtype, by extra programs of the same launch."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {x.shape}, {weight.shape}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if m > GEMV_MAX_M:
        raise ValueError(f"the GEMV takes at most {GEMV_MAX_M} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("x and weight need one dtype and contiguous rows")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_config(n, k, gated, m, x.element_size())
    a, h = shrink if shrink is not None else (weight, out)
    na = a.shape[0] if shrink is not None else 0
    if shrink is not None:
        assert a.shape[1] == k and a.is_contiguous() and h.shape == (m, na) and h.stride(1) == 1
    grid = (triton.cdiv(n, cfg["BLOCK_N"]) + triton.cdiv(na, cfg["BLOCK_N"]),)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else out, out, a, h, m, n, k, na,
        x.stride(0), weight.stride(0), out.stride(0), h.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, ONE_ROW=m == 1,
        EVEN=(n % cfg["BLOCK_N"] == 0 and na % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0),
        SHRINK=shrink is not None, BLOCK_M=16 if m <= 16 else 32, **cfg,
    )  # fmt: skip
    return out
