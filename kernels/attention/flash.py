"""Paged attention through FlashAttention 4 (`flash_attn.cute.flash_attn_varlen_func`, the
`flash-attn-4` package: CuTe DSL kernels compiled at run time, SM90 and SM100).

Chosen with `--attention-backend flash` (or by `auto`, see kernels/attention/selection.py). Our
cache layout `[num_blocks, 2, block_size, Hkv, D]` is FA4's paged layout as it is:
`kv_cache[:, 0]` and `kv_cache[:, 1]` are `(num_pages, page_size, Hkv, D)` views whose strides FA4
accepts without a copy, the block table is its `page_table` (int32, rows contiguous), `seq_lens`
its `seqused_k` and `query_start_loc` its `cu_seqlens_q`. Its causal mask aligns each row's
queries to the end of the row's keys, which is `paged_attention_ref`'s "new tokens sit at the end
of the context" rule.

Block sizes: every size works. On an H100 (hdim 128) FA4 tiles keys 128 at a time; a page of
exactly 128 tokens loads by TMA, any other size through its cp.async page gather (slower per key:
`--block-size 128` is the fast layout for this backend). A sliding window becomes
`window_size=(window - 1, 0)`; soft-capping is FA4's `softcap`; FP8 caches are refused (FA4 reads
FP8 on SM100 only). Scales of a bf16/fp16 cache fold into the softmax scale and the output.
Key splits (flash-decoding) are FA4's own choice for decode steps, from the host bounds
(`max_seqlen_k`: in a CUDA graph the longest context, so a captured graph keeps one choice); steps
with prompts never split (their query tiles fill the GPU, and one choice keeps one variant).
Compiled kernels are kept on disk (kernels/cute_dsl.py).
"""

from __future__ import annotations

import functools

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.cute_dsl import cute_dsl_importable, prepare_cute_dsl


def flash_attn_importable() -> bool:
    """Whether FA4 can be imported here."""
    return cute_dsl_importable("flash_attn.cute")


@functools.cache
def flash_attn_available() -> bool:
    """Whether FlashAttention 4 (`flash_attn.cute`) imports (once per process)."""
    return flash_attn_importable()


@functools.cache
def _varlen_func():
    prepare_cute_dsl()
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    num_splits: int | None = None,  # None: FA4's heuristic (0) for decodes past SM 9.x, else 1
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    """`paged_attention_ref`'s contract through FA4 (device tensors and host ints only)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("the flash attention backend does not read an FP8 KV cache; use triton")
    if query.shape[0] == 0 or meta.seq_lens.shape[0] == 0:
        return torch.empty_like(query)
    if num_splits is None:  # a prompt's query tiles fill the GPU: one variant for them all
        # FA4 4.0.0b36 refuses split-KV on SM 9.0 ("SplitKV not supported on SM 9.0")
        split_ok = torch.cuda.get_device_capability(query.device)[0] >= 10
        num_splits = 0 if meta.max_query_len <= 1 and split_ok else 1
    window = (None, None) if sliding_window is None else (sliding_window - 1, 0)
    result = _varlen_func()(
        query,
        kv_cache[:, 0],  # [num_blocks, block_size, Hkv, D], strided: no copy
        kv_cache[:, 1],
        cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=max(meta.max_query_len, 1),
        max_seqlen_k=max(meta.max_seq_len, 1),
        seqused_k=meta.seq_lens,
        page_table=meta.block_tables,
        softmax_scale=scale * k_scale,
        causal=True,
        window_size=window,
        softcap=logit_softcap or 0.0,
        num_splits=num_splits,
    )
    out = result[0] if isinstance(result, tuple) else result
    return out if v_scale == 1.0 else out * v_scale
