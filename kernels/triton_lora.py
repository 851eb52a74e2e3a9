"""Segmented LoRA shrink and expand in Triton (punica's SGMV pair), reference in kernels/lora.py.

A batch's tokens come in segments `[seg_starts[i], seg_starts[i+1])`, each with the device slot
of its adapter (`seg_slots[i]`, -1: the base model, skipped). Each program owns `BLOCK_M` rows
of one segment (so no two programs write one output row) and, in `expand`, `BLOCK_N` output
features. `shrink`: `h[rows] = x[rows] A_s^T` ([T, K] -> [T, R], float32); `expand`:
`y[rows] += h[rows] B_s^T` ([T, R] -> [T, N]). The rank is padded to a power of two >= 16 (the
smallest `tl.dot`); padding columns are masked, never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import dot_precision

BLOCK_M = 16


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_starts, seg_slots, K, R, stride_xm, stride_as, stride_ar,
    stride_hm, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_slots + seg)
    if slot < 0:
        return
    start = tl.load(seg_starts + seg)
    end = tl.load(seg_starts + seg + 1)
    rm = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    rr = tl.arange(0, BLOCK_R)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < end
    r_ok = rr < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k * BLOCK_K + rk
        k_ok = kk < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=m_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        a = tl.load(
            a_base + rr[:, None] * stride_ar + kk[None, :],
            mask=r_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    tl.store(
        h_ptr + rm[:, None].to(tl.int64) * stride_hm + rr[None, :], acc,
        mask=m_ok[:, None] & r_ok[None, :],
    )  # fmt: skip


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, seg_starts, seg_slots, N, R, stride_hm, stride_bs, stride_bn,
    stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    slot = tl.load(seg_slots + seg)
    if slot < 0:
        return
    start = tl.load(seg_starts + seg)
    end = tl.load(seg_starts + seg + 1)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    rm = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < end
    n_ok = rn < N
    r_ok = rr < R
    h = tl.load(
        h_ptr + rm[:, None].to(tl.int64) * stride_hm + rr[None, :],
        mask=m_ok[:, None] & r_ok[None, :], other=0.0,
    )  # fmt: skip
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None].to(tl.int64) * stride_bn + rr[None, :],
        mask=n_ok[:, None] & r_ok[None, :], other=0.0,
    )  # fmt: skip
    delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=PRECISION)  # [BM, BN] float32
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def triton_lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    seg_starts: torch.Tensor,  # [num_seg + 1] int32
    seg_slots: torch.Tensor,  # [num_seg] int32
    max_seg_len: int,
) -> torch.Tensor:  # [T, R] float32, zero on base-model rows
    assert x.dim() == 2 and x.stride(1) == 1 and lora_a.is_contiguous()
    assert lora_a.shape[2] == x.shape[1] and x.dtype == lora_a.dtype
    num_seg = seg_slots.shape[0]
    rank = lora_a.shape[1]
    h = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    if num_seg == 0 or max_seg_len == 0:
        return h
    grid = (num_seg, triton.cdiv(max_seg_len, BLOCK_M))
    _shrink_kernel[grid](
        x, lora_a, h, seg_starts, seg_slots, x.shape[1], rank, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), h.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=_block_r(rank), BLOCK_K=64,
        PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return h


def triton_lora_expand(
    y: torch.Tensor,  # [T, N], added to in place
    h: torch.Tensor,  # [T, R] float32
    lora_b: torch.Tensor,  # [S, N, R]
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    assert y.dim() == 2 and y.stride(1) == 1 and h.is_contiguous() and lora_b.is_contiguous()
    assert lora_b.shape[1] == y.shape[1] and lora_b.shape[2] == h.shape[1]
    num_seg = seg_slots.shape[0]
    if num_seg == 0 or max_seg_len == 0:
        return y
    n, rank = y.shape[1], h.shape[1]
    block_n = 64
    grid = (num_seg, triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(n, block_n))
    _expand_kernel[grid](
        h, lora_b, y, seg_starts, seg_slots, n, rank, h.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block_r(rank),
        PRECISION=dot_precision(lora_b.dtype),
    )  # fmt: skip
    return y
