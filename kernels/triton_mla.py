"""MLA's Triton kernels over the paged latent cache (kernels/mla.py launches them on CUDA).

- The latent cache write: one program copies one token's `[c | k_pe]` row into its slot of
  `[num_blocks, 1, block_size, 1, R + P]`, skipping slots < 0 (the padding rows of a CUDA graph's
  decode batch, which must not touch block 0's rows that a real request may own).
- The absorbed decode (`triton_mla_decode`): flash-decoding in latent space, each latent tile read
  once for a group of heads, split over the context with a merge kernel (see below). The torch
  reference is kernels/mla.py's `mla_decode_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention.triton import LOG2E
from pagedserve.kernels.backend import dot_precision, num_sms


@triton.jit
def _write_latent_kernel(
    latent_ptr, cache_ptr, slot_ptr, stride_t, stride_cb, stride_cs,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    i = tl.arange(0, BLOCK)
    ok = i < WIDTH
    row = tl.load(latent_ptr + tok * stride_t + i, mask=ok)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + i
    tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=ok)


def triton_write_latent_cache(
    latent: torch.Tensor,  # [T, R + P]
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
    slot_mapping: torch.Tensor,  # [T] int64, < 0: skip
) -> None:
    width = latent.shape[1]
    if latent.stride(1) != 1 or kv_cache.shape[-1] != width or not kv_cache.is_contiguous():
        raise ValueError(f"latent {tuple(latent.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if latent.shape[0] == 0:
        return
    _write_latent_kernel[(latent.shape[0],)](
        latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0), kv_cache.stride(2),
        WIDTH=width, BLOCK=triton.next_power_of_2(width), BLOCK_SIZE=kv_cache.shape[2],
    )  # fmt: skip


# Absorbed attention over the paged latent cache (flash-decoding in latent space).
#
# A program owns one query token, BLOCK_H of its heads and one split of the keys it sees. Every
# MLA head reads the same latent, so each [BLOCK_N, R + P] tile of `[c | k_pe]` is loaded once for
# the program's heads and feeds three dots: scores `q_lat c^T + q_pe k_pe^T` ([BLOCK_H, BLOCK_N])
# and the output `p c` ([BLOCK_H, R]); an online softmax in float32 (exp2, log2(e) folded into the
# scale). Lengths are read on the device: a CUDA graph's split count is fixed at capture (from a
# host bound, max_model_len) and the token's key tiles are divided among the splits at replay, so
# a short context leaves the later splits empty (they store a -inf max and weigh nothing in the
# merge). With one split the program normalizes and stores o_lat itself; else it stores the
# unnormalized partial and its (max, sum), and `_mla_reduce_kernel` merges each (token, head)
# over the splits. A decode batch has one token per row (`EXTEND` off: token i is row i, seeing
# the row's whole context); with `EXTEND` rows add several tokens (`query_start_loc`, on the
# device), each finds its row by binary search and sees the keys up to its own position (causal).
# A token that sees no key (an empty row of a padded batch) gets zeros.


@triton.jit
def _query_row(query_start_loc_ptr, seq_lens_ptr, tok, num_seqs, EXTEND: tl.constexpr):
    """Token `tok`'s row and how many keys it sees: the last row starting at or before it (empty
    rows share their start with the next row), its context up to and with the token."""
    if EXTEND:
        lo: tl.int32 = 0
        hi = lo + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) <= tok:
                lo = mid + 1
            else:
                hi = mid
        row = lo - 1
        q_end = tl.load(query_start_loc_ptr + row + 1)
        seen = tl.load(seq_lens_ptr + row) - (q_end - tok) + 1
        seen = tl.where(tok < q_end, seen, 0)  # a graph's capture runs over a zeroed layout
    else:
        row = tok
        seen = tl.load(seq_lens_ptr + tok)
    return row, seen


# Eager steps' tables are copies as wide as their longest row, a mixed graph's metadata sits at
# unaligned offsets of one buffer: left unspecialized, as kernels/attention/triton_kernels.py's
# (each "multiple of 16" variant would be a compile in the middle of serving).
@triton.jit(
    do_not_specialize=[
        "tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "stride_bt", "num_seqs", "num_splits"
    ]
)  # fmt: skip
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    part_out_ptr, part_ml_ptr, stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs,
    stride_bt, stride_ob, stride_oh, num_heads, num_seqs, num_splits, qk_scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    EXTEND: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    split = tl.program_id(2)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    h_ok = head < num_heads
    row, seq_len = _query_row(query_start_loc_ptr, seq_lens_ptr, tok, num_seqs, EXTEND)
    row, tok = row.to(tl.int64), tok.to(tl.int64)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_P)
    r_ok, e_ok = r < RANK, e < ROPE
    q_ptrs = q_lat_ptr + tok * stride_qb + head[:, None] * stride_qh + r[None, :]
    q_lat = tl.load(q_ptrs, mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [H, R]
    pe_ptrs = q_pe_ptr + tok * stride_pb + head[:, None] * stride_ph + e[None, :]
    q_pe = tl.load(pe_ptrs, mask=h_ok[:, None] & e_ok[None, :], other=0.0)  # [H, P]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = tables_ptr + row * stride_bt
    for t in range(tile_lo, tile_hi):  # each tile holds at least one key
        pos = t * BLOCK_N + n  # [N]
        ok = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        base = cache_ptr + block * stride_cb + (pos % BLOCK_SIZE) * stride_cs  # [N]
        c = tl.load(base[:, None] + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(base[:, None] + RANK + e[None, :], mask=ok[:, None] & e_ok[None, :],
                       other=0.0)  # fmt: skip
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [H, N]
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = h_ok[:, None] & r_ok[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tok * stride_ob + head[:, None] * stride_oh + r[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials [B, S, Hh, BLOCK_R] and (max, sum) [B, S, Hh, 2], contiguous
        slot = (tok * num_splits + split) * num_heads + head  # [H]
        # every column, the padding ones zero: the merge reads them all
        tl.store(part_out_ptr + slot[:, None] * BLOCK_R + r[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + slot * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    slot = (tok * num_splits + s) * num_heads + head  # [S]
    m = tl.load(part_ml_ptr + slot * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty row: every split empty
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [S]; empty splits weigh 0
    r = tl.arange(0, BLOCK_R)
    acc = tl.load(part_out_ptr + slot[:, None] * BLOCK_R + r[None, :], mask=s_ok[:, None],
                  other=0.0)  # fmt: skip
    denom = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [R]
    tl.store(out_ptr + tok * stride_ob + head * stride_oh + r, out.to(out_ptr.dtype.element_ty),
             mask=r < RANK)  # fmt: skip


MAX_SPLITS = 16  # partials [B, S, H, R] float32: 4 MB at batch 1 and V3's 128 heads
MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost outweighs its parallelism
PROGRAMS_PER_SM = 2
DECODE_CONFIG = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def choose_mla_splits(num_rows: int, head_groups: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per row so a decode batch's programs fill the SMs about twice, none shorter than
    `MIN_TOKENS_PER_SPLIT` of the host bound on the longest row (in a CUDA graph max_model_len:
    the rows' actual tiles are divided among the splits on the device)."""
    by_occupancy = round(PROGRAMS_PER_SM * num_sms / (num_rows * head_groups))
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _check_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
) -> None:
    rank, rope = q_lat.shape[-1], q_pe.shape[-1]
    if q_lat.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2] or kv_cache.dim() != 5:
        shapes = f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(kv_cache.shape)}"
        raise ValueError(f"expected q_lat [T, H, R], q_pe [T, H, P], a 5-d cache; got {shapes}")
    if kv_cache.shape[-1] != rank + rope or not kv_cache.is_contiguous():
        raise ValueError(
            f"cache {tuple(kv_cache.shape)} does not hold rows of R + P = {rank + rope}"
        )
    if q_lat.dtype != kv_cache.dtype or q_pe.dtype != kv_cache.dtype:
        raise ValueError(
            f"q_lat {q_lat.dtype}, q_pe {q_pe.dtype} differ from cache {kv_cache.dtype}"
        )
    index = (block_tables, seq_lens) + (() if query_start_loc is None else (query_start_loc,))
    if any(t.dtype != torch.int32 for t in index):
        raise ValueError("block_tables, seq_lens and query_start_loc must be int32")
    rows = q_lat.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    if block_tables.shape[0] != rows or seq_lens.shape != (rows,):
        raise ValueError("block_tables and seq_lens need one row per sequence")
    if any(t.device != q_lat.device for t in (q_pe, kv_cache, *index)):
        raise ValueError("q_lat, q_pe, kv_cache and the metadata must share one device")


