"""Cascade (shared-prefix) attention: the host side, pure numpy.

When every row of a step starts with the same blocks (one system prompt, shared by prefix
caching), attention can read that prefix once for the whole batch instead of once per row: a
prefix pass attends every query token, non-causally, to keys [0, common_len) through one row's
block table, a per-row pass attends each row's own keys from common_len on, and the two partial
softmaxes merge by their running max and sum (kernels/attention/triton.py). This module finds
common_len for a step and decides whether the cascade pays.

The prefix is counted in whole blocks and never reaches a row's new tokens: common_len <=
min(seq_len - query_len), so every query sits after the whole prefix (the prefix pass needs no
causal mask) and each row keeps at least its own new keys for the per-row pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedserve.kernels.attention.metadata import AttentionMetadata

# When it pays (Llama-3-8B heads: a key costs 4 KB of K and V per layer). Saved per row: the
# prefix's reads, common_len x 4 KB (from L2 at best). Added: two launches (the prefix pass and
# the merge, ~3 us each in a graph) and the partials (1 + prefix splits slots of 32 heads x 130
# floats per row, written and read back: ~130 KB a row at 3 prefix splits). At 256 prefix tokens
# a row saves 1 MB against those 130 KB, and 32 rows save ~32 MB, about the two launches' time at
# L2 bandwidth; longer prefixes only widen the margin. vLLM's rule is alike (>= 256 prefix tokens,
# >= 8 rows, then a CTA-count model against flash-decoding). `cascade-bench` checks 32 and 64 rows.
CASCADE_MIN_TOKENS = 256
CASCADE_MIN_ROWS = 32
MAX_SPLITS = 32  # partial slots of the split-K merge (kernels/attention/triton.py)
MIN_PREFIX_PER_SPLIT = 256  # prefix keys per split of the prefix pass, at least


def common_prefix_len(
    block_tables: np.ndarray,  # [B, W] int32, the rows' block ids (padded)
    seq_lens: np.ndarray,  # [B] context length after the step
    query_lens: np.ndarray,  # [B] new tokens this step
    block_size: int,
) -> int:
    """Tokens of the longest run of leading blocks that every row shares, capped so that it
    covers no row's new tokens (rounded down to whole blocks); 0 for fewer than two rows."""
    if len(seq_lens) < 2:
        return 0
    cached = np.asarray(seq_lens, dtype=np.int64) - np.asarray(query_lens, dtype=np.int64)
    limit = min(int(cached.min()) // block_size, block_tables.shape[1])
    if limit <= 0:
        return 0
    head = block_tables[:, :limit]
    differs = (head != head[0]).any(axis=0)  # [limit] block j differs somewhere
    blocks = int(np.argmax(differs)) if differs.any() else limit
    return blocks * block_size


def cascade_len(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    min_rows: int = CASCADE_MIN_ROWS,
    min_tokens: int = CASCADE_MIN_TOKENS,
) -> int:
    """The common prefix a step should attend once (0: run without the cascade): it needs
    `min_rows` decode rows (the kernels cascade decode batches only, a mixed step's decode part
    when it runs apart; kernels/attention/triton.py says why)."""
    if len(seq_lens) < min_rows or np.count_nonzero(np.asarray(query_lens) == 1) < min_rows:
        return 0
    n = common_prefix_len(block_tables, seq_lens, query_lens, block_size)
    return n if n >= min_tokens else 0


def use_cascade(meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """Whether an attention call runs as a cascade: the step found a common prefix, the batch
    is decodes only and the layer has no sliding window (the prefix pass knows no query
    positions). A prompt row gains nothing: its own 128-row tiles already share each prefix key
    tile among 32 of its tokens, as the prefix pass's would; decode rows, one token per tile
    otherwise, each read the whole prefix. A mixed step cascades its decode part when it runs as
    two calls (kernels/attention/dispatch.py)."""
    return (
        meta.cascade_len > 0
        and meta.cascade_len_dev is not None
        and meta.max_query_len == 1
        and sliding_window is None
    )


def choose_prefix_splits(programs: int, prefix_len: int, num_sms: int) -> int:
    """Key splits of the prefix pass (`programs` = query tiles x KV heads): one wave of programs
    (each a 128-row tile, 8x a decode tile's work per key); at least MIN_PREFIX_PER_SPLIT keys
    each."""
    by_occupancy = -(-num_sms // programs)
    return max(1, min(by_occupancy, prefix_len // MIN_PREFIX_PER_SPLIT, MAX_SPLITS))
