"""Which attention kernel a step runs on CUDA, by step kind.

Step kinds, from host values only: `decode` (every row adds one token), `prefill` (every row adds
several) and `mixed`. `--attention-backend auto` may run a different backend per kind (measured,
kernels/attention/selection.py); either way an eager mixed step of at least `mixed_split_tokens`
(settings.py) tokens runs as two calls, its decode rows as a decode batch and its prompt rows as a
prefill batch. A kernel tiles query rows 128 at a time for prompts; a decode row alone in such a
tile fills 4 of its 128 rows (Llama-3's 4 query heads per KV head) yet streams its whole context: in
W5 (23 decodes at 16k context beside an 8192-token prompt chunk) that is 12-38% more attention work
than the chunk's. As a decode batch the same rows get 16-row tiles and key splits. The row subsets
are built once per step (`meta.scratch`) and shared by every layer; a mixed-step CUDA graph has no
host row layout and runs the `mixed` backend on the whole batch.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve import settings
from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.kernels.attention.metadata import AttentionMetadata

STEP_KINDS = ("prefill", "decode", "mixed")


def step_kind(meta: AttentionMetadata) -> str:
    """`decode`, `prefill` or `mixed` (a mixed-step graph's placeholder layout: `mixed`)."""
    if meta.max_query_len <= 1:
        return "decode"
    q_lens = np.diff(meta.query_start_loc_cpu)
    return "prefill" if len(q_lens) and q_lens.min() > 1 else "mixed"


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices on the device without waiting for it (a pageable copy would sync)."""
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _sub_meta(meta: AttentionMetadata, rows: np.ndarray) -> tuple[AttentionMetadata, object]:
    """Metadata of `rows` (host indices, ascending) and their tokens: a slice when the rows are
    consecutive (their tokens are then one range: no copy), else a device index tensor."""
    qsl, device = meta.query_start_loc_cpu, meta.seq_lens.device
    q_lens = (qsl[rows + 1] - qsl[rows]).astype(np.int64)
    sub_qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == len(rows):  # consecutive rows: views and a device subtraction
        picked = slice(first, last + 1)
        tokens: object = slice(int(qsl[first]), int(qsl[last + 1]))
        sub_qsl_dev = meta.query_start_loc[first : last + 2] - int(qsl[first])
    else:
        picked = _to_device(rows, device)
        starts = np.repeat(qsl[rows].astype(np.int64), q_lens)
        offsets = np.arange(len(starts)) - np.repeat(sub_qsl[:-1].astype(np.int64), q_lens)
        tokens = _to_device(starts + offsets, device)
        sub_qsl_dev = _to_device(sub_qsl, device)
    seq_lens_cpu = meta.seq_lens_cpu[rows]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0],  # attention reads the cache only
        query_start_loc=sub_qsl_dev,
        seq_lens=meta.seq_lens[picked],
        block_tables=meta.block_tables[picked],
        query_start_loc_cpu=sub_qsl,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_size=meta.block_size,
        # A subset of the rows shares at least the whole batch's prefix (and its cap holds).
        cascade_len=meta.cascade_len,
        cascade_len_dev=meta.cascade_len_dev,
    )
    return sub, tokens


def split_rows(meta: AttentionMetadata, min_tokens: int) -> list | None:
    """[(decode metadata, tokens), (prompt metadata, tokens)] of an eager mixed step of at least
    `min_tokens` tokens, else None; computed once per step."""
    if "split_rows" not in meta.scratch:
        qsl = meta.query_start_loc_cpu
        q_lens = np.diff(qsl)
        split = None
        big = min_tokens > 0 and len(q_lens) and qsl[-1] >= min_tokens
        if big and (q_lens == 1).any() and (q_lens > 1).any():
            split = [_sub_meta(meta, np.nonzero(q_lens == 1)[0])]
            split.append(_sub_meta(meta, np.nonzero(q_lens > 1)[0]))
        meta.scratch["split_rows"] = split
    return meta.scratch["split_rows"]


def per_step_kind(
    backends: dict[str, PagedAttention], min_split_tokens: int | None = None
) -> PagedAttention:
    """One backend that runs `backends[step_kind(meta)]`, an eager mixed step as its decode and
    prompt parts (a graph keeps the calls it captured). Below `min_split_tokens` (settings:
    `PAGEDSERVE_MIXED_SPLIT_TOKENS`, 1024) a second launch and the gathers cost more than they
    save; 0 turns the split off."""
    if min_split_tokens is None:
        min_split_tokens = settings.current().mixed_split_tokens

    def attend(query, kv_cache, meta, scale, sliding_window=None, *args, **kwargs):
        kind = step_kind(meta)
        parts = split_rows(meta, min_split_tokens) if kind == "mixed" else None
        if parts is None:
            return backends[kind](query, kv_cache, meta, scale, sliding_window, *args, **kwargs)
        out = torch.empty_like(query)
        for (sub, tokens), part in zip(parts, ("decode", "prefill"), strict=True):
            q = query[tokens]
            out[tokens] = backends[part](q, kv_cache, sub, scale, sliding_window, *args, **kwargs)
        return out

    attend.backends = backends  # type: ignore[attr-defined]
    return attend
