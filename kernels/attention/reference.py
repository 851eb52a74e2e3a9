"""The torch reference of the paged-attention contract: the oracle every backend is tested
against, and what runs where no fast path applies.

The contract every backend keeps: a layer first writes the whole batch's new K/V into the cache
(`write_kv_cache`), then attends (`paged_attention`) reading keys and values only from the cache.
Writing first lets two requests of one batch share prefix blocks written in that very step, and
lets a prefill chunk see its earlier chunks without the caller passing them in.

FP8 cache (`--kv-cache-dtype fp8`): the cache tensor is float8_e4m3fn; a write stores
`k / k_scale` (clamped to the e4m3 range) and attention reads `k_fp8 * k_scale` (likewise v), with
one per-tensor scale per layer from the checkpoint (`k_scale` / `v_scale`) or 1.0.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata

QUERY_CHUNK = 1024  # query rows per score matrix in the reference
FP8_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V as the cache stores it: FP8 divided by its scale and clamped, else a plain cast."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    keep = slot_mapping >= 0
    key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size  # [T]
    kv_cache[block_ids, 0, offsets] = to_cache_dtype(key, kv_cache.dtype, k_scale)
    kv_cache[block_ids, 1, offsets] = to_cache_dtype(value, kv_cache.dtype, v_scale)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [Hq]: a learned logit per head (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each row's new tokens over its whole cached context.

    Query token j of row i sits at absolute position `seq_len_i - q_len_i + j` and attends keys at
    positions <= its own (and, with a sliding window, > position - window). Softmax in float32;
    `logit_softcap` c bounds the scaled scores to `c * tanh(s / c)` first (Gemma 2). `sinks`
    join each head's softmax as one more logit whose value row is zero (attention sinks): they
    take a share of the weight and attend to nothing.
    """
    out = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        start, end = int(qsl[i]), int(qsl[i + 1])
        if end == start:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :num_blocks].long()  # [nb]
        kv = kv_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]  # [2, S, Hkv, D]
        key = (kv[0].float() * k_scale).repeat_interleave(group, dim=1)  # [S, Hq, D]
        value = (kv[1].float() * v_scale).repeat_interleave(group, dim=1)  # [S, Hq, D]
        # Query chunks bound the float32 scores at [Hq, QUERY_CHUNK, S] for long prefills.
        for q_start in range(start, end, QUERY_CHUNK):
            q_end = min(q_start + QUERY_CHUNK, end)
            first_pos = seq_len - (end - q_start)
            q = query[q_start:q_end].float()  # [L, Hq, D]
            out[q_start:q_end] = _attend(
                q, key, value, first_pos, scale, sliding_window, logit_softcap, sinks
            )
    return out


def _attend(
    q: torch.Tensor,  # [L, Hq, D] float32, first query at absolute position first_pos
    key: torch.Tensor,  # [S, Hq, D] float32
    value: torch.Tensor,  # [S, Hq, D] float32
    first_pos: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, key) * scale  # [Hq, L, S]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    q_pos = torch.arange(first_pos, first_pos + q.shape[0], device=q.device)[:, None]  # [L, 1]
    k_pos = torch.arange(key.shape[0], device=q.device)[None, :]  # [1, S]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    scores.masked_fill_(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # [Hq, L, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value)
