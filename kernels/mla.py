"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache.

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
  once, as is, for every head (on CUDA a Triton kernel, kernels/triton_mla.py).
- prefill (several new tokens): the row's latents expand to per-head K and V
  (`kv_b_proj` over the context), then ordinary causal attention with 192-wide keys and
  128-wide values: fewer FLOPs than absorption when the queries are many.

On CUDA a step whose rows add at most `ABSORB_MAX_TOKENS` tokens each attends absorbed as a
whole, causally, in one Triton launch that reads the layout on the device only: the path of
DeepSeek's mixed-step CUDA graphs (worker/models/deepseek_v3.py captures them up to that many
tokens; their host layout is unknown). Longer prompt chunks run eager and expanded.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.backend import fusion_enabled, triton_available, use_triton

# Prompt chunks up to this many tokens attend absorbed on CUDA (the Triton kernel: a program per
# token, each re-reading its context, against expansion's one pass per row: cheap for short
# chunks, costly for long ones); mixed-step CUDA graphs are captured up to this size.
ABSORB_MAX_TOKENS = 256


def triton_mla_enabled() -> bool:
    """Whether MLA attends in Triton on CUDA (off: `PAGEDSERVE_DISABLE_FUSIONS=mla-decode`)."""
    return triton_available() and fusion_enabled("mla-decode")


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
    if meta.max_query_len <= ABSORB_MAX_TOKENS and q_nope.is_cuda and triton_mla_enabled():
        return mla_decode(q_nope, q_pe, kv_cache, meta, None, w_uk, w_uv, scale, causal=True)
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
    q_nope: torch.Tensor,  # [B, H, N] (causal: [T, H, N])
    q_pe: torch.Tensor,  # [B, H, P]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int] | None,  # None: every row (then the lengths only bound on the host)
    w_uk: torch.Tensor,  # [H, N, R]
    w_uv: torch.Tensor,  # [H, V, R]
    scale: float,
    causal: bool = False,  # every row's tokens, each over the keys up to it (Triton only)
) -> torch.Tensor:  # [B, H, V]
    """Absorbed: the query into latent space, attention over the latent rows (on CUDA the Triton
    kernel, kernels/triton_mla.py; else `mla_decode_ref`), the output through `W_UV`. Both read
    the lengths on the device (CUDA-graph safe); the host lengths only bound them."""
    seq_lens = meta.seq_lens_cpu if rows is None else meta.seq_lens_cpu[rows]
    tables, lens = meta.block_tables, meta.seq_lens  # [B, W], [B]
    if rows is not None:
        index = torch.as_tensor(rows, dtype=torch.int64, device=q_nope.device)
        tables, lens = tables.index_select(0, index), lens.index_select(0, index)
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # [B, H, R]
    bound = int(seq_lens.max(initial=0))
    if causal or (q_lat.is_cuda and triton_mla_enabled()):
        from pagedserve.kernels.triton_mla import triton_mla_decode

        qsl = meta.query_start_loc if causal else None
        o_lat = triton_mla_decode(q_lat, q_pe, kv_cache, tables, lens, bound, scale,
                                  query_start_loc=qsl)  # fmt: skip
    else:
        o_lat = mla_decode_ref(q_lat, q_pe, kv_cache, tables, lens, bound, scale)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)


def mla_decode_ref(
    q_lat: torch.Tensor,  # [B, H, R]
    q_pe: torch.Tensor,  # [B, H, P]
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B], on the device
    max_seq_len: int,  # host upper bound on seq_lens
    scale: float,
) -> torch.Tensor:  # [B, H, R]
    """Latent attention in torch: each row's latent rows gathered and padded to `max_seq_len`
    (in a CUDA graph max_model_len), the mask from the device lengths."""
    rank, block_size = q_lat.shape[2], kv_cache.shape[2]
    width = min(-(-max_seq_len // block_size), block_tables.shape[1])
    latents = kv_cache[block_tables[:, :width]].reshape(len(q_lat), width * block_size, -1)
    c, k_pe = latents[..., :rank], latents[..., rank:]  # [B, S, R], [B, S, P]
    scores = torch.einsum("bhr,bsr->bhs", q_lat, c) + torch.einsum("bhp,bsp->bhs", q_pe, k_pe)
    pad = torch.arange(scores.shape[-1], device=q_lat.device)[None, :] >= seq_lens[:, None]
    scores = scores.float().masked_fill(pad[:, None, :], float("-inf")) * scale
    probs = torch.softmax(scores, dim=-1).to(c.dtype)  # [B, H, S]
    return torch.einsum("bhs,bsr->bhr", probs, c)


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
