"""Paged attention for mixed decode / chunked-prefill batches, in Triton (the CUDA default).

This module checks the inputs, picks tile heights, splits and launch configs, and launches the
kernels of kernels/attention/triton_kernels.py (whose docstring has their algorithm, the cascade's
two passes, FP8 tiles and attention sinks).

Grid, with no host sync: tile ids run over `T // BLOCK_Q + num_seqs`, an upper bound on the tiles
of all rows when row i's tiles start at `query_start_loc[i] // BLOCK_Q + i`; a program finds its
row by binary search over `query_start_loc` and exits if its tile is past the row's end. Every
size comes from host ints the caller already has (shapes, `max_query_len`, `max_seq_len`), so a
decode batch can be captured in a CUDA graph.

Split-K (flash-decoding): a decode batch of few sequences gives fewer programs than SMs, so each
row's KV tiles are also split over `num_splits` programs, each writing an unnormalized partial
output with its running max and sum; `_reduce_kernel` rescales and sums them. Splits divide each
row's own length, so a graph captured at the longest context stays valid for shorter ones.

Compiled variants: the split count and the batch sizes are runtime values, and tiles are 16 rows
(decodes) or 128, so the start-up runs (memory profile, graph capture) compile every variant that
serving meets: a Triton compile in the middle of serving is a second-long stall.
"""

from __future__ import annotations

import torch
import triton

from pagedserve.kernels.attention.cascade import MAX_SPLITS, choose_prefix_splits, use_cascade
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.attention.triton_kernels import _paged_attention_kernel, _reduce_kernel
from pagedserve.kernels.backend import dot_precision, num_sms

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
RESIDENT_PER_SM = 3  # decode programs an SM holds at once (choose_num_splits)
PREFIX_BLOCK_M = 128  # cascade prefix pass: 128-row tiles of (token, query head) pairs


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Splits per row so a decode batch's programs fill each SM's resident slots about once; 1
    for prefills (their tiles already fill the GPU) and for batches that fill it unsplit.

    A decode program holds 64 KB of shared memory (2 stages of 64-key K and V tiles), so an
    SM holds 3 of them: with fewer programs than slots SMs idle, with a wave and a bit the
    last part runs alone. On an H100, 24 rows at 16k tokens (192 programs) read at 2.53 TB/s
    unsplit and 2.95 with 2 splits; 12 rows best take 4, 40 rows 1 or 2 (within 2%)
    (`python -m pagedserve.benchmarks.kernels.bench_kernels --sweep-long`)."""
    programs = num_seqs * num_kv_heads
    if max_query_len > 1:
        return 1
    by_occupancy = round(RESIDENT_PER_SM * num_sms / programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _f16_dots(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the tiles dot in float16: over an FP8 cache, for 16-bit queries (float32 queries
    keep float32 precision)."""
    return kv_cache.dtype == FP8 and query.dtype in (torch.bfloat16, torch.float16)


def _launch_config(block_m: int, f16_dots: bool) -> dict[str, int]:
    """Key tile and pipelining per tile height, measured on an H100 (Llama-3-8B heads, bf16):
    128-row tiles (prefill, mixed) run fastest with 32-key tiles over 3 stages and 4 warps: an
    8 x 1024-token prefill takes 295 us a layer against 337 us with 64-key tiles, 8 warps and 2
    stages (a mixed batch of 256 decodes and 7 prompts 844 against 1005 us); 16-row decode
    tiles keep 64-key tiles (decode batches reach 96-99% of copy bandwidth). Over an FP8 cache
    every tile takes 64 keys, 3 stages and float16 dots (triton_kernels.py's docstring): 256
    decodes at 1,088 tokens 330 -> 287 us, the 8 x 1024 prefill 375 -> 308 us, the mixed batch
    1,031 -> 834 us. The sweeps: `python -m pagedserve.benchmarks.kernels.bench_kernels --sweep` and
    `--sweep-decode`."""
    if f16_dots:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "DOT_F16": True}
    if block_m >= 128:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _check(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"expected query [T, Hq, D] and kv_cache [num_blocks, 2, block_size, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
    if query.shape[2] != kv_cache.shape[4] or query.shape[1] % kv_cache.shape[3]:
        raise ValueError(
            f"query heads/dim {tuple(query.shape[1:])} do not fit the cache's "
            f"{tuple(kv_cache.shape[3:])} (Hq must be a multiple of Hkv, D equal)"
        )
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache need a contiguous last (head_dim) dimension")
    if query.dtype != kv_cache.dtype and kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"query dtype {query.dtype} differs from kv_cache dtype {kv_cache.dtype} (and the "
            "cache is not FP8)"
        )
    tensors = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
    if any(t.dtype != torch.int32 for t in tensors) or meta.block_tables.stride(1) != 1:
        raise ValueError("query_start_loc, seq_lens, block_tables must be int32 (rows contiguous)")
    if any(t.device != query.device for t in (kv_cache, *tensors)):
        raise ValueError("query, kv_cache and the attention metadata must share one device")


