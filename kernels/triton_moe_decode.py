"""Mixture-of-experts for a few tokens (batch-1 and small decode steps) in two Triton GEMVs.

At a decode step's handful of tokens the grouped kernel (kernels/triton_moe.py) pays for its
generality: sorting pairs by expert and padding each expert's run is a dozen small kernels, and
its `[BLOCK_M, BLOCK_N]` tiles are mostly padding rows. Here every (token, slot) pair is its own
row and reads its expert's weights directly, so the step is two launches:
1. `_gate_up_kernel`, program (pair, column block): the pair's gate and up columns over the
   hidden size, the gate/up bias, and the activation (SiLU-and-mul, or gpt-oss's clamped SwiGLU)
   in the epilogue, in float32: `[T * K, I]` in the input dtype.
2. `_down_kernel`, program (token, column block): the token's K pairs through their experts'
   down projections, each times its routing weight, summed in float32: `[T, H]`.
A pair reads its expert's whole weights, so two pairs on one expert read it twice: this path
pays only while pairs are few (`use_moe_decode`); past that the grouped kernel reads each touched
expert once. Device tensors only (no host sync, CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import fusion_enabled
from pagedserve.kernels.triton_moe import check_moe_inputs

# At most this many (token, slot) pairs take the GEMV path (gpt-oss, Mixtral: batch <= 2 and 4;
# top-8: 1). Timed end to end at 1 token (4 pairs); past that, pairs on a shared expert read it
# again, so the bound stays low until tests/gpu/moe_tiles.py has timed 2 and 4 tokens.
MAX_DECODE_PAIRS = 8
Tiles = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
DECODE_TILES: Tiles = (16, 256, 4, 3)


def use_moe_decode(num_tokens: int, top_k: int) -> bool:
    """Whether `num_tokens` rows routed to `top_k` experts each take this path (fusion
    `moe-gemv`, on by default)."""
    return 0 < num_tokens * top_k <= MAX_DECODE_PAIRS and fusion_enabled("moe-gemv")


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, ids_ptr, h_ptr, H, I, stride_x, stride_we, stride_wn, stride_h,
    alpha, limit,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of I
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K) * stride_x
    w_gate = w_ptr + expert * stride_we + cols[:, None] * stride_wn  # [N, 1]
    w_up = w_gate + I * stride_wn
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks + k0 < H
        x = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, K]
        mask = col_ok[:, None] & k_ok[None, :]
        gate += tl.load(w_gate + k0 + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(w_up + k0 + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    g = tl.sum(gate, axis=1)  # [N]
    u = tl.sum(up, axis=1)
    if HAS_BIAS:
        g += tl.load(b_ptr + expert * 2 * I + cols, mask=col_ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + expert * 2 * I + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    if CLAMPED:  # gpt-oss: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    else:  # SiLU-and-mul
        out = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_h + cols, out.to(h_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, H, I, stride_h, stride_we, stride_wn, stride_o,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N] of H
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wn  # [N, 1]
        part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = ks + k0 < I
            h = tl.load(h_ptr + pair * stride_h + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k0 + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            part += w * h[None, :]
        acc += part * tl.load(weights_ptr + pair)
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def triton_moe_decode(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    clamp: tuple[float, float] | None = None,  # gpt-oss's (alpha, limit); None: SiLU-and-mul
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T, H]
    """`triton_fused_moe`'s result for a few tokens (see `use_moe_decode`), weights unquantized."""
    check_moe_inputs(x, w13, w2, topk_ids, w13_bias)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    block_n, block_k, num_warps, num_stages = tiles or DECODE_TILES
    ids = topk_ids.reshape(-1).contiguous()  # [T * K]
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    alpha, limit = clamp or (0.0, 0.0)
    launch = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, w13_bias if w13_bias is not None else x, ids, h, hidden, inter, x.stride(0),
        w13.stride(0), w13.stride(1), h.stride(0), alpha, limit, TOP_K=top_k,
        HAS_BIAS=w13_bias is not None, CLAMPED=clamp is not None, **launch,
    )  # fmt: skip
    out = torch.empty_like(x)
    _down_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        h, w2, ids, weights, out, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=top_k, **launch,
    )  # fmt: skip
    return out
