"""Prometheus metrics of one API server, named like vLLM's with the prefix `pagedserve:`; every
series that has a vLLM twin is also served under vLLM's `vllm:` name (`_VLLM_TWINS`, same labels
and values), so dashboards and alerts written for vLLM work unchanged.

With `--api-servers N` every server is its own process, so values live in prometheus-client's
multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set by the launcher before the servers start) and
`/metrics` merges them, whichever server answers:
- per-request counters and histograms are summed over the servers (each counts its own requests);
- engine series carry an `engine` label, the data parallel core they describe ("0" with one
  core, as vLLM labels them): gauges (running, waiting, KV usage) take the most recent value any
  server received from that core;
- engine-wide counters (prefix cache queries/hits, preemptions) arrive as cumulative totals in
  SchedulerStats. Adding increments per server would count them once per server, so each server
  stores the total it last saw in a gauge merged by `max` (totals only grow), and `/metrics`
  exports that gauge as a counter.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from pagedserve.frontend.outputs import RequestOutput
from pagedserve.ipc.messages import SchedulerStats

P = "pagedserve:"
_LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
# Engine-wide cumulative totals: stored as max-merged gauges, exported as counters.
_TOTALS = {
    "prefix_cache_queries": "Prefix cache lookups, in tokens.",
    "prefix_cache_hits": "Prefix cache hits, in tokens.",
    "num_preemptions": "Requests preempted by the scheduler.",
    "lora_loads": "LoRA adapters the workers read into their host pool.",
    "lora_evictions": "LoRA adapters evicted from the workers' device slots.",
    "kv_swap_out_bytes": "KV bytes copied to the host tier (swaps and spills), all workers.",
    "kv_swap_in_bytes": "KV bytes copied back from the host tier, all workers.",
    "host_cache_hits": "Prefix cache hits served by the host KV tier, in tokens.",
}
# Speculative decoding's totals (exported once the engine speculates, as vLLM does).
_SPEC_TOTALS = {
    "spec_decode_num_drafts": "Verifications of draft tokens (steps of a request with drafts).",
    "spec_decode_num_draft_tokens": "Draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # label `position`

# pagedserve name -> its vLLM names (the first is vLLM V1's, the others older names that vLLM's
# own dashboards used: gpu_cache_usage_perc until 0.10, time_per_output_token_seconds until 0.12).
_VLLM_TWINS: dict[str, tuple[str, ...]] = {
    name: (name,)
    for name in (
        "num_requests_running", "num_requests_waiting", "num_requests_swapped",
        "prefix_cache_queries",
        "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
        "request_success", "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "cache_config_info", "lora_requests_info", *_SPEC_TOTALS,
        _PER_POS,
    )
} | {
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
}  # fmt: skip


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        labels = ["model_name"]
        engine_labels = ["model_name", "engine"]  # per data parallel core
        reg = self.registry

        def gauge(name: str, doc: str, mode: str = "mostrecent") -> Gauge:
            g = Gauge(P + name, doc, labels, registry=reg, multiprocess_mode=mode)
            return g.labels(model_name)

        def engine_gauge(name: str, doc: str, mode: str = "mostrecent") -> Gauge:
            return Gauge(P + name, doc, engine_labels, registry=reg, multiprocess_mode=mode)

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(P + name, doc, engine_labels, buckets=buckets, registry=reg)

        self.running = engine_gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = engine_gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = engine_gauge("kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.swapped = engine_gauge("num_requests_swapped", "Requests swapped to the host tier.")
        self.unfinished = engine_gauge(
            "num_requests_unfinished", "Requests the scheduler tracks (running or waiting)."
        )
        # Per server, summed: requests an API server holds state for (0 when idle).
        self.api_tracked = gauge(
            "api_server_requests_tracked", "Requests the API servers hold state for.", mode="sum"
        )
        self.totals = {key: engine_gauge(key, doc, mode="max") for key, doc in _TOTALS.items()}
        # KV capacity in blocks and tokens: an FP8 cache holds twice the tokens of a bf16 one.
        self.kv_blocks = engine_gauge("kv_cache_num_blocks", "KV cache blocks the engine holds.")
        self.kv_tokens = engine_gauge("kv_cache_capacity_tokens", "Tokens the KV cache holds.")
        self._cache_info = Gauge(
            P + "cache_config_info", "KV cache layout (value 1).",
            [*engine_labels, "num_gpu_blocks", "block_size", "cache_dtype"], registry=reg,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        # Per-request series carry the core that ran the request (`engine`), as vLLM's do.
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prefilled prompt tokens.", engine_labels, registry=reg
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Generated tokens.", engine_labels, registry=reg
        )
        self._success = Counter(
            P + "request_success",
            "Finished requests (one per choice), by finish reason.",
            [*engine_labels, "finished_reason"],
            registry=reg,
        )
        # By endpoint (route pattern) and status class, as vLLM's http_requests_total.
        self._http = Counter(
            P + "http_requests", "HTTP requests answered, by endpoint and status class.",
            [*labels, "handler", "method", "status"], registry=reg,
        )  # fmt: skip
        self.model_name = model_name
        self.max_loras: int | None = None  # set_lora: LoRA is on
        self._lora_info = Gauge(
            P + "lora_requests_info", "Running and waiting LoRA adapters, as vLLM's (value: the "
            "time they were last seen).", ["max_lora", "waiting_lora_adapters",
            "running_lora_adapters"], registry=reg, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self._lora_labels: tuple[str, str, str] | None = None
        self._spec: dict[str, Gauge] | None = None  # created when the engine first speculates
        self._engine_gauge = engine_gauge
        lat = _LATENCY_BUCKETS
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", lat)
        self.itl = hist("inter_token_latency_seconds", "Time between output steps.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", lat)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", lat)

    def set_cache(self, num_blocks: int, block_size: int, cache_dtype: str, core: int = 0) -> None:
        """A core's KV cache size and element type, once the engine is ready."""
        engine = (self.model_name, str(core))
        self.kv_blocks.labels(*engine).set(num_blocks)
        self.kv_tokens.labels(*engine).set(num_blocks * block_size)
        labels = (*engine, str(num_blocks), str(block_size), cache_dtype)
        self._cache_info.labels(*labels).set(1)
        for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue):  # fmt: skip
            family.labels(*engine)  # the core's per-request series exist (at 0) from the start

    def set_lora(self, max_loras: int) -> None:
        """LoRA is on: export lora_requests_info (from the first stats on)."""
        self.max_loras = max_loras

    def on_stats(self, core: int, stats: SchedulerStats) -> None:
        """An AsyncEngine stats listener (runs on the event loop for every EngineOutputs)."""
        engine = (self.model_name, str(core))
        self.running.labels(*engine).set(stats.num_running)
        self.waiting.labels(*engine).set(stats.num_waiting)
        self.kv_usage.labels(*engine).set(stats.kv_cache_usage)
        self.unfinished.labels(*engine).set(stats.num_unfinished)
        self.totals["prefix_cache_queries"].labels(*engine).set(stats.prefix_cache_queries)
        self.totals["prefix_cache_hits"].labels(*engine).set(stats.prefix_cache_hits)
        self.totals["num_preemptions"].labels(*engine).set(stats.num_preemptions)
        self.totals["lora_loads"].labels(*engine).set(stats.lora_loads)
        self.totals["lora_evictions"].labels(*engine).set(stats.lora_evictions)
        self.swapped.labels(*engine).set(stats.num_swapped)
        for key in ("kv_swap_out_bytes", "kv_swap_in_bytes", "host_cache_hits"):
            self.totals[key].labels(*engine).set(getattr(stats, key))
        if self.max_loras is not None:
            labels = (
                str(self.max_loras),
                ",".join(sorted(stats.waiting_lora_adapters)),
                ",".join(sorted(stats.running_lora_adapters)),
            )
            if labels != self._lora_labels:  # vLLM's: a sample per change, its time as value
                self._lora_labels = labels
                self._lora_info.labels(*labels).set(time.time())
        if stats.spec_accepted_per_pos:
            self._on_spec_stats(engine, stats)

    def _on_spec_stats(self, engine: tuple[str, str], stats: SchedulerStats) -> None:
        if self._spec is None:
            spec = _SPEC_TOTALS.items()
            self._spec = {key: self._engine_gauge(key, doc, mode="max") for key, doc in spec}
            self._per_pos = Gauge(
                P + _PER_POS, "Draft tokens accepted, by position in the draft.",
                ["model_name", "engine", "position"], registry=self.registry,
                multiprocess_mode="max",
            )  # fmt: skip
        self._spec["spec_decode_num_drafts"].labels(*engine).set(stats.spec_num_drafts)
        self._spec["spec_decode_num_draft_tokens"].labels(*engine).set(stats.spec_num_draft_tokens)
        accepted = stats.spec_num_accepted_tokens
        self._spec["spec_decode_num_accepted_tokens"].labels(*engine).set(accepted)
        for position, count in enumerate(stats.spec_accepted_per_pos):
            self._per_pos.labels(*engine, str(position)).set(count)

    async def track(
        self,
        stream: AsyncIterator[RequestOutput],
        num_prompt_tokens: int,
        core_of: Callable[[], int | None] = lambda: 0,
    ) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, observing token counts and latencies under the
        label of the core that runs it (`core_of`, asked once the request is routed)."""
        num_tokens = 0
        finished: set[int] = set()
        engine: tuple[str, str] | None = None
        try:
            async for out in stream:
                if engine is None:  # routed before its first output
                    engine = (self.model_name, str(core_of() or 0))
                num_tokens = self._observe(out, engine, num_tokens, num_prompt_tokens, finished)
                yield out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _observe(
        self,
        out: RequestOutput,
        engine: tuple[str, str],
        num_tokens: int,
        num_prompt_tokens: int,
        finished: set[int],
    ) -> int:
        """One output of a request whose earlier outputs brought `num_tokens` tokens; returns
        the tokens counted with this one."""
        now = time.time()
        arrival = out.metrics.get("arrival_time", now)
        total = sum(len(c.token_ids) for c in out.outputs)
        if total > num_tokens or (num_tokens == 0 and out.pooled is not None):
            if num_tokens == 0:  # the first tokens, or a pooling request's vector
                self.prompt_tokens.labels(*engine).inc(num_prompt_tokens)
                first = out.metrics.get("first_token_time", now)
                self.ttft.labels(*engine).observe(first - arrival)
                if (scheduled := out.metrics.get("first_scheduled_time")) is not None:
                    self.queue.labels(*engine).observe(scheduled - arrival)
            if total > num_tokens:
                self.generation_tokens.labels(*engine).inc(total - num_tokens)
        for gap in out.inter_token_latencies:  # per engine step, as it came
            self.itl.labels(*engine).observe(gap)
        for c in out.outputs:
            if c.finish_reason is not None and c.index not in finished:
                finished.add(c.index)
                self._success.labels(*engine, c.finish_reason).inc()
        if out.finished:
            self.e2e.labels(*engine).observe(now - arrival)
        return max(total, num_tokens)

    def count_http(self, path: str, method: str, status: int) -> None:
        """One answered request; `path` without --root-path's prefix."""
        handler = _handler(path)
        self._http.labels(self.model_name, handler, method, f"{status // 100}xx").inc()

    def render(self) -> tuple[bytes, str]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Exporter(self.registry, self.multiproc_dir))
        return generate_latest(registry), CONTENT_TYPE_LATEST


