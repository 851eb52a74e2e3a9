"""The scheduler's KV cache, built from the configs, and what it refuses: a host tier for a model
with windowed or linear-attention layers, a cache too small for one request of max_model_len.
Prefix caching is off for models with recurrent state."""

from __future__ import annotations

import logging

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_tier import HostTier, TierSpec

logger = logging.getLogger(__name__)


def make_kv_cache(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    max_model_len: int,
    num_blocks: int,
    group_windows: list[int | None] | None,
    num_state_slots: int | None,
    host_tier: TierSpec | None,
) -> KVCacheManager:
    """See `Scheduler.__init__` for the arguments."""
    caching = cache_config.enable_prefix_caching
    if caching and num_state_slots is not None:
        # A hit would have to restore every linear layer's state at the hit's boundary, and
        # the state slots keep only each request's latest state.
        logger.info(
            "prefix caching is off: this model's linear-attention layers keep recurrent "
            "state, which a prefix-cache hit cannot restore"
        )
        caching = False
    if host_tier is not None and (group_windows not in (None, [None]) or num_state_slots):
        raise ValueError(
            "--kv-offloading-size: the host KV tier supports models whose layers all attend "
            "globally (no sliding-window or linear-attention layers)"
        )
    tier = HostTier(host_tier, cache_config.block_size) if host_tier is not None else None
    kv = KVCacheManager(num_blocks, cache_config.block_size, caching, group_windows or [None], tier)
    budget = scheduler_config.max_num_batched_tokens
    need = kv.max_blocks_per_request(max_model_len, budget)
    if need > num_blocks:
        groups = f" over {kv.num_groups} KV cache groups" if kv.num_groups > 1 else ""
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {cache_config.block_size} tokens, fewer "
            f"than the {need} blocks one request of max_model_len={max_model_len} can need"
            f"{groups}: lower --max-model-len or give the KV cache more memory"
        )
    return kv
