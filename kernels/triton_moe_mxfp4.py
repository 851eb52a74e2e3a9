"""gpt-oss's experts read as stored: MXFP4 weights decoded inside the Triton kernels.

The weights stay as the checkpoint packs them (kernels/mxfp4.py): `blocks [E, N, K / 32, 16]`
uint8 (two e2m1 codes a byte, the low nibble first: values k = 2j and 2j + 1 of byte j) and
`scales [E, N, K / 32]` uint8 (the biased power-of-two exponent of 32 values), so a step reads
~4.25 bits a weight instead of bf16's 16. Decoding is exact: an e2m1 code moved into a float16's
sign, exponent and top mantissa bits is the code's value times 2^-14 (its zero exponent lands on
float16's subnormals, which GPUs keep), widened to float32; the 2^14 and the scale
`2^(s - 127)` multiply the group's sum, or the tile before a `tl.dot`. Scale 0 (2^-127) reads as
0 and 255 (E8M0's NaN) as inf: values no trained weight holds.

This file: the grouped kernel for larger batches (kernels/triton_moe.py's sort by expert, with
the weight tile decoded before its dots: the even and the odd values of a byte are two dots
against A's even and odd columns, so nothing interleaves). kernels/triton_moe_mxfp4_decode.py:
the few-token GEMVs. The torch reference is `dequantize_mxfp4` and the bf16 experts' kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import dot_precision
from pagedserve.kernels.mxfp4 import BLOCK
from pagedserve.kernels.triton_moe import Tiles, align_by_expert

# (BLOCK_N, BLOCK_K in values, num_warps, num_stages) of the grouped MXFP4 GEMM, for BLOCK_M 16
# and for 32-64: the largest tiles that ptxas compiles for sm_90a without spilling (156 and 209
# registers; (64, 128, 4, 3) spilled 1.1 KB a thread at BLOCK_M 64). Not yet timed on a GPU.
MXFP4_TILES: Tiles = (64, 64, 4, 3)
MXFP4_TILES_LARGE_M: Tiles = (64, 64, 8, 2)


@triton.jit
def e2m1_pair(b):
    """uint8 codes -> (low nibble, high nibble) as float32, each the e2m1 value times 2^-14."""
    b = b.to(tl.uint32)
    t = (b | (b << 12)) & 0x000F000F  # the low code in bits 0-3, the high one in 16-19
    # float16 bits of both halves at once: sign 15, exponent 10-11, mantissa 9
    w = ((t & 0x00080008) << 12) | ((t & 0x00070007) << 9)
    lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e8m0_scale(s):
    """uint8 biased exponents -> float32 `2^(s - 127)` times 2^14 (e2m1_pair's missing factor)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_mxfp4_kernel(
    a_ptr, wb_ptr, ws_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr, bias_ptr,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_ok = pairs < num_pairs
    a_rows = pairs // TOP_K if A_PER_TOKEN else pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    col_ok = cols < N
    js = tl.arange(0, BLOCK_K // 2)  # byte j of the step: values 2j, 2j + 1
    ps = tl.arange(0, 2)
    a_ptrs = a_ptr + a_rows[:, None, None] * stride_am + 2 * js[None, :, None] + ps  # [M, BK/2, 2]
    w_bytes = wb_ptr + expert * stride_be + cols[None, :] * stride_bn + js[:, None]  # [BK/2, N]
    gs = tl.arange(0, BLOCK_K // 32)  # the step's scale groups
    w_scales = ws_ptr + expert * stride_se + cols[None, :] * stride_sn + gs[:, None]  # [G, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j_ok = 2 * js + k0 < K
        a_mask = row_ok[:, None, None] & j_ok[None, :, None]
        ae, ao = tl.split(tl.load(a_ptrs + k0, mask=a_mask, other=0.0))  # A's even, odd columns
        w_mask = j_ok[:, None] & col_ok[None, :]
        lo, hi = e2m1_pair(tl.load(w_bytes + k0 // 2, mask=w_mask, other=0))
        g_mask = (32 * gs + k0 < K)[:, None] & col_ok[None, :]
        scale = e8m0_scale(tl.load(w_scales + k0 // 32, mask=g_mask, other=0))  # [G, N]
        scale = tl.reshape(  # each group's scale over its 16 bytes: [BK/2, N]
            tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
            (BLOCK_K // 2, BLOCK_N),
        )
        acc = tl.dot(ae, (lo * scale).to(ae.dtype), acc, input_precision=PRECISION)
        acc = tl.dot(ao, (hi * scale).to(ae.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, n: int, k: int, name: str) -> None:
    """`blocks [E, n, k / 32, 16]` and `scales [E, n, k / 32]`, uint8, rows contiguous."""
    groups = k // BLOCK
    ok = (
        blocks.dtype == scales.dtype == torch.uint8
        and k % BLOCK == 0
        and blocks.shape[1:] == (n, groups, BLOCK // 2)
        and scales.shape == blocks.shape[:3]
        and blocks.stride(3) == 1
        and blocks.stride(2) == BLOCK // 2
        and scales.stride(2) == 1
    )
    if not ok:
        raise ValueError(
            f"MXFP4 {name}: blocks {tuple(blocks.shape)} {blocks.dtype}, scales "
            f"{tuple(scales.shape)} {scales.dtype} are not [E, {n}, {groups}, 16] and "
            f"[E, {n}, {groups}] uint8 with contiguous rows"
        )


def _grouped_mxfp4(a, blocks, scales, align, per_token, weights=None, bias=None, tiles=None):
    """One grouped GEMM over MXFP4 weights: `[T * top_k, N]` rows in `a`'s dtype."""
    sorted_pairs, block_experts, top_k, num_pairs, block_m = align
    n, k = blocks.shape[1], blocks.shape[2] * BLOCK
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    default = MXFP4_TILES if block_m == 16 else MXFP4_TILES_LARGE_M
    tile_n, tile_k, num_warps, num_stages = tiles or default
    grid = (block_experts.numel(), triton.cdiv(n, tile_n))
    _grouped_mxfp4_kernel[grid](
        a, blocks, scales, out, sorted_pairs, block_experts,
        weights if weights is not None else out, bias if bias is not None else out,
        num_pairs, n, k, a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0),
        scales.stride(1), out.stride(0), TOP_K=top_k, A_PER_TOKEN=per_token,
        MUL_WEIGHT=weights is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=tile_n, BLOCK_K=tile_k, PRECISION=dot_precision(a.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def triton_fused_moe_mxfp4(
    x: torch.Tensor,  # [T, H]
    w13: tuple[torch.Tensor, torch.Tensor],  # blocks [E, 2I, H/32, 16], scales [E, 2I, H/32]
    w2: tuple[torch.Tensor, torch.Tensor],  # blocks [E, H, I/32, 16], scales [E, H, I/32]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    activation: Callable[[torch.Tensor], torch.Tensor],  # [N, 2I] -> [N, I]
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T, H]
    """`triton_fused_moe`'s result over the dequantized weights, read in MXFP4."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter = w13[0].shape[:2]
    hidden = x.shape[1]
    check_mxfp4(*w13, two_inter, hidden, "gate/up")
    check_mxfp4(*w2, hidden, two_inter // 2, "down")
    if x.stride(1) != 1 or (w13_bias is not None and w13_bias.shape != (num_experts, two_inter)):
        raise ValueError(f"moe input {tuple(x.shape)} or gate/up bias does not fit the experts")
    if num_tokens == 0:
        return torch.zeros_like(x)
    # a weight tile is decoded once per BLOCK_M rows: as many as an expert's pairs, 16 to 64
    block_m = min(64, max(16, triton.next_power_of_2(num_tokens * top_k // num_experts)))
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    align = (sorted_pairs, block_experts, top_k, num_tokens * top_k, block_m)
    gate_up = _grouped_mxfp4(x, *w13, align, per_token=True, bias=w13_bias, tiles=tiles)
    weights = topk_weights.reshape(-1).float()
    down = _grouped_mxfp4(activation(gate_up), *w2, align, per_token=False, weights=weights,
                          tiles=tiles)  # fmt: skip
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
