"""Paged attention for mixed decode / chunked-prefill batches, in Triton (the CUDA default).

Algorithm. The batch's query tokens are cut into tiles of `BLOCK_Q` consecutive tokens of one
row; a program owns one tile, one KV head and one KV split. Its `BLOCK_M = BLOCK_Q * GROUP_PAD`
matrix rows are (token, query head) pairs over every query head that shares the KV head (GQA), so
each K/V tile is read once per KV head and feeds one `tl.dot` for the whole group: for a decode the
group's heads are the M dimension (4 heads of Llama-3-8B padded to M = 16). The program walks the
row's block table `BLOCK_N` keys at a time, gathering keys from their paged blocks (any
`block_size`), masks causally (and by the sliding window), and keeps an online softmax in float32
(exp2 with log2(e) folded into the scale).

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

Cascade (kernels/attention/cascade.py): with `meta.cascade_len` set on a decode batch, the kernel
runs twice from one body: a prefix pass (`PREFIX`) where the whole batch is one "row" of num_tokens
queries tiled 128 (token, head) rows at a time over keys [0, prefix) of row 0's table, without a
causal mask (every query follows the prefix), split over the prefix keys; and the per-row pass
(`AFTER_PREFIX`) from key `prefix` on. Both write split-K partials (the prefix pass at slots after
the per-row pass's) and `_reduce_kernel` merges them. The prefix length is read from device memory,
so a CUDA graph replays with another prefix; 0 there makes the prefix pass empty.

FP8 cache: K/V tiles load as e4m3 and convert for the dots; k_scale folds into the score scale
and v_scale into the output, so dequantization costs no extra multiply per key. With 16-bit
queries the tiles convert to float16 (`DOT_F16`), one instruction per pair of values, where
bfloat16 takes several: attention over an FP8 cache is bound by that conversion, not by memory
(`_launch_config` has the times). The query is multiplied by the score scale in float32 before
its cast to float16, which keeps it far from float16's range limit; p is in [0, 1].

Float32 models take IEEE float32 dots (`dot_precision`): Triton's default rounds float32 operands
to TF32 (10-bit mantissa), which made a speculative verification step (several queries a row,
unsplit) and a decode step (a graph's split-K) of a float32 model differ by up to 7e-5 in a
logprob instead of 1e-6 (H100, docs/speculative-decoding.md), enough to flip greedy near ties.

Attention sinks (gpt-oss: one learned logit per query head whose value row is zero) join the
softmax where it is normalized: in the epilogue of an unsplit launch, else once in
`_reduce_kernel` (so split-K and the cascade's passes add each head's sink exactly once).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention.cascade import MAX_SPLITS, choose_prefix_splits, use_cascade
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.backend import dot_precision

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
RESIDENT_PER_SM = 3  # decode programs an SM holds at once (choose_num_splits)
PREFIX_BLOCK_M = 128  # cascade prefix pass: 128-row tiles of (token, query head) pairs


@triton.jit
def _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The last row whose first tile (`query_start_loc[i] // BLOCK_Q + i`) is <= tile_idx."""
    lo: tl.int32 = 0
    hi = lo + num_seqs  # a tensor even when num_seqs == 1 is specialized to a constant
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Batch sizes change every step: left unspecialized (Triton would otherwise compile a variant per
# "== 1" / "multiple of 16" case, each a second-long stall in the middle of serving). So are the
# metadata pointers and the block-table row stride: a mixed-step graph reads them from one int32
# buffer at offsets that are not 16-byte aligned while an eager step's are, and an eager step's
# table width (its longest row's block count) is a multiple of 16 or not from step to step; each
# combination was its own compile, and the eager one with a width that is a multiple of 16 was
# first met while serving (a long prompt's chunk). Scalar and gathered loads gain nothing from
# the alignment hints.
@triton.jit(
    do_not_specialize=[
        "num_seqs", "num_tokens", "num_splits", "query_start_loc_ptr", "seq_lens_ptr",
        "block_tables_ptr", "stride_bt", "prefix_len_ptr", "split_base",
    ]
)  # fmt: skip
def _paged_attention_kernel(
    query_ptr, kv_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, prefix_len_ptr, sinks_ptr,
    num_seqs, num_tokens, num_q_heads, qk_scale, v_scale, softcap, window, num_splits,
    split_base,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, PREFIX: tl.constexpr, AFTER_PREFIX: tl.constexpr,
    DOT_F16: tl.constexpr, USE_SINKS: tl.constexpr = False, KV_EVICT: tl.constexpr = "",
    DOT_PRECISION: tl.constexpr = "tf32",
):  # fmt: skip
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PREFIX:  # cascade prefix pass: the whole batch is one row over the shared prefix keys
        q_start = 0
        q_len = num_tokens
        local_tile = tile_idx
        table_ptr = block_tables_ptr  # row 0's table: every row's, up to the prefix's end
        seq_len = tl.load(prefix_len_ptr)
        ctx_len = seq_len  # every query sits after the prefix (the host caps it so)
        kv_start = 0
    else:
        seq = _find_seq_idx(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_tile = tile_idx - (q_start // BLOCK_Q + seq)
        if local_tile * BLOCK_Q >= q_len:
            return
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len  # cached tokens before this step's first query
        kv_start = 0
        if AFTER_PREFIX:  # cascade per-row pass: the prefix pass covers keys [0, prefix_len)
            kv_start = tl.load(prefix_len_ptr)

    rows = tl.arange(0, BLOCK_M)
    q_off = local_tile * BLOCK_Q + rows // GROUP_PAD  # [M] query index within the row
    head = kv_head * GROUP + rows % GROUP_PAD  # [M] query head
    row_ok = (rows % GROUP_PAD < GROUP) & (q_off < q_len)
    q_pos = ctx_len + q_off  # [M] absolute positions
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_start + q_off).to(tl.int64)
    q_ptrs = query_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if DOT_F16:  # float16 dots over an FP8 cache (see the module doc); q pre-scaled
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)

    # Keys this tile can see: causal end at its last query; the window (or the cascade's
    # prefix, seen by the prefix pass) trims the start.
    kv_end = tl.minimum(seq_len, ctx_len + (local_tile + 1) * BLOCK_Q)
    if USE_WINDOW:
        first_tile = tl.maximum(ctx_len + local_tile * BLOCK_Q - window + 1, 0) // BLOCK_N
    else:
        first_tile = kv_start // BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_kv_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + n  # [N]
        k_ok = k_pos < kv_end
        if AFTER_PREFIX:
            k_ok = k_ok & (k_pos >= kv_start)
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_ptrs = kv_cache_ptr + kv_off[:, None] + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT).to(q.dtype)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)
        v = v.to(q.dtype)
        # [M, N], log2 domain (or s / cap, capped); float32 models in IEEE float32, not TF32
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if not DOT_F16:
            s = s * qk_scale
        if USE_SOFTCAP:  # cap * tanh(s / cap), in the log2 domain: softcap = cap * log2(e)
            s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap
        if PREFIX:  # non-causal: every query follows the whole prefix
            mask = k_ok[None, :] & row_ok[:, None]
        else:
            mask = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    acc = acc * v_scale
    if not SPLIT:
        if USE_SINKS:  # one more logit per head, with a zero value row (log2 domain)
            sink = (
                tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
                * 1.4426950408889634
            )
            m_fin = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_fin)
            l_i = l_i * rescale + tl.exp2(sink - m_fin)
            acc = acc * rescale[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: out [S, T, Hq, BLOCK_D] and (max, sum) [S, T, Hq, 2], all contiguous.
        row = ((split_base + split) * num_tokens + tok) * num_q_heads + head  # [M] int64
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, sinks_ptr, num_tokens, num_q_heads, stride_ot, stride_oh,
    num_splits, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_SINKS: tl.constexpr = False,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    row = (s * num_tokens + tok) * num_q_heads + head  # [S]
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:  # the head's sink joins once, here, whatever the splits (and cascade passes)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [S]; empty splits weigh 0
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    denom = tl.sum(l * w, 0)
    if USE_SINKS:
        denom += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denom  # [D]
    o_ptrs = out_ptr + tok * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    every tile takes 64 keys, 3 stages and float16 dots (the module doc): 256 decodes at 1,088
    tokens 330 -> 287 us, the 8 x 1024 prefill 375 -> 308 us, the mixed batch 1,031 -> 834 us.
    The sweeps: `python -m pagedserve.benchmarks.kernels.bench_kernels --sweep` and
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
    `meta.cascade_len` set, as a cascade (the module docstring)."""
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
    sms = _num_sms(query.device.index or 0) if query.is_cuda else 132
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
