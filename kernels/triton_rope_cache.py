"""Rotary embedding fused with the KV-cache write, in Triton: one kernel per layer instead of two.

One program handles one token: it reads the token's cos/sin row once (kernels/triton_rotary.py's
layout), rotates the query heads in place (as `triton_rotary_embedding` does) and writes the
rotated keys and the values straight into the token's paged-cache slot; the rotated keys are
never written back to the qkv buffer, since attention reads keys only from the cache. A slot < 0
(CUDA-graph padding) rotates the query and writes nothing. The arithmetic follows the two
unfused kernels: rotation in float32, one rounding to the model dtype, then (FP8 cache) the
division by the scale and the clamp to e4m3's range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_rotary import _load_cos_sin, _rotate_heads


@triton.jit
def _to_cache(x, inv_scale, model_ty: tl.constexpr, cache_ty: tl.constexpr, FP8: tl.constexpr):
    """A float32 tile as the cache stores it, rounded to the model dtype first."""
    x = x.to(model_ty)
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    return x.to(cache_ty)


@triton.jit
def _rope_cache_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, kv_cache_ptr, slot_mapping_ptr,
    stride_qt, stride_kt, stride_vt, stride_cos,
    stride_cb, stride_ckv, stride_cs, k_inv_scale, v_inv_scale, num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PARTIAL: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(cache_ptr, positions_ptr, tok, stride_cos, HALF, BLOCK_R)
    j = tl.arange(0, BLOCK_R)
    _rotate_heads(q_ptr + tok * stride_qt, num_q_heads, cos, sin, HEAD_DIM, HALF, BLOCK_HQ, BLOCK_R)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    model_ty = k_ptr.dtype.element_ty
    cache_ty = kv_cache_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_HK)[:, None]
    # Keys: the rotated pairs (x[j], x[j + R/2]) of every head, then (partial) the rest as is.
    rot_mask = (h < num_kv_heads) & (j < HALF)[None, :]
    k_src = k_ptr + tok * stride_kt + h * HEAD_DIM + j[None, :]  # [H, R / 2]
    k_dst = dst + h * HEAD_DIM + j[None, :]
    x1 = tl.load(k_src, mask=rot_mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + HALF, mask=rot_mask, other=0.0).to(tl.float32)
    k1 = _to_cache(x1 * cos - x2 * sin, k_inv_scale, model_ty, cache_ty, FP8)
    k2 = _to_cache(x2 * cos + x1 * sin, k_inv_scale, model_ty, cache_ty, FP8)
    tl.store(k_dst, k1, mask=rot_mask)
    tl.store(k_dst + HALF, k2, mask=rot_mask)
    d = tl.arange(0, BLOCK_D)[None, :]
    head_mask = (h < num_kv_heads) & (d < HEAD_DIM)
    if PARTIAL:
        tail = head_mask & (d >= 2 * HALF)
        k_tail = tl.load(k_ptr + tok * stride_kt + h * HEAD_DIM + d, mask=tail, other=0.0)
        k_tail = _to_cache(k_tail.to(tl.float32), k_inv_scale, model_ty, cache_ty, FP8)
        tl.store(dst + h * HEAD_DIM + d, k_tail, mask=tail)
    # Values: a copy (scaled for FP8).
    v = tl.load(v_ptr + tok * stride_vt + h * HEAD_DIM + d, mask=head_mask, other=0.0)
    v = _to_cache(v.to(tl.float32), v_inv_scale, model_ty, cache_ty, FP8)
    tl.store(dst + stride_ckv + h * HEAD_DIM + d, v, mask=head_mask)


def triton_rope_and_cache(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq * D], rows may be strided (a view of the qkv output)
    key: torch.Tensor,  # [T, Hkv * D]
    value: torch.Tensor,  # [T, Hkv * D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0: no write
    cos_sin_cache: torch.Tensor,  # [max_position, R] float32: cos | sin
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate `query` in place (returned) and store rotated keys and values in the cache: what
    `RotaryEmbedding` then `write_kv_cache` do, in one launch (`key` is left as it was)."""
    num_tokens = positions.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    rotary_dim = cos_sin_cache.shape[-1]
    if any(t.dim() != 2 or t.shape[0] != num_tokens for t in (query, key, value)):
        raise ValueError(f"expected query/key/value [T, heads * D] with T = {num_tokens}")
    if key.shape[1] != num_kv_heads * head_dim or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit the cache {kv_cache.shape}")
    if query.shape[1] % head_dim or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"head_dim {head_dim} / rotary_dim {rotary_dim} do not fit query")
    if any(t.stride(1) != 1 for t in (query, key, value, cos_sin_cache)):
        raise ValueError("query, key, value and cos_sin_cache need a contiguous last dimension")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache needs contiguous [Hkv, D] rows")
    if slot_mapping.shape != (num_tokens,) or cos_sin_cache.dtype != torch.float32:
        raise ValueError("slot_mapping must be [T] and cos_sin_cache float32")
    if num_tokens == 0:
        return query
    _rope_cache_kernel[(num_tokens,)](
        positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping,
        query.stride(0), key.stride(0), value.stride(0), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        query.shape[1] // head_dim, num_kv_heads,
        HEAD_DIM=head_dim, HALF=rotary_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(query.shape[1] // head_dim),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(rotary_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], PARTIAL=rotary_dim < head_dim,
        FP8=kv_cache.dtype == torch.float8_e4m3fn, num_warps=4,
    )  # fmt: skip
    return query
