"""What an attention backend is: the paged-attention call every backend implements and the
capabilities the registry records for it (kernels/attention/registry.py).

Pure Python at import (torch only for type checking), so config validation and the CLI can read
the registry without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pagedserve.kernels.attention.metadata import AttentionMetadata


class PagedAttention(Protocol):
    """Causal attention of each row's new tokens over its cached context (the cache already
    holds this step's K/V): `paged_attention_ref`'s contract, which every backend keeps.

    A backend may carry its own cache write as the attribute `write_kv_cache` (a `CacheWrite`:
    the CPU backend works out the cache rows once per step); `cache_write` reads it."""

    def __call__(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # [Hq] (a backend whose caps.sinks is True)
    ) -> torch.Tensor: ...  # [T, Hq, D]


class CacheWrite(Protocol):
    """A backend's own write of the step's new K/V, given the whole step's metadata."""

    def __call__(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None: ...


def cache_write(backend: PagedAttention) -> CacheWrite | None:
    """The backend's own cache write (None: the generic `write_kv_cache`)."""
    return getattr(backend, "write_kv_cache", None)


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do; the engine asks these instead of comparing names."""

    cuda_graphs: bool  # capturable: device tensors and host upper bounds only, no host sync
    cascade: bool  # runs the shared-prefix pass (kernels/attention/cascade.py)
    fp8_cache: bool  # reads a float8_e4m3fn KV cache (with per-tensor k/v scales)
    soft_cap: bool  # `logit_softcap` (Gemma 2)
    sinks: bool  # attention sinks (a learned per-head logit in the softmax)
    multi_token_queries: bool  # a row of several query tokens (prefill chunks, verification)
    float32: bool  # float32 queries and caches (else float16/bfloat16 only)
