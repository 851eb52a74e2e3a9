"""Paged attention over a block table, for batches that mix decodes and prefill chunks.

The contract every backend keeps: a layer first writes the whole batch's new K/V into the cache
(`write_kv_cache`), then attends (`paged_attention`) reading keys and values only from the cache.
Writing first lets two requests of one batch share prefix blocks written in that very step, and
lets a prefill chunk see its earlier chunks without the caller passing them in.

`paged_attention_ref` is the torch reference: it runs anywhere and is the oracle fast paths are
tested against. A fast backend (Triton, FlashAttention with `block_table`) plugs in through
`select_backend` without changing `Attention`'s interface.

FP8 cache (`--kv-cache-dtype fp8`): the cache tensor is float8_e4m3fn; a write stores
`k / k_scale` (clamped to the e4m3 range) and attention reads `k_fp8 * k_scale` (likewise v), with
one per-tensor scale per layer from the checkpoint (`k_scale` / `v_scale`) or 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.kernels.backend import (
    attention_backend_name,
    auto_choices,
    fusion_enabled,
    use_triton_cache_write,
)
from pagedserve.kernels.linear import rope_cache_linear, use_gemv
from pagedserve.kernels.rotary import RotaryEmbedding

QUERY_CHUNK = 1024  # query rows per score matrix in the reference
FP8_MAX = 448.0


@dataclass
class AttentionMetadata:
    """Per-step batch layout, shared by every layer of one forward pass.

    Rows are sequences; tokens of row i are `query_start_loc[i]:query_start_loc[i + 1]` of the
    flattened batch and sit at the end of the row's context of `seq_lens[i]` tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_start_loc_cpu: np.ndarray  # [B + 1] host copy, for loops without device syncs
    seq_lens_cpu: np.ndarray  # [B] host copy
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The other KV cache groups' layouts (groups 1..; kernels/attention.py `for_group`): the same
    # rows and tokens over their own block tables and slots. None: every group reads this one.
    group_metas: list[AttentionMetadata] | None = None
    # Cascade attention (kernels/cascade.py): tokens of the leading blocks every row shares, to
    # attend once for the whole batch (0: none). `cascade_len_dev` [1] int32 holds the exact
    # value the kernels read; in a CUDA graph `cascade_len` is only an upper bound (the switch
    # and the prefix pass's split count) and each replay writes the step's value on the device.
    cascade_len: int = 0
    cascade_len_dev: torch.Tensor | None = None
    # What a backend derives from the layout once per step and every layer reuses (the CPU
    # backend's padded groups and masks); a new step builds new metadata, so it never goes stale.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_host(
        cls,
        slot_mapping: np.ndarray,  # [T] int64
        query_start_loc: np.ndarray,  # [B + 1] int32
        seq_lens: np.ndarray,  # [B] int32
        block_tables: np.ndarray,  # [B, max_blocks] int32
        block_size: int,
        to_dev: Callable[[np.ndarray], torch.Tensor],
    ) -> AttentionMetadata:
        """The layout from host arrays, copied to the device by `to_dev` (the arrays stay as the
        host copies)."""
        return cls(
            slot_mapping=to_dev(slot_mapping),
            query_start_loc=to_dev(query_start_loc),
            seq_lens=to_dev(seq_lens),
            block_tables=to_dev(block_tables),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=int(np.diff(query_start_loc).max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_group(self, group: int) -> AttentionMetadata:
        """The layout a layer of KV cache group `group` attends over (config.kv_cache_groups)."""
        if group == 0 or self.group_metas is None:
            return self
        return self.group_metas[group - 1]


def build_attention_metadata(
    num_computed: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions [T] for rows that each add `num_new[i]` tokens after
    `num_computed[i]` cached ones, from plain lists (tests and simple callers; a model runner keeps
    persistent numpy arrays instead)."""
    q_lens = np.asarray(num_new, dtype=np.int64)
    seq_lens = np.asarray(num_computed, dtype=np.int64) + q_lens
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(c, c + n) for c, n in zip(num_computed, num_new, strict=True)] or [np.zeros(0)]
    ).astype(np.int64)
    seq_idx = np.repeat(np.arange(len(num_new)), q_lens)
    width = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = tables[seq_idx, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    seq_lens = seq_lens.astype(np.int32)
    meta = AttentionMetadata.from_host(
        slots, qsl, seq_lens, tables, block_size, lambda a: torch.from_numpy(a).to(device)
    )
    return meta, torch.from_numpy(positions).to(device)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each new token's K/V in its cache slot, in place; slots < 0 (padding) are skipped.

    On CUDA this runs the Triton kernel (no host sync, CUDA-graph safe); the reference below
    filters padding with a boolean mask, which syncs.
    """
    if use_triton_cache_write(kv_cache):
        from pagedserve.kernels.triton_cache import triton_write_kv_cache

        triton_write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def fuse_rope_and_cache(rotary: RotaryEmbedding, kv_cache: torch.Tensor) -> bool:
    """Whether rotary and the cache write run as one Triton kernel (CUDA, unless turned off)."""
    return (
        rotary.rotary_dim > 0 and use_triton_cache_write(kv_cache) and fusion_enabled("rope-cache")
    )


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
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each row's new tokens over its whole cached context.

    Query token j of row i sits at absolute position `seq_len_i - q_len_i + j` and attends keys at
    positions <= its own (and, with a sliding window, > position - window). Softmax in float32;
    `logit_softcap` c bounds the scaled scores to `c * tanh(s / c)` first (Gemma 2).
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
                q, key, value, first_pos, scale, sliding_window, logit_softcap
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
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)


AttentionBackend = Callable[..., torch.Tensor]


def select_backend(
    device: torch.device,
    requested: str = "auto",
    kv_fp8: bool = False,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Pick the attention implementation once, at model build time: `--attention-backend`
    (`requested`) or what `PAGEDSERVE_ATTENTION_BACKEND` forces (see kernels/backend.py); `auto`
    is Triton on CUDA (or the measured faster backend per step kind), batched SDPA on CPU.
    Every backend keeps `paged_attention_ref`'s signature."""
    name = attention_backend_name(device, requested, kv_fp8, dtype)
    if torch.device(device).type != "cuda" or name in ("torch", "sdpa"):
        return _backend(name)
    from pagedserve.kernels.attention_dispatch import per_step_kind

    names = auto_choices(torch.cuda.get_device_name(device), kv_fp8, dtype)
    if name != "auto":
        names = dict.fromkeys(names, name)
    return per_step_kind({kind: _backend(n) for kind, n in names.items()})


def _backend(name: str) -> AttentionBackend:
    if name == "sdpa":
        from pagedserve.kernels.cpu_attention import cpu_paged_attention

        return cpu_paged_attention
    if name == "triton":
        from pagedserve.kernels.triton_attention import triton_paged_attention

        return triton_paged_attention
    if name == "flash":
        from pagedserve.kernels.flash_attention import flash_paged_attention

        return flash_paged_attention
    return paged_attention_ref


class Attention(nn.Module):
    """Write-then-attend over a paged KV cache, for one decoder layer."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        backend: AttentionBackend | None = None,
        kv_fp8: bool = False,
        logit_softcap: float | None = None,
        kv_group: int = 0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_group = kv_group  # whose block table and slots it uses (config.kv_cache_groups)
        self.backend = backend or paged_attention_ref
        # A backend may bring its own cache write, given the whole step's metadata (the CPU one
        # works out the cache rows once per step); else `write_kv_cache`.
        self.write_cache = getattr(self.backend, "write_kv_cache", None)
        # Passed only when set, so backends without soft-capping keep their signature.
        self.backend_kwargs = (
            {} if logit_softcap is None else {"logit_softcap": float(logit_softcap)}
        )
        # FP8 cache scales: parameters so a checkpoint can set them (absent: 1.0), read into
        # floats once after loading (`after_loading`) so a step never syncs on them.
        self.kv_scales = (1.0, 1.0)
        if kv_fp8:
            self.k_scale = _scale_param()
            self.v_scale = _scale_param()
        # Set only on a model being exported for the compiled CPU forward (worker/cpu_compile.py):
        # this layer's index there, so `attend` runs as one opaque op the graph calls.
        self.opaque_index: int | None = None

    def after_loading(self) -> None:
        if hasattr(self, "k_scale"):
            self.kv_scales = (float(self.k_scale), float(self.v_scale))

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq * D]
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        rotary: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,  # [T], with `rotary`
    ) -> torch.Tensor:  # [T, Hq * D]
        """Attention of q, k, v ([T, heads * D] each); with `rotary`, q and k rotate first (on
        CUDA in the same kernel that writes the cache)."""
        if rotary is not None and fuse_rope_and_cache(rotary, kv_cache):
            from pagedserve.kernels.triton_rope_cache import triton_rope_and_cache

            k_scale, v_scale = self.kv_scales
            slots = meta.for_group(self.kv_group).slot_mapping
            q = triton_rope_and_cache(
                positions, q, k, v, kv_cache, slots, rotary.cos_sin_cache, k_scale, v_scale
            )
            return self.attend(q, None, None, kv_cache, meta)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        if self.opaque_index is not None:
            return torch.ops.pagedserve.attention(q, k, v, self.opaque_index)
        return self.attend(q, k, v, kv_cache, meta)

    def project_rope_cache(
        self,
        hidden: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # the qkv projection's [(Hq + 2 Hkv) * D, H]
        bias: torch.Tensor | None,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, Hq * D], rotated; None: not here
        """The qkv projection with rotary and the cache write in its epilogue, for a decode-sized
        batch on CUDA (kernels/triton_qkv_rope.py): the rotated query, for `attend(q, None,
        None, ...)`. None where that does not apply: the caller projects, then `forward`."""
        if not (
            fuse_rope_and_cache(rotary, kv_cache)
            and use_gemv(hidden, weight)
            and fusion_enabled("qkv-rope")
        ):
            return None
        from pagedserve.kernels.triton_qkv_rope import qkv_rope_applies

        if not qkv_rope_applies(hidden, weight, rotary.rotary_dim, self.head_dim):
            return None
        slots = meta.for_group(self.kv_group).slot_mapping
        return rope_cache_linear(
            hidden, weight, bias, self.num_heads, positions, rotary.cos_sin_cache, kv_cache,
            slots, *self.kv_scales,
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq * D], rotated
        k: torch.Tensor | None,  # [T, Hkv * D], rotated; None: already in the cache
        v: torch.Tensor | None,  # [T, Hkv * D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq * D]
        """Write k and v into the cache, then attend: everything after the rotary embedding."""
        num_tokens = q.shape[0]
        k_scale, v_scale = self.kv_scales
        meta = meta.for_group(self.kv_group)
        if k is not None and v is not None:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.write_cache is not None:  # the CPU backend's batched write
                self.write_cache(k, v, kv_cache, meta, k_scale, v_scale)
            else:
                write_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        out = self.backend(
            q,
            kv_cache,
            meta,
            self.scale,
            self.sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
            **self.backend_kwargs,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def _scale_param() -> nn.Parameter:
    """A per-tensor KV-cache scale; optional in the checkpoint (1.0 when absent)."""
    p = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
    p.weight_loader = _load_scale  # type: ignore[attr-defined]
    p.optional = True  # type: ignore[attr-defined]
    return p


def _load_scale(param: nn.Parameter, loaded: object, shard_id: object = None) -> None:
    value = loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # type: ignore[index]
    if value.numel() != 1:
        raise ValueError(f"a KV-cache scale must be one number, got shape {tuple(value.shape)}")
    param.data.fill_(float(value.reshape(())))
