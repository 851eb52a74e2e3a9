"""`pagedserve bench serve`: an OpenAI-API load generator for any compatible server (vLLM too).

Streams `/v1/completions` or `/v1/chat/completions` (`--endpoint`) with prompts from a dataset
(benchmarks/datasets.py), Poisson (or gamma, with `--burstiness`) arrivals at
`--request-rate`, at most `--max-concurrency` requests in flight, and reports TTFT, TPOT, ITL and
E2EL like `vllm bench serve`, under its key names in `--save-result` JSON (results.py).

The model's tokenizer (`--tokenizer`, else `--model` or the path the server reports in
/v1/models when that directory is here) counts prompt lengths and gives random prompts the served
model's own vocabulary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from typing import Any

import numpy as np

from pagedserve.benchmarks import results
from pagedserve.benchmarks.client import arrival_gaps, headers, send
from pagedserve.benchmarks.common import positive_int
from pagedserve.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from pagedserve.benchmarks.multi_turn import add_multi_turn_args, bench_multi_turn
from pagedserve.benchmarks.results import RequestResult


def request_body(
    sample: SampleRequest, model: str, chat: bool, args: argparse.Namespace
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    if args.ignore_eos or args.dataset_name == "random":  # vLLM: random runs to its lengths
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return {**body, **(args.extra_body or {})}


async def run_load(
    samples: list[SampleRequest], model: str, args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """Send every sample at its arrival time; each waits for a concurrency slot, then is sent."""
    import httpx
    from tqdm import tqdm

    chat = args.endpoint.endswith("/chat/completions")
    url = args.base_url.rstrip("/") + args.endpoint
    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness,
                        np.random.default_rng(args.seed))  # fmt: skip
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(samples), disable=True if args.disable_tqdm else None)

    async def limited(client: Any, sample: SampleRequest) -> RequestResult:
        arrived = time.perf_counter()
        async with slots or contextlib.nullcontext():
            result = await send(client, url, request_body(sample, model, chat, args), chat)
        result.queue_time = result.start_time - arrived
        result.prompt_len = result.prompt_len or sample.prompt_len
        bar.update(1)
        return result

    limits = httpx.Limits(max_connections=args.max_concurrency or len(samples) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None),
                                 headers=headers(args)) as client:  # fmt: skip
        start, tasks = time.perf_counter(), []
        for sample, gap in zip(samples, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(client, sample)))
        outputs = await asyncio.gather(*tasks)
    bar.close()
    return list(outputs), time.perf_counter() - start


def server_model(args: argparse.Namespace) -> dict[str, Any] | None:
    """The server's first /v1/models card (its id, `root` path, max_model_len), or None."""
    import httpx

    try:
        url = args.base_url.rstrip("/") + "/v1/models"
        cards = httpx.get(url, headers=headers(args), timeout=30).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return cards[0] if cards else None


def bench_tokenizer(
    args: argparse.Namespace, card: dict[str, Any] | None
) -> tuple[Any, str | None]:
    """(tokenizer, its path): --tokenizer, else --model or the server's model path if here."""
    from pagedserve.frontend.tokenizer import load_tokenizer

    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer), args.tokenizer
    same_model = card is not None and args.model in (None, card.get("id"))
    for path in (args.model, card.get("root") if same_model else None):
        if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return load_tokenizer(path), path
    return None, None


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """The run's summary; a mistake in the flags or the dataset ends in one line (exit 1)."""
    try:
        return _bench_serve(args)
    except (ValueError, OSError) as e:
        raise SystemExit(f"bench serve: {e}") from None


def _bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    if unknown := set(args.percentile_metrics.split(",")) - {"ttft", "tpot", "itl", "e2el"}:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}")
    card = server_model(args)
    model = args.model or (card or {}).get("id")
    if model is None:
        raise SystemExit(f"bench serve: no --model and no model at {args.base_url}/v1/models")
    tokenizer, tokenizer_id = bench_tokenizer(args, card)
    if args.dataset_name == "multi-turn":
        summary = bench_multi_turn(args, model, tokenizer)
    else:
        max_len = card.get("max_model_len") if card and card.get("id") == model else None
        samples = get_samples(args, tokenizer, args.vocab_size, max_len)
        outputs, duration = asyncio.run(run_load(samples, model, args))
        metrics, percentiles = args.percentile_metrics.split(","), parse_percentiles(args)
        summary = results.summarize(outputs, duration, metrics, percentiles)
        if not summary["completed"]:
            summary["first_error"] = next((r.error for r in outputs if r.error), "")
    result = results.saved_result(args, summary, model, tokenizer_id)
    if args.save_result:
        results.save(result, results.result_path(args, model, result["date"]))
    return {k: v for k, v in result.items() if k not in results.PER_REQUEST}


def parse_percentiles(args: argparse.Namespace) -> list[float]:
    return [float(p) for p in args.metric_percentiles.split(",")]


def add_serve_parser(kinds: Any) -> None:
    p = kinds.add_parser("serve", help="online serving load against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])  # fmt: skip
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    add_dataset_args(p)
    add_multi_turn_args(p)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most; a request's clock starts when it is sent",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into bodies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--label", default=None)
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--output-json", default=None, help="the summary as JSON (device_run.sh)")
