"""Write new tokens' K/V into their paged-cache slots, in Triton.

One program copies one token's keys and values for all KV heads (`Hkv * D` contiguous elements in
the cache, `BLOCK` at a time): the op is a pure copy, so the only goal is wide coalesced loads and
stores. A slot < 0 marks a padding token (CUDA-graph batches are padded to a captured size) and is
skipped, so padding never overwrites a real block. An FP8 cache stores `k / k_scale` clamped to
e4m3's range (the multiply by the inverse scales is exact for the default 1.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, k_inv_scale, v_inv_scale,
    HEAD_DIM: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat (head, dim) index
    ok = i < NUM_ELEMS
    h, d = i // HEAD_DIM, i % HEAD_DIM
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=ok)
    dst = kv_cache_ptr + block * stride_cb + offset * stride_cs + h * stride_ch + d
    elem_ty = kv_cache_ptr.dtype.element_ty
    if FP8:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -448.0, 448.0)
    tl.store(dst, k.to(elem_ty), mask=ok)
    tl.store(dst + stride_ckv, v.to(elem_ty), mask=ok)


def triton_write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0: skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`write_kv_cache`'s contract (in place), skipping slots < 0."""
    if key.dim() != 3 or key.shape != value.shape or kv_cache.dim() != 5:
        raise ValueError(
            f"expected key/value [T, Hkv, D] and kv_cache [num_blocks, 2, block_size, Hkv, D], "
            f"got {tuple(key.shape)}, {tuple(value.shape)}, {tuple(kv_cache.shape)}"
        )
    if key.shape[1:] != kv_cache.shape[3:] or kv_cache.shape[1] != 2:
        raise ValueError(f"key heads/dim {tuple(key.shape[1:])} do not fit {tuple(kv_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.shape}")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value need a contiguous last (head_dim) dimension")
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != kv_cache.shape[4]:
        raise ValueError("kv_cache needs contiguous [Hkv, D] rows")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(num_elems), 2048)
    grid = (num_tokens, triton.cdiv(num_elems, block))
    _write_kv_cache_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=head_dim, NUM_ELEMS=num_elems, BLOCK=block, BLOCK_SIZE=kv_cache.shape[2],
        FP8=kv_cache.dtype == torch.float8_e4m3fn, num_warps=4,
    )  # fmt: skip
