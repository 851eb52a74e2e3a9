"""Batched paged attention for CPUs: every request of a step in a handful of torch ops.

`paged_attention_ref` loops over requests in Python (about ten ops per request per layer), so a
32-request decode step on a CPU is mostly interpreter and dispatch time. Here the rows of a step
are split into two groups, decodes (one query token) and the rest (prefill chunks), and each group
runs as one padded batch: gather its blocks by block table into `[B, S, Hkv, D]` keys and values,
and one `scaled_dot_product_attention` call (GQA inside, a boolean mask for causality, context
length and the sliding window). Two groups rather than one keep a long prefill chunk from padding
every decode in the step to its length.

Everything that depends only on the batch layout (which tokens, which blocks, the masks) is built
once per step with numpy and cached on the step's `AttentionMetadata`, which every layer shares.

Where the C++ kernel builds (kernels/cpu_native.py, float32 and bfloat16 caches) the decode group
instead runs it: it reads the cache in place, with no copy of the keys and no per-(row, head)
SDPA call, 2-5x faster than gather + SDPA at 1-32 rows.

Rows of a few queries (up to `MAX_SHORT_QUERIES`: a speculative verification's k + 1, a short
prompt) form a third group, which the kernel runs too, as one decode row per query over the
keys up to its position (its block table repeated). That is exactly what the decode steps of
those positions compute, the same sums in the same order, so a verification's attention equals
plain decoding's bit for bit (greedy output with speculation on is the same by construction, not
by luck of rounding). It is faster too, less so with more queries (SmolLM2's 9 query and 3 KV
heads over 600 keys, 2 threads of the EPYC: 3 queries 234 against 410 us a layer through the
gather, mask and SDPA, 9 queries 569 against 716, 13 queries 648 against 644).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.attention.reference import paged_attention_ref, to_cache_dtype

MAX_SHORT_QUERIES = 16  # a row of at most this many queries runs them as decode rows (native)


@dataclass
class PaddedGroup:
    """Rows of one step that attend as one padded batch of `L` queries per row over `S` keys.

    The `G` query heads that share a KV head are folded into the query dimension (`G * L`
    queries per KV head, head-major), so SDPA runs `B * Hkv` problems rather than `B * Hq` with
    each KV head broadcast: on a CPU the per-problem cost dominates at decode sizes."""

    token_index: torch.Tensor  # [B * L] int64: flattened query token per (row, j), 0 if pad
    out_index: torch.Tensor | None  # [N] int64: padded positions that hold real tokens
    dest: torch.Tensor | None  # [N] int64: those tokens' indices in the step (None: all, in order)
    block_tables: torch.Tensor  # [B, nb] int64
    query_positions: np.ndarray  # [B, G * L] absolute position of each query (padding repeats)
    num_keys: int  # S = nb * block_size
    max_query_len: int  # L
    seq_lens: torch.Tensor  # [B] int64

    @functools.cached_property
    def masks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_pos [B, 1, G * L, 1], k_pos [1, 1, 1, S], causal mask [B, 1, G * L, S] bool) for
        SDPA, made on first use: decode rows that run the C++ kernel never need them."""
        k_pos = np.arange(self.num_keys)  # [S]
        q_pos = self.query_positions
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, G * L, S]; q_pos < seq_len
        q_pos, k_pos, mask = (
            torch.from_numpy(np.ascontiguousarray(a)).to(self.seq_lens.device)
            for a in (q_pos[:, None, :, None], k_pos[None, None, None, :], mask[:, None])
        )
        return q_pos, k_pos, mask

    @functools.cached_property
    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [B * L, nb], seq_lens [B * L] int64) of each query as a decode row of its
        own: its row's table, its position + 1."""
        q_pos = self.query_positions[:, : self.max_query_len] + 1  # the first of G copies
        seq_lens = torch.from_numpy(np.ascontiguousarray(q_pos.reshape(-1)))
        tables = self.block_tables.repeat_interleave(self.max_query_len, dim=0).contiguous()
        return tables, seq_lens.to(self.seq_lens.device)


