"""MLA's latent cache write in Triton: one program copies one token's `[c | k_pe]` row into its
slot of `[num_blocks, 1, block_size, 1, R + P]`, skipping slots < 0 (the padding rows of a CUDA
graph's decode batch, which must not touch block 0's rows that a real request may own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_latent_kernel(
    latent_ptr, cache_ptr, slot_ptr, stride_t, stride_cb, stride_cs,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    i = tl.arange(0, BLOCK)
    ok = i < WIDTH
    row = tl.load(latent_ptr + tok * stride_t + i, mask=ok)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + i
    tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=ok)


def triton_write_latent_cache(
    latent: torch.Tensor,  # [T, R + P]
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
    slot_mapping: torch.Tensor,  # [T] int64, < 0: skip
) -> None:
    width = latent.shape[1]
    if latent.stride(1) != 1 or kv_cache.shape[-1] != width or not kv_cache.is_contiguous():
        raise ValueError(f"latent {tuple(latent.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if latent.shape[0] == 0:
        return
    _write_latent_kernel[(latent.shape[0],)](
        latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0), kv_cache.stride(2),
        WIDTH=width, BLOCK=triton.next_power_of_2(width), BLOCK_SIZE=kv_cache.shape[2],
    )  # fmt: skip