def triton_mla_decode(
    q_lat: torch.Tensor,  # [T, H, R]: the absorbed query, W_UK^T q_nope
    q_pe: torch.Tensor,  # [T, H, P], rotated
    kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, on the device (0: an empty row, zeros out)
    max_seq_len: int,  # host upper bound on seq_lens (picks the split count)
    scale: float,
    num_splits: int | None = None,  # None: choose (tests force it)
    config: dict[str, int] | None = None,
    query_start_loc: torch.Tensor | None = None,  # [B + 1] int32; None: one token a row (T = B)
) -> torch.Tensor:  # [T, H, R]: softmax(q_lat c^T + q_pe k_pe^T) c over the keys each token sees
    _check_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, query_start_loc)
    cfg = dict(config or DECODE_CONFIG)
    block_h, (tokens, heads, rank), rope = cfg.pop("BLOCK_H"), q_lat.shape, q_pe.shape[-1]
    q_lat = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(2) == 1 else q_pe.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    out = q_lat.new_empty(tokens, heads, rank)
    if tokens == 0:
        return out
    groups = triton.cdiv(heads, block_h)
    if num_splits is None:
        sms = num_sms(q_lat.device.index or 0) if q_lat.is_cuda else 1
        num_splits = choose_mla_splits(tokens, groups, max_seq_len, sms)
    block_r = max(16, triton.next_power_of_2(rank))  # tl.dot needs K >= 16
    part_out = part_ml = out  # placeholders when unsplit
    if num_splits > 1:
        part_out = q_lat.new_empty(tokens, num_splits, heads, block_r, dtype=torch.float32)
        part_ml = q_lat.new_empty(tokens, num_splits, heads, 2, dtype=torch.float32)
    extend = query_start_loc is not None
    _mla_decode_kernel[(tokens, groups, num_splits)](
        q_lat, q_pe, kv_cache, block_tables, seq_lens, query_start_loc if extend else seq_lens,
        out, part_out, part_ml, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), heads, block_tables.shape[0], num_splits, scale * LOG2E,
        RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h, BLOCK_SIZE=kv_cache.shape[2], SPLIT=num_splits > 1, EXTEND=extend,
        DOT_PRECISION=dot_precision(q_lat.dtype), **cfg,
    )  # fmt: skip
    if num_splits > 1:
        _mla_reduce_kernel[(tokens, heads)](
            part_out, part_ml, out, heads, num_splits, out.stride(0), out.stride(1),
            RANK=rank, BLOCK_R=block_r, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
