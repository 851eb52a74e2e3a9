"""Start-up warm-ups: run the kernels that serving will meet once before the first request, so
no Triton or FA4 compile stalls a step while serving (a compile takes seconds; every request in
flight waits for it)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from pagedserve.kernels.linear import GEMV_MAX_M, GEMV_ROW_CLASSES
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.sampler import argmax_rows

WARM_UP_TOKENS = 64  # per prompt row: past the "whole prompt in one query tile" layouts


def _cascade_warm_up(
    n: int, block_size: int, num_blocks: int, device: torch.device
) -> list[AttentionMetadata]:
    """A decode step of two rows over the same blocks (read only), the first whole ones shared
    as a cascade prefix; none when the cache is too small."""
    shared = -(-n // block_size) * block_size
    blocks = -(-(shared + 1) // block_size)
    if blocks > num_blocks:
        return []
    tables = [list(range(blocks))] * 2
    meta = build_attention_metadata([shared] * 2, [1, 1], tables, block_size, device)[0]
    meta.cascade_len = shared
    meta.cascade_len_dev = torch.tensor([shared], dtype=torch.int32, device=device)
    return [meta]


@torch.inference_mode()
def warm_up_attention(
    layers: list[Attention], kv_cache: torch.Tensor, dtype: torch.dtype, cascade: bool = False
) -> int:
    """Run each distinct attention layer configuration on an eager prefill step (two prompts of
    WARM_UP_TOKENS) and an eager mixed one (a prompt and a decode), over blocks of `kv_cache`
    (read only), so the first long prompt while serving finds its kernels compiled: the memory
    profile's rows are shorter (another FA4 variant) and graphs cover small steps only. With
    `cascade`, also a decode step whose rows share a prefix (for eager runs and a mixed step's
    decode part; decode graphs compile the same variants). How many configurations ran."""
    n, block_size = WARM_UP_TOKENS, kv_cache.shape[2]
    blocks = -(-(n + 1) // block_size)
    if 2 * blocks > kv_cache.shape[0]:
        return 0
    tables = [list(range(blocks)), list(range(blocks, 2 * blocks))]
    device = kv_cache.device
    metas = [
        build_attention_metadata([0, 0], [n, n], tables, block_size, device)[0],  # prefill
        build_attention_metadata([0, n], [n, 1], tables, block_size, device)[0],  # mixed
    ]
    if cascade:
        metas += _cascade_warm_up(n, block_size, kv_cache.shape[0], device)
    seen = set()
    for layer in layers:
        kwargs = tuple(sorted(layer.backend_kwargs.items()))
        key = (layer.backend, layer.sliding_window, kwargs, layer.num_heads, layer.head_dim)
        if key in seen:
            continue
        seen.add(key)
        k_scale, v_scale = layer.kv_scales
        for meta in metas:
            num_tokens = int(meta.query_start_loc_cpu[-1])
            shape = (num_tokens, layer.num_heads, layer.head_dim)
            query = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend(
                query, kv_cache, meta, layer.scale, layer.sliding_window,
                k_scale=k_scale, v_scale=v_scale, **layer.backend_kwargs,
            )  # fmt: skip
    return len(seen)


@torch.inference_mode()
def warm_up_head(
    model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device, max_rows: int
) -> None:
    """Compile the eager LM head's GEMV variants and the argmax before serving: mixed steps
    and decode buckets above the head graphs sample 1-32 rows through them, and a Triton
    compile while serving stalls every request (W2's first run on a fresh H100: TTFT p99
    686-770 ms; later runs, their kernels in Triton's disk cache, ~110)."""
    hidden = torch.zeros(GEMV_MAX_M, hidden_size, dtype=dtype, device=device)
    for rows in GEMV_ROW_CLASSES:
        if rows <= max_rows:
            argmax_rows(model.compute_logits(hidden[:rows]))