def triton_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    *,
    num_splits: int | None = None,  # None: choose from the batch (tests force it)
    block_m: int | None = None,  # None: 16 for decode batches, 128 with prefills
    launch: dict | None = None,  # BLOCK_N, num_warps, num_stages, KV_EVICT (benches, probes)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    prefix_splits: int | None = None,  # cascade: None chooses (tests and benches force it)
    prefix_block_m: int = PREFIX_BLOCK_M,
    sinks: torch.Tensor | None = None,  # [Hq]: attention sinks (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """`paged_attention_ref`'s contract, from device tensors and host ints only; with
    `meta.cascade_len` set, as a cascade (triton_kernels.py's docstring)."""
    _check(query, kv_cache, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    num_seqs = meta.seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    if block_m is None:  # two tile heights only, so start-up compiles every variant serving meets
        block_m = 16 if max(meta.max_query_len, 1) * group_pad <= 16 else 128
    cascade = use_cascade(meta, sliding_window)
    sms = num_sms(query.device.index or 0) if query.is_cuda else 132
    if num_splits is None:
        own_len = meta.max_seq_len - meta.cascade_len if cascade else meta.max_seq_len
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, meta.max_query_len, max(own_len, 0), sms
        )
    n_prefix = 0
    if cascade:  # at most MAX_SPLITS partial slots in all (the merge's width)
        num_splits = min(num_splits, MAX_SPLITS - 1)
        prefix_block_m = max(prefix_block_m, group_pad)
        tiles = triton.cdiv(num_tokens, prefix_block_m // group_pad)
        n_prefix = min(
            prefix_splits or choose_prefix_splits(tiles * num_kv_heads, meta.cascade_len, sms),
            MAX_SPLITS - num_splits,
        )
    slots = num_splits + n_prefix
    part_out = part_ml = out  # unused placeholders without splits
    if slots > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_out = torch.empty(
            slots, num_tokens, num_q_heads, triton.next_power_of_2(head_dim), **f32
        )
        part_ml = torch.empty(slots, num_tokens, num_q_heads, 2, **f32)
    args = (query, kv_cache, meta, scale, sliding_window, logit_softcap, k_scale, v_scale)
    bufs = (out, part_out, part_ml, slots > 1, launch, sinks)
    _launch(*args, *bufs, block_m, num_splits, 0, cascade, False)
    if cascade:
        _launch(*args, *bufs, prefix_block_m, n_prefix, num_splits, False, True)
    if slots > 1:
        _reduce_kernel[(num_tokens, num_q_heads)](
            part_out, part_ml, out, out if sinks is None else sinks, num_tokens, num_q_heads,
            out.stride(0), out.stride(1), slots, SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS),
            BLOCK_D=part_out.shape[3], HEAD_DIM=head_dim, USE_SINKS=sinks is not None,
            num_warps=4,
        )  # fmt: skip
    return out


def _launch(
    query, kv_cache, meta, scale, sliding_window, logit_softcap, k_scale, v_scale,
    out, part_out, part_ml, split, launch, sinks, block_m, num_splits, split_base, after_prefix,
    prefix,
) -> None:  # fmt: skip
    """One `_paged_attention_kernel` launch: the per-row pass (`after_prefix`: from the cascade's
    prefix on) or the cascade's prefix pass (`prefix`), its partials from slot `split_base` on."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_seqs = meta.seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    tiles = triton.cdiv(num_tokens, block_q) if prefix else num_tokens // block_q + num_seqs
    qk_scale, softcap = scale * k_scale * LOG2E, 0.0
    if logit_softcap is not None:
        qk_scale, softcap = scale * k_scale / logit_softcap, logit_softcap * LOG2E
    prefix_len = meta.cascade_len_dev if (prefix or after_prefix) else meta.seq_lens
    _paged_attention_kernel[(tiles, num_kv_heads, num_splits)](
        query, kv_cache, out, part_out, part_ml,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, prefix_len,
        out if sinks is None else sinks,
        num_seqs, num_tokens, num_q_heads, qk_scale, v_scale, softcap, sliding_window or 0,
        num_splits, split_base,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SPLIT=split, USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=logit_softcap is not None, PREFIX=prefix, AFTER_PREFIX=after_prefix,
        USE_SINKS=sinks is not None and not split, DOT_PRECISION=dot_precision(query.dtype),
        **{"DOT_F16": False, **(launch or _launch_config(block_m, _f16_dots(query, kv_cache)))},
    )  # fmt: skip
