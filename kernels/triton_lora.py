"""Grouped LoRA shrink and expand in Triton (punica's pair), reference in kernels/lora.py.

A step's adapter rows come grouped by slot (`SlotRows`): group g covers
`order[group_starts[g] : group_starts[g + 1]]`, token indices of slot `group_slots[g]` (-1: an
empty group, skipped). Each program owns `BLOCK_M` rows of one group, so it loads its slot's A
or B tile once for all of them, and no two programs write one output element.

`shrink`: `h[split, rows] = x[rows, K_split] A_s[:, K_split]^T`, float32 partial sums over
`num_splits` slices of K: a decode step has a few rows, and K split across programs is what
fills the GPU (one program walking K = 14,336 alone would be the step's longest kernel). The
partials need no zeroed buffer: every split writes its own. `gated`: x is `[T, 2K]` (gate | up)
and `silu(gate) * up` is formed in the loads, so the base layer keeps its fused gated GEMV.
`expand`: `y[rows] += (sum_split h[split, rows]) B_s^T`, `BLOCK_N` output features per program,
the partials' loads unrolled.
The rank is padded to a power of two >= 16 (the smallest `tl.dot`); padding is masked.
Rows of base-model tokens are in no group: their `h` is never written nor read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import dot_precision
from pagedserve.kernels.linear import GEMV_MAX_M
from pagedserve.kernels.lora import SlotRows
from pagedserve.kernels.triton_activation import silu_mul

TARGET_PROGRAMS = 264  # about two programs per SM of an H100 (132 SMs)
MIN_SPLIT_K = 256  # the fewest K columns a split walks (four BLOCK_K steps)
MAX_SPLITS = 16  # K splits of the shrink, each a load of the expand's
SILU_BLOCK_N = 64  # output columns of a `triton_lora_swiglu` program


@triton.jit
def _group_rows(order, start, end, BLOCK_M: tl.constexpr):
    """(token indices [BLOCK_M], valid [BLOCK_M]) of this program's block of its group."""
    ri = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = ri < end
    return tl.load(order + ri, mask=ok, other=0).to(tl.int64), ok


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, order, group_starts, group_slots, K, R, k_per_split, stride_xm,
    stride_as, stride_ar, stride_hs, stride_hm, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    slot = tl.load(group_slots + tl.program_id(0))
    start = tl.load(group_starts + tl.program_id(0))
    end = tl.load(group_starts + tl.program_id(0) + 1)
    if (slot < 0) | (start + tl.program_id(1) * BLOCK_M >= end):
        return
    rows, m_ok = _group_rows(order, start, end, BLOCK_M)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    rr = tl.arange(0, BLOCK_R)
    rk = tl.arange(0, BLOCK_K)
    r_ok = rr < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    x_rows = x_ptr + rows[:, None] * stride_xm
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + rk
        mask = m_ok[:, None] & (kk < k_hi)[None, :]
        a = tl.load(
            a_base + rr[:, None] * stride_ar + kk[None, :],
            mask=r_ok[:, None] & (kk < k_hi)[None, :], other=0.0,
        )  # fmt: skip
        if GATED:  # x is gate | up: silu(gate) * up, rounded as silu_and_mul's output
            gate = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
            up = tl.load(x_rows + K + kk[None, :], mask=mask, other=0.0)
            x = silu_mul(gate, up).to(a.dtype)
        else:
            x = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    h_ptrs = h_ptr + split * stride_hs + rows[:, None] * stride_hm + rr[None, :]
    tl.store(h_ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, order, group_starts, group_slots, N, R, num_splits, stride_hs,
    stride_hm, stride_bs, stride_bn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    slot = tl.load(group_slots + tl.program_id(0))
    start = tl.load(group_starts + tl.program_id(0))
    end = tl.load(group_starts + tl.program_id(0) + 1)
    if (slot < 0) | (start + tl.program_id(1) * BLOCK_M >= end):
        return
    rows, m_ok = _group_rows(order, start, end, BLOCK_M)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    n_ok = rn < N
    # the splits' partial sums, unrolled: the loads go out together (a loop over a runtime
    # count waited ~1 us on each: 67 us for down's 56 splits at batch 1 on an H100; one 3-D load
    # [S, BM, BR] summed over S was slower still)
    h_mask = m_ok[:, None] & (rr < R)[None, :]
    h_ptrs = h_ptr + rows[:, None] * stride_hm + rr[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    zeros = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.int32)
    for s in tl.static_range(BLOCK_S):
        ok = h_mask & (zeros + s < num_splits)
        h += tl.load(h_ptrs + s * stride_hs, mask=ok, other=0.0)
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None].to(tl.int64) * stride_bn + rr[None, :],
        mask=n_ok[:, None] & (rr < R)[None, :], other=0.0,
    )  # fmt: skip
    delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=PRECISION)  # [BM, BN] float32
    y_ptrs = y_ptr + rows[:, None] * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _block_m(rows: SlotRows) -> int:
    return 16 if rows.max_group_len <= 64 else 64


