"""`bench serve`'s per-request records and its summary, under the key names `vllm bench serve`
writes to its `--save-result` JSON (request_throughput, mean_ttft_ms, p99_tpot_ms, ...), so files
from either tool sit side by side in the same scripts and plots.

TTFT is sending to the first streamed token; TPOT = (E2E - TTFT) / (output tokens - 1) per
request; ITL is every gap between streamed chunks; E2EL is sending to the last byte. A request's
clock starts when it is sent, not while it waits for a `--max-concurrency` slot (that wait is its
queue time).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

# Per-request lists vLLM drops from the saved file unless --save-detailed.
DETAILED = ["input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
            "errors"]  # fmt: skip
# Per-request lists, kept in the saved file but not printed.
PER_REQUEST = [*DETAILED, "latencies", "queue_times"]


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    start_time: float = 0.0  # when sent (perf_counter)
    queue_time: float = 0.0  # waiting for a --max-concurrency slot before that
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    replica: str | None = None  # the X-Pagedserve-Replica answer header (nginx --replica-header)


def summarize(
    results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tokens_per_s(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        **keeping_up(ok),
    }  # fmt: skip
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in metrics:
        out.update(distribution(name, series[name], percentiles))
    out.update(
        input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
        latencies=[r.latency for r in results], start_times=[r.start_time for r in results],
        queue_times=[r.queue_time for r in results],
        generated_texts=[r.generated_text for r in results], errors=[r.error for r in results],
    )  # fmt: skip
    return out


def distribution(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pNN of `values` (seconds) in ms, under vLLM's `{stat}_{name}_ms` keys."""
    ms = 1000 * np.asarray(values or [0.0])
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def keeping_up(ok: list[RequestResult]) -> dict[str, float]:
    """Whether the server kept up with the arrivals, from the requests sent once the load was at
    its steady level (after the first send + the median E2E latency: earlier ones met an emptier
    server), at least 10 of them (else nothing): `steady_send_rate`, the rate they were sent at,
    and `sustained_request_throughput`, the rate the server completed them at: that rate / (1 +
    the slope of E2E latency against send time). A server that keeps up finishes requests as
    fast as they come and its latency does not grow (slope 0: the send rate); one whose capacity
    mu is below the send rate lambda finishes the i-th at about i / mu, its latency growing by
    lambda / mu - 1 a second (so lambda / (1 + slope) = mu). Unlike `request_throughput`
    (completed / duration), neither depends on how long the last requests run once sending
    stops, so a short run says whether the server keeps up (the noise: the slope's spread)."""
    if not ok:
        return {}
    begin = min(r.start_time for r in ok) + float(np.median([r.latency for r in ok]))
    steady = [r for r in ok if r.start_time >= begin]
    sent = np.asarray([r.start_time for r in steady])
    if len(steady) < 10 or sent.max() <= sent.min():
        return {}
    rate = (len(steady) - 1) / float(sent.max() - sent.min())
    slope = float(np.polyfit(sent, [r.latency for r in steady], 1)[0])
    return {"steady_send_rate": rate, "sustained_request_throughput": rate / (1 + max(slope, 0))}


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once, from their send and finish times."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1)
                                                              for r in results])  # fmt: skip
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def peak_tokens_per_s(results: list[RequestResult]) -> float:
    """Most streamed chunks (tokens, one a chunk) that arrived within one wall-clock second."""
    times = []
    for r in results:
        t = r.start_time + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    if not times:
        return 0.0
    seconds = np.floor(np.asarray(times) - min(times)).astype(int)
    return float(np.bincount(seconds).max())


def saved_result(
    args: argparse.Namespace, summary: dict[str, Any], model_id: str, tokenizer_id: str | None
) -> dict[str, Any]:
    """vLLM's result JSON: the set-up, then the summary (per-request lists only if detailed)."""
    chat = args.endpoint.endswith("/chat/completions")
    head: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai", "label": args.label,
        "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": args.num_prompts,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
    }  # fmt: skip
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: use KEY=VALUE")
        head[key.strip()] = value.strip()
    result = {**head, **summary}
    if not args.save_detailed:
        for key in DETAILED:
            result.pop(key, None)
    return result


def result_path(args: argparse.Namespace, model_id: str, date: str) -> str:
    """--result-filename, else vLLM's `{label}-{rate}qps[-concurrencyN]-{model}-{date}.json`."""
    name = args.result_filename
    if name is None:
        label = args.label or ("openai-chat" if args.endpoint.endswith("/chat/completions")
                               else "openai")  # fmt: skip
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = f"{label}-{args.request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save(result: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(f"bench serve: results in {path}")