def _group(meta: AttentionMetadata, rows: np.ndarray, dense: bool, group: int) -> PaddedGroup:
    """Layout of `rows` (indices into the step's sequences) for `group` query heads per KV head;
    `dense` says they are all the step's tokens in order, so the output needs no scatter."""
    qsl = meta.query_start_loc_cpu.astype(np.int64)
    q_lens = (qsl[1:] - qsl[:-1])[rows]  # [B]
    seq_lens = meta.seq_lens_cpu[rows].astype(np.int64)  # [B]
    max_q = int(q_lens.max())
    nb = -(-int(seq_lens.max()) // meta.block_size)
    j = np.arange(max_q)[None, :]  # [1, L]
    real = j < q_lens[:, None]  # [B, L]
    tokens = np.where(real, qsl[rows][:, None] + j, 0)  # [B, L]
    # Padding queries repeat the row's last position, so every query row sees some key.
    q_pos = seq_lens[:, None] - q_lens[:, None] + np.minimum(j, q_lens[:, None] - 1)  # [B, L]
    q_pos = np.tile(q_pos, (1, group))  # [B, G * L]
    device = meta.seq_lens.device
    block_tables = meta.block_tables[torch.from_numpy(rows).to(device), :nb].long()
    flat_real = np.nonzero(real.reshape(-1))[0]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return PaddedGroup(
        token_index=dev(tokens.reshape(-1)),
        out_index=None if dense else dev(flat_real),
        dest=None if dense else dev(tokens.reshape(-1)[flat_real]),
        block_tables=block_tables,
        query_positions=q_pos,
        num_keys=nb * meta.block_size,
        max_query_len=max_q,
        seq_lens=dev(seq_lens),
    )


def padded_groups(meta: AttentionMetadata, group: int) -> list[PaddedGroup]:
    """The step's decode, short and prefill groups (any may be absent), built once per step
    (per query heads per KV head, which is the same in every layer of the models we run)."""
    key = ("cpu_groups", group)
    groups = meta.scratch.get(key)
    if groups is None:
        q_lens = np.diff(meta.query_start_loc_cpu)
        decode = np.nonzero(q_lens == 1)[0]
        short = np.nonzero((q_lens > 1) & (q_lens <= MAX_SHORT_QUERIES))[0]
        prefill = np.nonzero(q_lens > MAX_SHORT_QUERIES)[0]
        parts = [rows for rows in (decode, short, prefill) if len(rows)]
        # one group, no padding: its queries are the step's tokens in order
        dense = len(parts) == 1 and int(q_lens.min()) == int(q_lens.max())
        groups = [_group(meta, rows, dense, group) for rows in parts]
        meta.scratch[key] = groups
    return groups


def cpu_write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], contiguous
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`write_kv_cache_ref` in two `index_copy_` calls per layer: the cache rows of the step's
    tokens (padding slots dropped) are worked out once per step and shared by every layer."""
    rows = meta.scratch.get("cpu_kv_rows")
    if rows is None:
        rows = _cache_rows(meta.slot_mapping, kv_cache.shape[2])
        meta.scratch["cpu_kv_rows"] = rows
    keep, k_rows, v_rows = rows
    if keep is not None:
        key, value = key[keep], value[keep]
    key = to_cache_dtype(key, kv_cache.dtype, k_scale)
    value = to_cache_dtype(value, kv_cache.dtype, v_scale)
    flat = kv_cache.view(-1, *kv_cache.shape[3:])  # [num_blocks * 2 * block_size, Hkv, D]
    if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no FP8 kernel: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat.index_copy_(0, k_rows, key)
    flat.index_copy_(0, v_rows, value)


def _cache_rows(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(kept token indices or None for all, K rows, V rows) in the cache viewed as rows."""
    keep = None
    if bool((slot_mapping < 0).any()):
        keep = torch.nonzero(slot_mapping >= 0).squeeze(1)
        slot_mapping = slot_mapping[keep]
    k_rows = slot_mapping // block_size * (2 * block_size) + slot_mapping % block_size
    return keep, k_rows, k_rows + block_size


