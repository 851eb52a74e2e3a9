"""Fused mixture-of-experts in Triton: tokens sorted by expert, one grouped GEMM per projection.

The design of vLLM's and SGLang's `fused_moe`, written for this repo:
1. `align_by_expert` sorts the `T * K` (token, slot) pairs by expert and pads each expert's run to
   a multiple of `BLOCK_M`, so every `BLOCK_M` rows of the sorted order belong to one expert. It
   uses only device ops sized by their upper bound (no host sync, CUDA-graph safe).
2. `_grouped_gemm_kernel`: program (row block, column block) loads its expert id, gathers its
   rows of A (token `pair // K` of x for the first GEMM, pair rows of the intermediate for the
   second) and multiplies by that expert's weight `W[e] [N, K]`, writing rows of `[T * K, N]`.
   The second GEMM multiplies each row by its routing weight.
3. gate/up -> SiLU-and-mul (the existing kernel) -> down, then the K slots of a token are summed.
Variants: a gate/up bias and another activation (gpt-oss's clamped SwiGLU), and FP8 weights with
one float32 scale per square block (DeepSeek-V3's experts as stored: the tile's dot product is
scaled once per K step, tiles never straddle a block).
A decode batch of T tokens touches at most T * K experts; empty experts cost nothing but their
padding check, and padded rows (index `T * K`) are masked out of loads and stores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import dot_precision
from pagedserve.kernels.triton_activation import triton_silu_and_mul

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMM; with BLOCK_M 16 (decode-sized
# batches) and unscaled weights, wider K steps: 5-6% faster at the gpt-oss-20b shape for 1, 8
# and 64 tokens on an H100 (tests/gpu/moe_tiles.py times them)
Tiles = tuple[int, int, int, int]
DEFAULT_TILES: Tiles = (128, 64, 4, 3)
SMALL_M_TILES: Tiles = (64, 256, 4, 3)


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, K] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sorted_pairs [P]` (pair index `t * K + k`, padding `T * K`) and `block_experts [P / BM]`
    (the expert of each row block, -1 past the last used block), P = T*K + E*(BM - 1) rounded up."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [TK]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] (bincount syncs on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [TK] pairs in expert order
    sorted_experts = flat[order]
    first_sorted = torch.cumsum(counts, 0) - counts  # [E] first index of each expert in order
    rank = torch.arange(num_pairs, device=flat.device) - first_sorted[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank  # [TK]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[dest] = order
    block_start = torch.arange(0, capacity, block_m, device=flat.device)  # [P / BM]
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr, bias_ptr, scale_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_cm, stride_se, stride_sn,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + block_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_ok = pairs < num_pairs
    a_rows = pairs // TOP_K if A_PER_TOKEN else pairs  # [M]
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [M, BK]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, N]
    # FP8 weights: one scale per SCALE_BLOCK x SCALE_BLOCK block, so one per tile
    s_ptr = scale_ptr + expert * stride_se
    if SCALE_BLOCK:
        s_ptr += (block_n * BLOCK_N // SCALE_BLOCK) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks + k0 < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALE_BLOCK:
            part = tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
            acc += part * tl.load(s_ptr + k0 // SCALE_BLOCK)
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor,  # [T, K_in] (per token) or [T * top_k, K_in] (per pair)
    w: torch.Tensor,  # [E, N, K_in]
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    top_k: int,
    num_pairs: int,
    block_m: int,
    per_token: bool,  # A's rows are tokens (pair // top_k), else pairs
    weights: torch.Tensor | None = None,  # [T * top_k] float32
    bias: torch.Tensor | None = None,  # [E, N]
    scale: torch.Tensor | None = None,  # [E, N / SB, K_in / SB] float32 (w in FP8)
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T * top_k, N]
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    scale_block = 0 if scale is None else _scale_block(w, scale)
    small = block_m == 16 and scale is None
    tile_n, tile_k, num_warps, num_stages = tiles or (SMALL_M_TILES if small else DEFAULT_TILES)
    block_n = min(tile_n, scale_block or tile_n, max(16, triton.next_power_of_2(n)))
    block_k = min(tile_k, scale_block or tile_k, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, weights if weights is not None else out,
        bias if bias is not None else out, scale if scale is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        TOP_K=top_k, A_PER_TOKEN=per_token, MUL_WEIGHT=weights is not None,
        HAS_BIAS=bias is not None, SCALE_BLOCK=scale_block,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(a.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _scale_block(w: torch.Tensor, scale: torch.Tensor) -> int:
    """The square block edge of `scale` over `w` (checked: a power of two, >= 16, so tiles
    never straddle two blocks)."""
    num_experts, n, k = w.shape
    edge = triton.next_power_of_2(-(-k // scale.shape[2]))
    if (
        scale.dtype != torch.float32
        or scale.stride(2) != 1
        or scale.shape != (num_experts, -(-n // edge), -(-k // edge))
        or edge < 16
    ):
        raise ValueError(
            f"moe FP8 scales {tuple(scale.shape)} {scale.dtype} are not float32 square blocks "
            f"(a power of two >= 16) over weights {tuple(w.shape)}"
        )
    return edge


def check_moe_inputs(x, w13, w2, topk_ids, w13_bias) -> None:
    """The experts' kernels' contract: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K],
    unit stride in the last dimension, an optional contiguous gate/up bias [E, 2I]."""
    num_tokens, _ = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    if x.shape != (num_tokens, hidden) or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)}")  # fmt: skip
    if not (x.stride(1) == w13.stride(2) == w2.stride(2) == 1):
        raise ValueError("moe inputs need unit stride in their last dimension")
    if w13_bias is not None and (w13_bias.shape != w13.shape[:2] or not w13_bias.is_contiguous()):
        raise ValueError(f"moe gate/up bias {tuple(w13_bias.shape)} is not contiguous [E, 2I]")


def triton_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
    block_m: int | None = None,
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I], added before the activation
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,  # [N, 2I] -> [N, I]
    w13_scale: torch.Tensor | None = None,  # FP8 weights: [E, 2I / B, H / B] float32
    w2_scale: torch.Tensor | None = None,  # [E, H / B, I / B]
    tiles: Tiles | None = None,
) -> torch.Tensor:  # [T, H]
    """`fused_moe_ref`'s contract on contiguous weights (checked), from device tensors only;
    optionally with gate/up biases and another activation than SiLU-and-mul (gpt-oss) and with
    FP8 weights scaled per square block (DeepSeek-V3's experts, kept in FP8)."""
    check_moe_inputs(x, w13, w2, topk_ids, w13_bias)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    block_m = block_m or (16 if num_tokens * top_k <= 64 * num_experts else 64)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    args = (sorted_pairs, block_experts, top_k, num_pairs, block_m)
    gate_up = _grouped_gemm(
        x, w13, *args, per_token=True, bias=w13_bias, scale=w13_scale, tiles=tiles
    )
    hidden_states = (activation or triton_silu_and_mul)(gate_up)  # [TK, I]
    weights = topk_weights.reshape(-1).float()
    down = _grouped_gemm(
        hidden_states, w2, *args, per_token=False, weights=weights, scale=w2_scale, tiles=tiles
    )  # [TK, H]
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
