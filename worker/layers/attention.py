"""The attention layer: write-then-attend over a paged KV cache, for one decoder layer, and the
choice of its fused paths.

The backend (kernels/attention/: a `PagedAttention` picked once at start-up by
`select_backend`) attends; this layer writes the step's K/V first (`write_kv_cache`, or the
backend's own batched write), keeps the layer's FP8 cache scales, and decides per call whether
rotary, the cache write and (for a decode-sized batch) the qkv projection run as one kernel, and
whether o_proj's weight is prefetched into L2 while attention runs (`forward_layer`), so model
code only says which projections and norms it has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.kernels.attention.cache_write import fuse_rope_and_cache, write_kv_cache
from pagedserve.kernels.attention.interface import PagedAttention, cache_write
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.attention.reference import paged_attention_ref
from pagedserve.kernels.backend import fusion_enabled
from pagedserve.kernels.linear import rope_cache_linear, use_gemv
from pagedserve.kernels.prefetch import join_prefetches, prefetch_weight
from pagedserve.worker.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from pagedserve.worker.layers.linear import QKVParallelLinear, RowParallelLinear

QKNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    """Write-then-attend over a paged KV cache, for one decoder layer."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        backend: PagedAttention | None = None,
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
        self.write_cache = cache_write(self.backend)
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
        if rotary is not None and fuse_rope_and_cache(rotary.rotary_dim, kv_cache):
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

    def forward_layer(
        self,
        hidden: torch.Tensor,  # [T, H], the normed input (or its FP8 rows)
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        qkv_proj: QKVParallelLinear,
        o_proj: RowParallelLinear,
        rotary: RotaryEmbedding,
        qk_norm: QKNorm | None = None,  # per-head q/k norms between projection and rotary
    ) -> torch.Tensor:  # [T, H]
        """A decoder layer's self-attention, its projections included: where it applies, one
        kernel projects, rotates and writes the cache (`project_rope_cache`), and o_proj's weight
        is pulled into L2 while attention runs (kernels/prefetch.py), its fork joined after
        o_proj: no caller has a side stream left to join."""
        if qk_norm is None:
            q = self.project_rope_cache(hidden, qkv_proj, rotary, positions, kv_cache, meta)
            if q is not None:  # one kernel: projection, rotary, cache write (decode on CUDA)
                prefetch_weight(q, o_proj.weight)  # into L2 while attention runs
                return _project_out(o_proj, self.attend(q, None, None, kv_cache, meta))
        q, k, v = qkv_proj.split(qkv_proj(hidden))  # [T, Hq*D], [T, Hkv*D] x2
        prefetch_weight(q, o_proj.weight)  # (hidden may be Fp8Rows, q is a tensor)
        if qk_norm is not None:
            q, k = qk_norm(q, k)
        return _project_out(o_proj, self(q, k, v, kv_cache, meta, rotary, positions))

    def project_rope_cache(
        self,
        hidden: torch.Tensor,  # [T, H]
        qkv_proj: QKVParallelLinear,  # weight [(Hq + 2 Hkv) * D, H]
        rotary: RotaryEmbedding,
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, Hq * D], rotated; None: not here
        """The qkv projection with rotary and the cache write in its epilogue, for a decode-sized
        batch on CUDA with a model-dtype weight (kernels/triton_qkv_rope.py): the rotated query,
        for `attend(q, None, None, ...)`. None where that does not apply: the caller projects,
        then `forward`."""
        weight = qkv_proj.weight
        if weight is None or qkv_proj.weight_scale is not None:  # packed for oneDNN, or FP8
            return None
        if qkv_proj.lora is not None and qkv_proj.lora.active:
            return None  # rows of adapters: the unfused projection adds their deltas
        if not (
            fuse_rope_and_cache(rotary.rotary_dim, kv_cache)
            and use_gemv(hidden, weight)
            and fusion_enabled("qkv-rope")
        ):
            return None
        from pagedserve.kernels.triton_qkv_rope import qkv_rope_applies

        if not qkv_rope_applies(hidden, weight, rotary.rotary_dim, self.head_dim):
            return None
        slots = meta.for_group(self.kv_group).slot_mapping
        return rope_cache_linear(
            hidden, weight, qkv_proj.bias, self.num_heads, positions, rotary.cos_sin_cache,
            kv_cache, slots, *self.kv_scales,
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


def _project_out(o_proj: RowParallelLinear, attended: torch.Tensor) -> torch.Tensor:
    """o_proj of the attention output, then the L2 prefetch's side stream joined back (its work
    served o_proj; a CUDA graph capture needs every fork joined)."""
    out = o_proj(attended)
    join_prefetches(out)
    return out
