"""The EngineCore's periodic stats line, in vLLM's words ("Avg prompt throughput: ...").

Every `interval` seconds (`--log-stats-interval`; `--disable-log-stats`: never) the core logs
through the `pagedserve.engine` logger what it did since the previous line: requests in (arrived)
and out (ended: finished, aborted or refused) per second, prompt tokens computed (prefix-cache
hits are not computed) and tokens generated per second, requests running and waiting now, KV
cache use, and the prefix-cache hit rate of the lookups in the interval. The counters are
cumulative, so a rate is the difference between two lines over the time between them.

A line for an interval with nothing done and nothing running or waiting is logged at DEBUG (as
vLLM does), so an idle server's log stays quiet; others at INFO. We preempt by recompute and never
swap: "Swapped" is always 0, kept so that parsers of vLLM's line read ours. With speculative
decoding, an interval that verified drafts adds vLLM's "SpecDecoding metrics: ..." line.
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass

from pagedserve.ipc.messages import RequestDelta, SchedulerStats

logger = logging.getLogger("pagedserve.engine")


@dataclass
class _Totals:
    """Cumulative counts at one moment."""

    time: float
    num_arrived: int = 0
    num_ended: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class StatsLog:
    """The core counts arrivals, ends and generated tokens here; `maybe_log` is called often
    (it is cheap when the interval has not passed) with the scheduler's own counters."""

    def __init__(self, interval: float, now: float) -> None:
        assert interval > 0
        self.interval = interval
        self.num_arrived = 0
        self.num_ended = 0
        self.num_generated_tokens = 0
        self._last = _Totals(now)
        self._last_spec = _SpecTotals()

    def count(self, deltas: list[tuple[int, RequestDelta]]) -> None:
        for _, delta in deltas:
            self.num_generated_tokens += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.num_ended += 1

    def maybe_log(self, now: float, stats: SchedulerStats, num_prompt_tokens: int) -> None:
        if now - self._last.time < self.interval:
            return
        totals = _Totals(
            now, self.num_arrived, self.num_ended, num_prompt_tokens, self.num_generated_tokens,
            stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions,
        )  # fmt: skip
        busy = (
            stats.num_running or stats.num_waiting or astuple(totals)[1:] != astuple(self._last)[1:]
        )
        logger.log(
            logging.INFO if busy else logging.DEBUG, "%s", stats_line(self._last, totals, stats)
        )
        spec = _SpecTotals(
            stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            list(stats.spec_accepted_per_pos),
        )  # fmt: skip
        if spec.num_drafts > self._last_spec.num_drafts:
            logger.info("%s", spec_line(self._last_spec, spec, now - self._last.time))
        self._last = totals
        self._last_spec = spec


def stats_line(last: _Totals, now: _Totals, stats: SchedulerStats) -> str:
    seconds = max(now.time - last.time, 1e-9)

    def rate(name: str) -> float:
        return (getattr(now, name) - getattr(last, name)) / seconds

    queries = now.prefix_cache_queries - last.prefix_cache_queries
    hits = now.prefix_cache_hits - last.prefix_cache_hits
    return (
        f"Avg prompt throughput: {rate('num_prompt_tokens'):.1f} tokens/s, "
        f"Avg generation throughput: {rate('num_generated_tokens'):.1f} tokens/s, "
        f"Requests in: {rate('num_arrived'):.2f}/s, out: {rate('num_ended'):.2f}/s, "
        f"Running: {stats.num_running} reqs, Swapped: 0 reqs, Pending: {stats.num_waiting} reqs, "
        f"Preempted: {now.num_preemptions - last.num_preemptions} reqs, "
        f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
    )


@dataclass
class _SpecTotals:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None


def spec_line(last: _SpecTotals, now: _SpecTotals, seconds: float) -> str:
    """vLLM's speculative decoding line over the interval."""
    seconds = max(seconds, 1e-9)
    drafts = now.num_drafts - last.num_drafts
    drafted = now.num_draft_tokens - last.num_draft_tokens
    accepted = now.num_accepted_tokens - last.num_accepted_tokens
    before = last.accepted_per_pos or [0] * len(now.accepted_per_pos or [])
    per_pos = [(a - b) / drafts for a, b in zip(now.accepted_per_pos or [], before, strict=True)]
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
        f"Drafted throughput: {drafted / seconds:.2f} tokens/s, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
        f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
    )
