"""`pagedserve bench serve`: an OpenAI-API load generator for any compatible server (vLLM too).

Streams `/v1/completions` with random token-id prompts of exact lengths, Poisson (or gamma, with
`--burstiness`) arrivals at `--request-rate`, and reports TTFT, TPOT, ITL and E2E percentiles and
throughput like `vllm bench serve`. TPOT = (E2E - TTFT) / (output tokens - 1) per request; ITL is
every gap between streamed chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.frontend.bench.offline import random_lengths, random_prompts


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    result = RequestResult(prompt_tokens=len(body["prompt"]))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
    except Exception as e:  # a failed request is counted and reported, not fatal to the run
        result.error = repr(e)
    return result


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if rate == float("inf"):
        return np.zeros(n)
    theta = 1.0 / (rate * burstiness)  # gamma with mean 1/rate; burstiness 1 is Poisson
    return rng.gamma(shape=burstiness, scale=theta, size=n)


async def run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    import httpx

    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    in_lens = random_lengths(args.random_input_len, args.random_range_ratio, n, rng)
    out_lens = random_lengths(args.random_output_len, args.random_range_ratio, n, rng)
    prompts = random_prompts(in_lens, args.vocab_size, rng)
    gaps = arrival_gaps(n, args.request_rate, args.burstiness, rng)
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or n)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, out_len, gap in zip(prompts, out_lens, gaps, strict=True):
            await asyncio.sleep(gap)
            body = {
                "model": args.model, "prompt": prompt, "max_tokens": out_len, "stream": True,
                "ignore_eos": args.ignore_eos, "temperature": 0.0,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            tasks.append(asyncio.create_task(one_request(client, url, body)))
        results = []
        for i, task in enumerate(asyncio.as_completed(tasks), 1):
            results.append(await task)
            if i % max(1, n // 20) == 0 or i == n:
                print(f"\rbench serve: {i}/{n} done", end="", flush=True)
        print()
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
        "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in ok) / elapsed,
    }  # fmt: skip
    if not ok:
        out["first_error"] = next((r.error for r in results if r.error), "")
        return out
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {
        "ttft_ms": [r.ttft for r in ok], "tpot_ms": tpot,
        "itl_ms": [x for r in ok for x in r.itl], "e2el_ms": [r.e2e for r in ok],
    }  # fmt: skip
    for name, values in series.items():
        if values:
            ms = 1000 * np.asarray(values)
            out[f"mean_{name}"] = float(ms.mean())
            for q in (50, 90, 99):
                out[f"p{q}_{name}"] = float(np.percentile(ms, q))
    return out


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    results, elapsed = asyncio.run(run_load(args))
    return summarize(results, elapsed)


def add_serve_parser(kinds: Any) -> None:
    p = kinds.add_parser("serve", help="online serving load against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=32000, help="random ids are drawn below it")
    p.add_argument("--num-prompts", type=int, default=800)
    p.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int,
                   default=512)  # fmt: skip
    p.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int,
                   default=256)  # fmt: skip
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", "--result-file", dest="output_json", default=None)
