"""Writing a step's new K/V into the paged cache: the Triton kernel on CUDA, else the reference
(kernels/attention/reference.py), and whether rotary may fuse into that write."""

from __future__ import annotations

import torch

from pagedserve.kernels.attention.reference import write_kv_cache_ref
from pagedserve.kernels.attention.registry import forced_attention_backend
from pagedserve.kernels.backend import fusion_enabled, use_triton


def use_triton_cache_write(kv_cache: torch.Tensor) -> bool:
    """The KV-cache write follows the attention choice: reference only when forced to torch."""
    return use_triton(kv_cache) and forced_attention_backend() != "torch"


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each new token's K/V in its cache slot, in place; slots < 0 (padding) are skipped.

    On CUDA this runs the Triton kernel (no host sync, CUDA-graph safe); the reference filters
    padding with a boolean mask, which syncs.
    """
    if use_triton_cache_write(kv_cache):
        from pagedserve.kernels.triton_cache import triton_write_kv_cache

        triton_write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def fuse_rope_and_cache(rotary_dim: int, kv_cache: torch.Tensor) -> bool:
    """Whether rotary and the cache write run as one Triton kernel (CUDA, unless turned off)."""
    return rotary_dim > 0 and use_triton_cache_write(kv_cache) and fusion_enabled("rope-cache")
