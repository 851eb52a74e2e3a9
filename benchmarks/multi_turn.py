"""`bench serve --dataset-name multi-turn`: U users, each holding a conversation of T turns.

Every conversation starts with the same system prompt; each turn sends the whole history, the
previous answer included, plus a new user message (text of random ordinary tokens), so turn t's
prompt repeats turn t-1's. A replica that saw turn t-1 has that prefix cached; one that did not
recomputes it. The report adds, to the usual summary: the share of prompt tokens the server
served from its prefix cache (usage.prompt_tokens_details.cached_tokens), TTFT and cached share
per turn, requests per replica (the X-Pagedserve-Replica header of deploy/nginx, when rendered
with --replica-header) and how often a conversation changed replica between two turns.

Users run concurrently (all at once, or arriving at --request-rate); a user sends its next turn
a think time after the previous answer is complete (exponential, mean --think-time: with none,
closed-loop users of equal speed return to the replica they just freed, and least_conn looks
sticky by accident). Greedy and `ignore_eos`, so every run of the same
flags sends the same conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

import numpy as np

from pagedserve.benchmarks import results
from pagedserve.benchmarks.client import arrival_gaps, headers, send
from pagedserve.benchmarks.datasets import token_pool
from pagedserve.benchmarks.results import RequestResult


def random_text(tokenizer: Any, pool: np.ndarray, num_tokens: int, rng: np.random.Generator) -> str:
    return tokenizer.decode(rng.choice(pool, size=num_tokens).tolist())


def conversations(args: argparse.Namespace, tokenizer: Any) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each user's T messages (fixed by --seed)."""
    if tokenizer is None:
        raise ValueError("--dataset-name multi-turn needs the model's tokenizer (--tokenizer)")
    rng = np.random.default_rng(args.seed)
    pool = token_pool(tokenizer, args.vocab_size)
    system = random_text(tokenizer, pool, args.system_prompt_len, rng)
    users = [
        [random_text(tokenizer, pool, args.user_turn_len, rng) for _ in range(args.num_turns)]
        for _ in range(args.num_users)
    ]
    return system, users


async def one_user(
    client: Any, user: int, system: str, messages: list[str], model: str,
    url: str, args: argparse.Namespace,
) -> list[RequestResult]:  # fmt: skip
    history = [{"role": "system", "content": system}]
    extra = {args.session_header: f"user-{user}"} if args.session_header else None
    think = np.random.default_rng([args.seed, user]).exponential(args.think_time, len(messages))
    out = []
    for turn, message in enumerate(messages):
        if turn:
            await asyncio.sleep(think[turn])
        history.append({"role": "user", "content": message})
        body = {
            "model": model, "messages": history, "max_completion_tokens": args.turn_output_len,
            "ignore_eos": True, "temperature": args.temperature or 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        result = await send(client, url, {**body, **(args.extra_body or {})}, True, extra)
        out.append(result)
        if not result.success:
            break  # the rest of this conversation has no history to build on
        history.append({"role": "assistant", "content": result.generated_text})
    return out


async def run_users(
    system: str, users: list[list[str]], model: str, args: argparse.Namespace
) -> tuple[list[list[RequestResult]], float]:
    import httpx

    url = args.base_url.rstrip("/") + args.endpoint
    gaps = arrival_gaps(len(users), args.request_rate, args.burstiness,
                        np.random.default_rng(args.seed))  # fmt: skip
    limits = httpx.Limits(max_connections=len(users))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None),
                                 headers=headers(args)) as client:  # fmt: skip
        start, tasks = time.perf_counter(), []
        for i, (messages, gap) in enumerate(zip(users, gaps, strict=True)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_user(client, i, system, messages, model,
                                                      url, args)))  # fmt: skip
        per_user = await asyncio.gather(*tasks)
    return list(per_user), time.perf_counter() - start


def cache_report(per_user: list[list[RequestResult]], num_turns: int) -> dict[str, Any]:
    """Cached share overall and per turn, TTFT per turn, requests per replica, replica changes."""
    ok = [r for turns in per_user for r in turns if r.success]
    out: dict[str, Any] = {"cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok)}
    out["cached_share"] = out["cached_prompt_tokens"] / max(1, sum(r.prompt_len for r in ok))
    out.update(conversation_share(per_user))
    per_turn = []
    for t in range(num_turns):
        done = [turns[t] for turns in per_user if len(turns) > t and turns[t].success]
        ttft = 1000 * np.asarray([r.ttft for r in done] or [0.0])
        cached = sum(r.cached_tokens or 0 for r in done) / max(1, sum(r.prompt_len for r in done))
        per_turn.append({
            "turn": t + 1, "requests": len(done), "cached_share": cached,
            "mean_prompt_tokens": float(np.mean([r.prompt_len for r in done] or [0])),
            "median_ttft_ms": float(np.median(ttft)),
        })  # fmt: skip
    out["per_turn"] = per_turn
    counts = Counter(r.replica for r in ok if r.replica)
    out["per_replica_requests"] = dict(sorted(counts.items()))
    if counts:
        out["replica_imbalance"] = max(counts.values()) / min(counts.values())
    out["replica_switches"] = sum(
        1
        for turns in per_user
        for a, b in zip(turns, turns[1:], strict=False)
        if a.replica != b.replica
    )
    return out


def conversation_share(per_user: list[list[RequestResult]]) -> dict[str, Any]:
    """The cached share of each conversation's own tokens: the shared system prompt left out.

    The shared prefix is the most any first turn found cached (a first turn shares only the
    system prompt with the others; as much of it as fills whole cache blocks): every replica
    caches it whatever the routing, so it says nothing about keeping a conversation's history."""
    firsts = [turns[0] for turns in per_user if turns and turns[0].success]
    shared = max((r.cached_tokens or 0 for r in firsts), default=0)
    ok = [r for turns in per_user for r in turns if r.success]
    own = sum(max(0, (r.cached_tokens or 0) - shared) for r in ok)
    return {
        "shared_prefix_tokens": shared,
        "conversation_cached_share": own / max(1, sum(r.prompt_len - shared for r in ok)),
    }


def bench_multi_turn(args: argparse.Namespace, model: str, tokenizer: Any) -> dict[str, Any]:
    if not args.endpoint.endswith("/chat/completions"):
        raise ValueError("--dataset-name multi-turn runs on --endpoint /v1/chat/completions")
    system, users = conversations(args, tokenizer)
    per_user, duration = asyncio.run(run_users(system, users, model, args))
    flat = [r for turns in per_user for r in turns]
    metrics = args.percentile_metrics.split(",")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    summary = results.summarize(flat, duration, metrics, percentiles)
    summary["num_prompts"] = len(flat)
    summary.update(cache_report(per_user, args.num_turns))
    if not summary["completed"]:
        summary["first_error"] = next((r.error for r in flat if r.error), "")
    return summary


def add_multi_turn_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn dataset")
    # Defaults shaped like real chats: a short system prompt, answers a few times longer than
    # the user's messages, so a conversation's own history soon outweighs the shared prompt.
    g.add_argument("--num-users", type=int, default=48)
    g.add_argument("--num-turns", type=int, default=4)
    g.add_argument("--system-prompt-len", type=int, default=32, help="tokens, shared by all")
    g.add_argument("--user-turn-len", type=int, default=32, help="tokens of each user message")
    g.add_argument("--turn-output-len", type=int, default=96, help="tokens of each answer")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="mean seconds (exponential) a user takes before its next turn")  # fmt: skip
    g.add_argument("--session-header", default=None,
                   help="send HEADER: user-N with each request (e.g. X-Session-ID)")  # fmt: skip
