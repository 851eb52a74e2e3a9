"""Neox-style rotary embedding applied in place to q and k, in Triton.

Layout (from `RotaryEmbedding`): `cos_sin_cache [max_position, R]` float32 holds `cos` in its first
`R / 2` columns and `sin` in the last `R / 2`; within each head the first `R` features rotate as
pairs `(x[j], x[j + R/2])` and the rest pass through (partial rotary). Llama-3 scaling only changes
the cache. One program handles one token: it reads the token's cos/sin row once and rotates all its
query and key heads as `[heads, R / 2]` tiles, in float32, rounding once to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base_ptr, num_heads, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_R)
    mask = (h < num_heads)[:, None] & (j < HALF)[None, :]
    ptr1 = base_ptr + h[:, None] * HEAD_DIM + j[None, :]  # [H, R / 2]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    elem_ty = base_ptr.dtype.element_ty
    tl.store(ptr1, (x1 * cos - x2 * sin).to(elem_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(elem_ty), mask=mask)


@triton.jit
def _load_cos_sin(cache_ptr, positions_ptr, tok, stride_cache, HALF: tl.constexpr,
                  BLOCK_R: tl.constexpr):  # fmt: skip
    """Token `tok`'s cos and sin rows, `[1, BLOCK_R]` each (zero past HALF)."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=j < HALF, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + j, mask=j < HALF, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, stride_qt, stride_kt, stride_cache,
    num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(cache_ptr, positions_ptr, tok, stride_cache, HALF, BLOCK_R)
    q_base = q_ptr + tok * stride_qt
    _rotate_heads(q_base, num_q_heads, cos, sin, HEAD_DIM, HALF, BLOCK_HQ, BLOCK_R)
    k_base = k_ptr + tok * stride_kt
    _rotate_heads(k_base, num_kv_heads, cos, sin, HEAD_DIM, HALF, BLOCK_HK, BLOCK_R)


def triton_rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq * D], rows may be strided (a view of the qkv output)
    key: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [max_position, R] float32: cos | sin
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` and `key` in place; returns them for `RotaryEmbedding.forward`'s contract."""
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    if query.dim() != 2 or key.dim() != 2 or {query.shape[0], key.shape[0]} != {num_tokens}:
        raise ValueError(
            f"expected query [T, Hq*D], key [T, Hkv*D] with T = {num_tokens} positions, got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    if query.shape[1] % head_dim or key.shape[1] % head_dim or rotary_dim > head_dim:
        raise ValueError(f"head_dim {head_dim} / rotary_dim {rotary_dim} do not fit q/k widths")
    if query.stride(1) != 1 or key.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("query, key and cos_sin_cache need a contiguous last dimension")
    if cos_sin_cache.dtype != torch.float32 or rotary_dim % 2:
        raise ValueError("cos_sin_cache must be float32 [max_position, even rotary_dim]")
    if num_tokens == 0 or rotary_dim == 0:
        return query, key
    num_q_heads, num_kv_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), key.stride(0), cos_sin_cache.stride(0), num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, HALF=rotary_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(rotary_dim // 2), num_warps=4,
    )  # fmt: skip
    return query, key
