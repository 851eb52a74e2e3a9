"""Optional paged attention through FlashAttention's `flash_attn_varlen_func(block_table=...)`.

Chosen only with `PAGEDSERVE_ATTENTION_BACKEND=flash` (the Triton kernel is the default). Upstream
flash-attn 2 accepts a paged cache only when its block size is a multiple of 256, so this wrapper
refuses smaller blocks with a clear error instead of failing inside the extension. Causal masking
in flash-attn >= 2.1 aligns the query rows to the end of each key sequence, which is the same
"new tokens sit at the end of the context" rule as `paged_attention_ref`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention import AttentionMetadata

FLASH_PAGE_MULTIPLE = 256


def flash_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    from flash_attn import flash_attn_varlen_func

    if kv_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("the flash attention backend does not read an FP8 KV cache; use triton")

    block_size = kv_cache.shape[2]
    if block_size % FLASH_PAGE_MULTIPLE:
        raise ValueError(
            f"the flash attention backend needs a block size that is a multiple of "
            f"{FLASH_PAGE_MULTIPLE} (got {block_size}); use the triton backend"
        )
    cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        query,
        kv_cache[:, 0],  # [num_blocks, block_size, Hkv, D]
        kv_cache[:, 1],
        cu_seqlens_q=meta.query_start_loc,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=logit_softcap or 0.0,
        block_table=meta.block_tables,
    )
