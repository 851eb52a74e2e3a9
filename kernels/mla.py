"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache: torch.

The cache holds, per token, only what MLA compresses K and V into: the normed latent `c`
(`kv_lora_rank` wide) and the rotated shared rope key `k_pe` (`qk_rope_head_dim`), one row
`[c | k_pe]` per token and layer, `[num_blocks, 1, block_size, 1, kv_lora_rank + rope]` (the
paged layout's K/V axis and head axis of width one): 576 values per token at DeepSeek-V3's
shapes, vLLM's MLA block, instead of 2 x 128 heads x 192 for expanded K/V.

Each head's K and V are linear in `c` (`kv_b_proj`: `k_nope_h = W_UK[h] c`, `v_h = W_UV[h] c`),
so attention runs two ways with the same result:
- decode (one new token per row): absorbed. The query moves into latent space
  (`q_lat_h = W_UK[h]^T q_nope_h`), scores are `q_lat . c + q_pe . k_pe` over the cached rows
  themselves, the weighted sum stays latent and leaves through `W_UV[h]`: the cache is read
  once, as is, for every head.
- prefill (several new tokens): the row's latents expand to per-head K and V
  (`kv_b_proj` over the context), then ordinary causal attention with 192-wide keys and
  128-wide values: fewer FLOPs than absorption when the queries are many.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.backend import use_triton


def write_latent_cache(
    latent: torch.Tensor,  # [T, R + P]: normed c, rotated k_pe
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
    slot_mapping: torch.Tensor,  # [T] int64 (< 0: a graph's padding row, written nowhere)
) -> None:
    if use_triton(latent):
        from pagedserve.kernels.triton_mla import triton_write_latent_cache

        triton_write_latent_cache(latent, kv_cache, slot_mapping)
        return
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def mla_attention(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, P], rotated
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P], this step's rows written
    meta: AttentionMetadata,
    w_uk: torch.Tensor,  # [H, N, R]
    w_uv: torch.Tensor,  # [H, V, R]
    scale: float,
) -> torch.Tensor:  # [T, H, V]
    """Each row's new tokens attend causally over its cached context: decode rows together,
    absorbed; rows of several tokens one at a time, expanded."""
    if meta.max_query_len == 1:  # decode only, from device tensors (CUDA-graph safe)
        return mla_decode(q_nope, q_pe, kv_cache, meta, None, w_uk, w_uv, scale)
    qsl = meta.query_start_loc_cpu
    q_lens = qsl[1:] - qsl[:-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    decode = [i for i in range(meta.num_seqs) if q_lens[i] == 1]
    if decode:
        tokens = torch.as_tensor(qsl[decode], dtype=torch.int64, device=q_nope.device)
        out[tokens] = mla_decode(q_nope[tokens], q_pe[tokens], kv_cache, meta, decode, w_uk, w_uv,
                                 scale)  # fmt: skip
    for i in range(meta.num_seqs):
        if q_lens[i] > 1:
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            context = row_latents(kv_cache, meta, i)  # [S, R + P]
            out[lo:hi] = mla_prefill(q_nope[lo:hi], q_pe[lo:hi], context, w_uk, w_uv, scale)
    return out


def row_latents(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int) -> torch.Tensor:
    """Row `row`'s cached context, `[seq_len, R + P]`, gathered from its blocks."""
    seq_len, bs = int(meta.seq_lens_cpu[row]), meta.block_size
    blocks = meta.block_tables[row, : -(-seq_len // bs)]
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len]


def mla_decode(
    q_nope: torch.Tensor,  # [B, H, N]
    q_pe: torch.Tensor,  # [B, H, P]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int] | None,  # None: every row (then the lengths only bound on the host)
    w_uk: torch.Tensor,  # [H, N, R]
    w_uv: torch.Tensor,  # [H, V, R]
    scale: float,
) -> torch.Tensor:  # [B, H, V]
    """Absorbed: one query per row against its latent rows, padded to the longest context (in
    a CUDA graph, to its host upper bound; the mask reads the lengths on the device)."""
    rank = w_uk.shape[2]
    seq_lens = meta.seq_lens_cpu if rows is None else meta.seq_lens_cpu[rows]
    width = min(-(-int(seq_lens.max()) // meta.block_size), meta.block_tables.shape[1])
    tables, lens = meta.block_tables[:, :width], meta.seq_lens  # [B, W], [B]
    if rows is not None:
        index = torch.as_tensor(rows, dtype=torch.int64, device=q_nope.device)
        tables, lens = tables.index_select(0, index), lens.index_select(0, index)
    latents = kv_cache[tables].reshape(len(seq_lens), width * meta.block_size, -1)  # [B, S, R+P]
    c, k_pe = latents[..., :rank], latents[..., rank:]
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # [B, H, R]
    scores = torch.einsum("bhr,bsr->bhs", q_lat, c) + torch.einsum("bhp,bsp->bhs", q_pe, k_pe)
    pad = torch.arange(scores.shape[-1], device=q_nope.device)[None, :] >= lens[:, None]
    scores = scores.float().masked_fill(pad[:, None, :], float("-inf")) * scale
    probs = torch.softmax(scores, dim=-1).to(c.dtype)  # [B, H, S]
    o_lat = torch.einsum("bhs,bsr->bhr", probs, c)  # [B, H, R]
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)


def mla_prefill(
    q_nope: torch.Tensor,  # [L, H, N], the row's new tokens (the last L of its context)
    q_pe: torch.Tensor,  # [L, H, P]
    context: torch.Tensor,  # [S, R + P]
    w_uk: torch.Tensor,  # [H, N, R]
    w_uv: torch.Tensor,  # [H, V, R]
    scale: float,
) -> torch.Tensor:  # [L, H, V]
    """Expanded: the context's latents become per-head keys and values, then causal attention."""
    rank = w_uk.shape[2]
    c, k_pe = context[:, :rank], context[:, rank:]  # [S, R], [S, P]
    k_nope = torch.einsum("sr,hnr->hsn", c, w_uk)  # [H, S, N]
    v = torch.einsum("sr,hvr->hsv", c, w_uv)  # [H, S, V]
    scores = torch.einsum("lhn,hsn->hls", q_nope, k_nope)
    scores = scores + torch.einsum("lhp,sp->hls", q_pe, k_pe)  # [H, L, S]
    num_new, seq_len = q_nope.shape[0], context.shape[0]
    pos = torch.arange(seq_len - num_new, seq_len, device=c.device)  # the queries' positions
    future = torch.arange(seq_len, device=c.device)[None, :] > pos[:, None]  # [L, S]
    scores = scores.float().masked_fill(future, float("-inf")) * scale
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hls,hsv->lhv", probs, v)