def cpu_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, D]
    """`paged_attention_ref`'s contract, batched: same inputs, same outputs (to rounding).
    SDPA has neither soft-capping nor sinks, so Gemma 2's capped scores and gpt-oss's sinks take
    the reference path. An FP8 cache's scales are exact here: k_scale folds into the score
    scale, v_scale into the output."""
    if logit_softcap is not None or sinks is not None:
        return paged_attention_ref(
            query, kv_cache, meta, scale, sliding_window, logit_softcap, k_scale, v_scale, sinks
        )
    scale = scale * k_scale
    groups = padded_groups(meta, query.shape[1] // kv_cache.shape[3])
    native = kv_cache.dtype in cpu_native.CACHE_DTYPES and cpu_native.available()

    def attend(group: PaddedGroup) -> torch.Tensor:  # [B, L, Hq, D]
        if native and group.max_query_len <= MAX_SHORT_QUERIES:
            return _attend_decode(query, kv_cache, group, scale, sliding_window)
        return _attend_group(query, kv_cache, group, scale, sliding_window)

    if len(groups) == 1 and groups[0].dest is None:
        out = attend(groups[0]).flatten(0, 1)
    else:
        out = torch.zeros_like(query)
        for group in groups:
            out[group.dest] = attend(group).flatten(0, 1)[group.out_index]
    return out if v_scale == 1.0 else out * v_scale


def _attend_decode(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    group: PaddedGroup,  # up to MAX_SHORT_QUERIES queries a row
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, L, Hq, D]
    """Every query of the group as a decode row of its own: its row's block table, its keys up
    to its position (padding queries repeat the row's last one)."""
    q = query if group.dest is None else query[group.token_index]  # [B * L, Hq, D]
    length = group.max_query_len
    tables, seq_lens = group.query_rows if length > 1 else (group.block_tables, group.seq_lens)
    out = cpu_native.decode_attention(q, kv_cache, tables, seq_lens, scale, sliding_window)
    return out.view(-1, length, *out.shape[1:])


def _attend_group(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    group: PaddedGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, L, Hq, D]
    num_rows, num_kv_heads = group.block_tables.shape[0], kv_cache.shape[3]
    length, head_dim = group.max_query_len, query.shape[2]
    q = query[group.token_index].view(num_rows, length, num_kv_heads, -1, head_dim)  # B L Hkv G D
    q = q.permute(0, 2, 3, 1, 4).reshape(num_rows, num_kv_heads, -1, head_dim)  # [B, Hkv, G*L, D]
    key = _gather(kv_cache[:, 0], group.block_tables)  # [B, Hkv, S, D]
    value = _gather(kv_cache[:, 1], group.block_tables)  # [B, Hkv, S, D]
    q_pos, k_pos, mask = group.masks
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    out = F.scaled_dot_product_attention(
        q, key.to(q.dtype), value.to(q.dtype), attn_mask=mask, scale=scale
    )  # [B, Hkv, G * L, D]
    out = out.view(num_rows, num_kv_heads, -1, length, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_rows, length, -1, head_dim)  # [B, L, Hq, D]


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the K or the V half
    block_tables: torch.Tensor,  # [B, nb] int64
) -> torch.Tensor:  # [B, Hkv, nb * block_size, D]
    """Each row's blocks, in order. `index_select` copies whole blocks (several times faster on
    CPU than advanced indexing) and its output is contiguous, so merging the block and in-block
    dimensions into one key dimension is a view."""
    blocks = cache.index_select(0, block_tables.flatten())  # [B * nb, block_size, Hkv, D]
    return blocks.unflatten(0, block_tables.shape).flatten(1, 2).transpose(1, 2)


# The backend's own cache write (interface.py `cache_write`), which the attention layer calls.
cpu_paged_attention.write_kv_cache = cpu_write_kv_cache  # type: ignore[attr-defined]
