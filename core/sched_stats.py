"""What the scheduler reports in `SchedulerStats`: queues, KV cache use, preemptions, and the
fields of the features that are on (host KV tier, LoRA, speculative decoding)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedserve.ipc.messages import SchedulerStats

if TYPE_CHECKING:
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.core.spec_decode.decoder import SpecDecoder


def scheduler_stats(sched: Scheduler) -> SchedulerStats:
    """The scheduler's counters for `SchedulerStats` (the engine's /metrics and stats log)."""
    return SchedulerStats(
        num_running=len(sched.running),
        num_waiting=sched.num_waiting,
        kv_cache_usage=sched.kv.usage,
        prefix_cache_queries=sched.kv.prefix_cache_queries,
        prefix_cache_hits=sched.kv.prefix_cache_hits,
        num_preemptions=sched.num_preemptions,
        num_unfinished=len(sched.requests),
        **(tier_stats(sched) if sched.kv.tier is not None else {}),
        **_lora_stats(sched),
        **(spec_stats(sched.spec) if sched.spec is not None else {}),
    )


def _lora_stats(sched: Scheduler) -> dict[str, object]:
    """With LoRA on: running and waiting requests per adapter (vLLM's lora_requests_info),
    the workers' adapter loads and evictions."""
    if sched.max_loras is None:
        return {}
    loads, evictions = sched.lora_pool_counts
    out: dict[str, object] = {"lora_loads": loads, "lora_evictions": evictions}
    if sched.lora_users:
        running = Counter(r.lora.lora_name for r in sched.running if r.lora is not None)
        out["running_lora_adapters"] = dict(running)
        out["waiting_lora_adapters"] = {
            n: k - running[n] for n, k in sched.lora_users.items() if k > running[n]
        }
    return out


def tier_stats(sched: Scheduler) -> dict[str, int]:
    """SchedulerStats' host KV tier fields."""
    tier = sched.kv.tier
    return dict(
        num_swapped=len(sched.swapped),
        kv_swap_out_bytes=tier.num_out_blocks * tier.spec.block_bytes,
        kv_swap_in_bytes=tier.num_in_blocks * tier.spec.block_bytes,
        host_cache_hits=tier.num_hit_tokens,
    )


def spec_stats(spec: SpecDecoder) -> dict[str, int | list[int]]:
    """SchedulerStats' speculative decoding fields."""
    s = spec.stats
    return dict(
        spec_num_drafts=s.num_drafts,
        spec_num_draft_tokens=s.num_draft_tokens,
        spec_num_accepted_tokens=s.num_accepted_tokens,
        spec_accepted_per_pos=list(s.accepted_per_pos),
    )