# Endpoints counted by name; a path with an id counts under its route pattern, anything else
# under "other" (so a client cannot grow the label set).
_HANDLERS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics",
    "/version",
})  # fmt: skip


def _handler(path: str) -> str:
    if path in _HANDLERS:
        return path
    parts = path.split("/")
    if len(parts) in (4, 5) and path.startswith("/v1/responses/"):
        return "/v1/responses/{id}" + ("/" + parts[4] if len(parts) == 5 else "")
    return "other"


class _Exporter:
    """Collects this server's registry (or every server's files) and turns `_TOTALS` into
    counters."""

    def __init__(self, registry: CollectorRegistry, multiproc_dir: str | None) -> None:
        self.source = registry
        self.multiproc_dir = multiproc_dir

    def collect(self) -> Iterator[Metric]:
        for family in self._collect():
            yield family
            for name in _VLLM_TWINS.get(family.name.removeprefix(P), ()):
                yield _renamed(family, "vllm:" + name)

    def _collect(self) -> Iterator[Metric]:
        if self.multiproc_dir:
            families = MultiProcessCollector(None, self.multiproc_dir).collect()
        else:
            families = self.source.collect()
        totals = {P + key for key in [*_TOTALS, *_SPEC_TOTALS, _PER_POS]}
        for family in families:
            if family.name not in totals:
                yield family
                continue
            counter = Metric(family.name, family.documentation, "counter")
            for s in family.samples:
                counter.add_sample(family.name + "_total", s.labels, s.value)
            yield counter


def _renamed(family: Metric, name: str) -> Metric:
    """`family` under another name: the same samples, suffixes (`_total`, `_bucket`) kept."""
    twin = Metric(name, family.documentation, family.type)
    for s in family.samples:
        suffix = s.name[len(family.name) :]
        twin.add_sample(name + suffix, s.labels, s.value, s.timestamp, s.exemplar)
    return twin
