"""A few tokens' MXFP4 experts in two Triton GEMVs (kernels/triton_moe_decode.py's path, reading
the packed weights: kernels/triton_moe_mxfp4.py decodes them).

A program holds `[BLOCK_N, GROUPS, 16]` bytes of its rows per step: `GROUPS` scale groups of 32
values each. A byte's low and high codes multiply the input's even and odd values, the 16
products of a group are summed, then scaled once by the group's power of two, so a weight costs
its decode and one multiply-add. As there, a pair reads its expert's whole weights and the
activation (the clamped SwiGLU, with the gate/up bias) runs in the first kernel's epilogue, the
routing weights and the top-k sum in the second. Device tensors only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_moe_mxfp4 import check_mxfp4, e2m1_pair, e8m0_scale

Tiles = tuple[int, int, int, int]  # BLOCK_N, GROUPS (32 values each), num_warps, num_stages
# (16, 16, 8, 2): 79 us a gpt-oss-20b layer at 1 token on an H100, against 97 for (16, 8, 4, 3)
# and 114 for the bf16 GEMVs (tests/gpu/mxfp4_bench.py)
MXFP4_DECODE_TILES: Tiles = (16, 16, 8, 2)


@triton.jit
def _row_dot(x_ptr, b_rows, s_rows, row_ok, K, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """`sum_k W[r, k] x[k]` over K for the rows at `b_rows [R, 1, 1]` (bytes) and `s_rows [R, 1]`
    (scales): float32 [R]."""
    gs = tl.arange(0, GROUPS)
    byte = gs[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16] of the step
    x_ptrs = x_ptr + 2 * byte[:, :, None] + tl.arange(0, 2)[None, None, :]  # [G, 16, 2]
    b_ptrs = b_rows + byte[None, :, :]  # [R, G, 16]
    s_ptrs = s_rows + gs[None, :]  # [R, G]
    num_groups = K // 32
    acc = tl.zeros([ROWS, GROUPS, 16], tl.float32)  # summed once at the end, not per step
    for g0 in range(0, num_groups, GROUPS):  # pointers advance: no per-element offsets to redo
        g_ok = gs + g0 < num_groups  # [G]
        x = tl.load(x_ptrs, mask=g_ok[:, None, None], other=0.0).to(tl.float32)
        x_even, x_odd = tl.split(x)  # [G, 16] each
        b = tl.load(b_ptrs, mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
        lo, hi = e2m1_pair(b)  # [R, G, 16]
        part = lo * x_even[None, :, :] + hi * x_odd[None, :, :]
        s = tl.load(s_ptrs, mask=row_ok[:, None] & g_ok[None, :], other=0)
        acc += part * e8m0_scale(s)[:, :, None]
        x_ptrs += GROUPS * 32
        b_ptrs += GROUPS * 16
        s_ptrs += GROUPS
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr, H, I,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_h, alpha, limit,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)  # gate and up rows of each unit, side by side: one loop
    unit = tl.program_id(1) * BLOCK_N + r // 2
    rows = unit + (r % 2) * I  # [2N] of 2I
    b_rows = wb_ptr + expert * stride_be + rows[:, None, None] * stride_bn
    s_rows = ws_ptr + expert * stride_se + rows[:, None] * stride_sn
    x_row = x_ptr + (pair // TOP_K) * stride_x
    gate_up = _row_dot(x_row, b_rows, s_rows, unit < I, H, 2 * BLOCK_N, GROUPS)  # [2N]
    if HAS_BIAS:
        gate_up += tl.load(b_ptr + expert * 2 * I + rows, mask=unit < I, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(gate_up, (BLOCK_N, 2)))  # [N] each
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of I
    g = tl.minimum(g, limit)  # gpt-oss: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    tl.store(h_ptr + pair * stride_h + cols, out.to(h_ptr.dtype.element_ty), mask=cols < I)


@triton.jit
def _down_kernel(
    h_ptr, wb_ptr, ws_ptr, ids_ptr, weights_ptr, out_ptr, H, I,
    stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_o,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of H
    col_ok = cols < H
    out = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        b_rows = wb_ptr + expert * stride_be + cols[:, None, None] * stride_bn
        s_rows = ws_ptr + expert * stride_se + cols[:, None] * stride_sn
        part = _row_dot(h_ptr + pair * stride_h, b_rows, s_rows, col_ok, I, BLOCK_N, GROUPS)
        out += part * tl.load(weights_ptr + pair)
    tl.store(out_ptr + token * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def triton_moe_mxfp4_decode(
    x: torch.Tensor,  # [T, H]
    w13: tuple[torch.Tensor, torch.Tensor],  # blocks [E, 2I, H/32, 16], scales [E, 2I, H/32]
    w2: tuple[torch.Tensor, torch.Tensor],  # blocks [E, H, I/32, 16], scales [E, H, I/32]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
    *,
    w13_bias: torch.Tensor | None,  # [E, 2I]
    clamp: tuple[float, float],  # gpt-oss's (alpha, limit)
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T, H]
    """gpt-oss's experts for a few tokens (`use_moe_decode`) over MXFP4 weights: the bf16
    GEMVs' result on the dequantized weights."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter = w13[0].shape[:2]
    inter, hidden = two_inter // 2, x.shape[1]
    check_mxfp4(*w13, two_inter, hidden, "gate/up")
    check_mxfp4(*w2, hidden, inter, "down")
    if x.stride(1) != 1 or (w13_bias is not None and w13_bias.shape != (num_experts, two_inter)):
        raise ValueError(f"moe input {tuple(x.shape)} or gate/up bias does not fit the experts")
    block_n, groups, num_warps, num_stages = tiles or MXFP4_DECODE_TILES
    ids = topk_ids.reshape(-1).contiguous()  # [T * K]
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    launch = dict(BLOCK_N=block_n, GROUPS=groups, num_warps=num_warps, num_stages=num_stages)
    (b13, s13), (b2, s2) = w13, w2
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, block_n))](
        x, b13, s13, w13_bias if w13_bias is not None else x, ids, h, hidden, inter, x.stride(0),
        b13.stride(0), b13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), *clamp,
        TOP_K=top_k, HAS_BIAS=w13_bias is not None, **launch,
    )  # fmt: skip
    out = torch.empty_like(x)
    _down_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        h, b2, s2, ids, weights, out, hidden, inter, h.stride(0), b2.stride(0), b2.stride(1),
        s2.stride(0), s2.stride(1), out.stride(0), TOP_K=top_k, **launch,
    )  # fmt: skip
    return out