def _block_n(rows: SlotRows) -> int:
    return 64 if rows.max_group_len <= 64 else 128


def _row_blocks(rows: SlotRows) -> int:
    return triton.cdiv(max(rows.max_group_len, 1), _block_m(rows))


def num_splits(rows: SlotRows, k: int) -> int:
    """Slices of K for the shrink: enough programs to fill the GPU, each walking >= 256 columns,
    at most `MAX_SPLITS` (each is a load in every expand program)."""
    programs = rows.group_slots.shape[0] * _row_blocks(rows)
    return max(1, min(TARGET_PROGRAMS // max(programs, 1), k // MIN_SPLIT_K, MAX_SPLITS))


def triton_lora_shrink(
    x: torch.Tensor,  # [T, K], or [T, 2K] (gate | up) with `gated`
    lora_a: torch.Tensor,  # [S, R, K]
    rows: SlotRows,
    gated: bool = False,
) -> torch.Tensor:  # [splits, T, R] float32 partial sums, rows of adapters only
    assert x.dim() == 2 and x.stride(1) == 1 and lora_a.is_contiguous()
    k = x.shape[1] // 2 if gated else x.shape[1]
    assert lora_a.shape[2] == k and x.dtype == lora_a.dtype
    rank = lora_a.shape[1]
    splits = num_splits(rows, k)
    h = torch.empty(splits, x.shape[0], rank, dtype=torch.float32, device=x.device)
    num_groups = rows.group_slots.shape[0]
    if num_groups == 0 or rows.max_group_len == 0:
        return h
    k_per_split = triton.cdiv(triton.cdiv(k, splits), 64) * 64
    grid = (num_groups, _row_blocks(rows), splits)
    _shrink_kernel[grid](
        x, lora_a, h, rows.order, rows.group_starts, rows.group_slots, k, rank, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0), h.stride(1), GATED=gated,
        BLOCK_M=_block_m(rows), BLOCK_R=_block_r(rank), BLOCK_K=64,
        PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return h


def triton_lora_expand(
    y: torch.Tensor,  # [T, N], added to in place
    h: torch.Tensor,  # [splits, T, R] float32, the shrink's
    lora_b: torch.Tensor,  # [S, N, R]
    rows: SlotRows,
) -> torch.Tensor:
    assert y.dim() == 2 and y.stride(1) == 1 and h.is_contiguous() and lora_b.is_contiguous()
    assert lora_b.shape[1] == y.shape[1] and lora_b.shape[2] == h.shape[2]
    num_groups = rows.group_slots.shape[0]
    if num_groups == 0 or rows.max_group_len == 0:
        return y
    n, rank = y.shape[1], h.shape[2]
    block_n = _block_n(rows)
    grid = (num_groups, _row_blocks(rows), triton.cdiv(n, block_n))
    _expand_kernel[grid](
        h, lora_b, y, rows.order, rows.group_starts, rows.group_slots, n, rank, h.shape[0],
        h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=_block_m(rows), BLOCK_N=block_n, BLOCK_R=_block_r(rank),
        BLOCK_S=triton.next_power_of_2(h.shape[0]), PRECISION=dot_precision(lora_b.dtype),
    )  # fmt: skip
    return y


# ---------------------------------------------------------------- by each token's slot
# A decode step's few rows need the pair to cost a few us per projection, not two launches of
# a grid sized for prompts: the shrink rides the base layer's GEMV (extra programs over every
# slot's A, kernels/triton_gemv.py: `h = x [A_0; A_1; ...]^T`, [M, S * W] in x's dtype, rounded
# like the reference's), and one expand adds each row's own slot's `h_s B_s^T` (the other
# slots' columns masked by the row's slot). Two launches per projection instead of three.
# Above GEMV sizes (CUDA graphs of up to 256 decodes, mixed steps, prompts) the shrink over every
# slot is one cuBLAS GEMM (`S * W` <= a few hundred columns: it costs a read of x) and the same
# expand runs over row tiles: no K-split partials for every output block to re-read (the
# grouped pair's graphs size its grid for all rows in every group).


def _slot_expand(
    h_ptr, b_ptr, y_ptr, token_slots, M, N, W, stride_hm, stride_bs, stride_bn, stride_ym,
    NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    slot = tl.load(token_slots + rm, mask=m_ok, other=-1)
    if tl.max(slot) < 0:  # base-model rows only (a graph's replay without adapters)
        return
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    n_ok = rn < N
    w_ok = rw < W
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h_rows = h_ptr + rm[:, None].to(tl.int64) * stride_hm + rw[None, :]
    for s in tl.static_range(NUM_SLOTS):
        mine = slot == s
        if tl.max(mine.to(tl.int32)) > 0:
            h = tl.load(h_rows + s * W, mask=mine[:, None] & w_ok[None, :], other=0.0)
            b = tl.load(
                b_ptr + s * stride_bs + rn[:, None].to(tl.int64) * stride_bn + rw[None, :],
                mask=n_ok[:, None] & w_ok[None, :], other=0.0,
            )  # fmt: skip
            acc = tl.dot(h.to(b.dtype), tl.trans(b), acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


# Decode sizes (<= GEMV_MAX_M rows: the decode graphs' buckets) specialize on the row count `M`
# (Triton compiles a variant per M == 1, M % 16 == 0 or neither); above them `M` changes every
# step, so that kernel is unspecialized: eager steps reuse what the mixed graphs' capture
# compiled instead of compiling a variant on the step path (~1.3 s on an H100, twice in a W1
# run), as the rows' 16-byte aligned sections do for the pointers (kernels/lora.py
# `packed_offsets`).
_slot_expand_kernel = triton.jit(_slot_expand)
_slot_expand_rows_kernel = triton.jit(do_not_specialize=["M"])(_slot_expand)


def triton_slot_expand(
    y: torch.Tensor,  # [M, N], added to in place
    h: torch.Tensor,  # [M, S * W]: every slot's shrink of every row
    lora_b: torch.Tensor,  # [S, N, W]
    token_slots: torch.Tensor,  # [>= M] int32, -1: the base model
) -> torch.Tensor:
    m, n = y.shape
    slots, _, width = lora_b.shape
    assert h.shape == (m, slots * width) and h.stride(1) == 1 and lora_b.is_contiguous()
    assert y.stride(1) == 1 and token_slots.shape[0] >= m
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n <= 8192 and m <= 32 else 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    kernel = _slot_expand_kernel if m <= GEMV_MAX_M else _slot_expand_rows_kernel
    kernel[grid](
        h, lora_b, y, token_slots, m, n, width, h.stride(0), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), NUM_SLOTS=slots, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_W=_block_r(width), PRECISION=dot_precision(lora_b.dtype),
    )  # fmt: skip
    return y


def triton_lora_linear(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M; gated: [M, 2K] (gate | up)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,  # [S, W, K]
    lora_b: torch.Tensor,  # [S, N, W]
    token_slots: torch.Tensor,  # [>= M] int32, -1: the base model
    gated: bool = False,
) -> torch.Tensor:  # [M, N]: x W^T + b + each adapter row's B_s A_s x
    from pagedserve.kernels.triton_gemv import triton_gemv

    m, (slots, width, k) = x.shape[0], lora_a.shape
    h = torch.empty(m, slots * width, dtype=x.dtype, device=x.device)
    y = triton_gemv(x, weight, bias, gated=gated, shrink=(lora_a.view(slots * width, k), h))
    return triton_slot_expand(y, h, lora_b, token_slots)


def triton_lora_dense(
    y: torch.Tensor,  # [M, N], added to in place
    x: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, W, K]
    lora_b: torch.Tensor,  # [S, N, W]
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """`y += B_s A_s x` per row of an adapter: one GEMM over every slot's A, one expand."""
    slots, width, k = lora_a.shape
    h = torch.nn.functional.linear(x, lora_a.view(slots * width, k))
    return triton_slot_expand(y, h, lora_b, token_slots)


@triton.jit(do_not_specialize=["M"])  # (as `_slot_expand_rows_kernel`)
def _slot_silu_kernel(
    y_ptr, h_ptr, b_ptr, out_ptr, token_slots, M, inter, W, stride_ym, stride_hm, stride_bs,
    stride_bn, stride_om, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    m_ok, n_ok, w_ok = rm < M, rn < inter, rw < W
    slot = tl.load(token_slots + rm, mask=m_ok, other=-1)
    mask = m_ok[:, None] & n_ok[None, :]
    # the deltas first, the output tiles loaded after them (fewer registers live at once)
    d_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    d_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if tl.max(slot) >= 0:
        h_rows = h_ptr + rm[:, None].to(tl.int64) * stride_hm + rw[None, :]
        b_mask = n_ok[:, None] & w_ok[None, :]
        for s in tl.static_range(NUM_SLOTS):
            mine = slot == s
            if tl.max(mine.to(tl.int32)) > 0:
                h = tl.load(h_rows + s * W, mask=mine[:, None] & w_ok[None, :], other=0.0)
                b_ptrs = b_ptr + s * stride_bs + rn[:, None].to(tl.int64) * stride_bn + rw[None, :]
                b_gate = tl.load(b_ptrs, mask=b_mask, other=0.0)
                b_up = tl.load(b_ptrs + inter * stride_bn, mask=b_mask, other=0.0)
                h = h.to(b_gate.dtype)
                d_gate = tl.dot(h, tl.trans(b_gate), d_gate, input_precision=PRECISION)
                d_up = tl.dot(h, tl.trans(b_up), d_up, input_precision=PRECISION)
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    gate = tl.load(y_ptrs, mask=mask, other=0.0)
    up = tl.load(y_ptrs + inter, mask=mask, other=0.0)
    gate = (gate.to(tl.float32) + d_gate).to(gate.dtype)  # rounded as `y += delta` would
    up = (up.to(tl.float32) + d_up).to(up.dtype)
    out = silu_mul(gate, up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], out, mask=mask)


def triton_lora_swiglu(
    y: torch.Tensor,  # [M, 2I]: gate | up, the base matmul's
    x: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, W, K]
    lora_b: torch.Tensor,  # [S, 2I, W]
    token_slots: torch.Tensor,
) -> torch.Tensor:  # [M, I]
    """`silu_and_mul(y + B_s A_s x)`, the deltas formed in the activation's loads: a prompt's
    gate/up output is read once, never written back (`triton_lora_dense` then `silu_and_mul`
    would add a read and a write of all of it)."""
    slots, width, k = lora_a.shape
    h = torch.nn.functional.linear(x, lora_a.view(slots * width, k))
    m, inter = y.shape[0], y.shape[1] // 2
    assert lora_b.shape == (slots, 2 * inter, width) and lora_b.is_contiguous()
    assert y.stride(1) == 1 and token_slots.shape[0] >= m
    out = torch.empty(m, inter, dtype=y.dtype, device=y.device)
    # 64 x 64 tiles: two accumulators and two output tiles, as many registers as the expand's
    # 64 x 128 (at 64 x 128 this took 813 us a call at 8,192 x 14,336 on an H100, against 238
    # for silu_and_mul alone: tests/gpu/profile_lora.py)
    grid = (triton.cdiv(inter, SILU_BLOCK_N), triton.cdiv(m, 64))
    _slot_silu_kernel[grid](
        y, h, lora_b, out, token_slots, m, inter, width, y.stride(0), h.stride(0),
        lora_b.stride(0), lora_b.stride(1), out.stride(0), NUM_SLOTS=slots, BLOCK_M=64,
        BLOCK_N=SILU_BLOCK_N, BLOCK_W=_block_r(width), PRECISION=dot_precision(lora_b.dtype),
    )  # fmt: skip
    return out
