"""Paged attention's Triton kernels (launched by kernels/attention/triton.py): the attention
pass over the block table and the split-K merge.

Algorithm. The batch's query tokens are cut into tiles of `BLOCK_Q` consecutive tokens of one
row; a program owns one tile, one KV head and one KV split. Its `BLOCK_M = BLOCK_Q * GROUP_PAD`
matrix rows are (token, query head) pairs over every query head that shares the KV head (GQA), so
each K/V tile is read once per KV head and feeds one `tl.dot` for the whole group: for a decode the
group's heads are the M dimension (4 heads of Llama-3-8B padded to M = 16). The program walks the
row's block table `BLOCK_N` keys at a time, gathering keys from their paged blocks (any
`block_size`), masks causally (and by the sliding window), and keeps an online softmax in float32
(exp2 with log2(e) folded into the scale).

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

import triton
import triton.language as tl


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
