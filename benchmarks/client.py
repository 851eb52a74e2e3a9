"""One streamed OpenAI request and its timings (`send`), as `bench serve` and its multi-turn
conversations send them, with the arrival gaps and headers they share.

TTFT is the time to the first streamed text; ITL the gaps between later pieces; the usage chunk
(`stream_options.include_usage`) gives the token counts and the cached prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import numpy as np

from pagedserve.benchmarks.results import RequestResult


async def send(
    client: Any, url: str, body: dict[str, Any], chat: bool, extra: dict[str, str] | None = None
) -> RequestResult:
    """One streamed request; its clock starts here, when it is sent."""
    result = RequestResult(start_time=time.perf_counter())
    last = result.start_time
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=extra) as resp:
            # "a, b" after a retry, "a : b" after nginx's spill: the last one served it
            replica = resp.headers.get("x-pagedserve-replica")
            result.replica = re.split(r", | : ", replica)[-1] if replica else None
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    read_usage(result, data["usage"])
                piece = chunk_text(data, chat)
                if not piece:
                    continue
                if not text:
                    result.ttft = now - result.start_time
                else:
                    result.itl.append(now - last)
                last = now
                text.append(piece)
        result.latency = time.perf_counter() - result.start_time
        result.generated_text = "".join(text)
        result.output_tokens = result.output_tokens or len(text)
        result.success = bool(text)
        result.error = "" if text else "no tokens streamed"
    except Exception as e:  # a failed request is counted and reported, not fatal to the run
        result.error = repr(e)
    return result


def chunk_text(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices") or [{}]
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.output_tokens = usage.get("completion_tokens") or 0
    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if rate == float("inf"):
        return np.zeros(n)
    theta = 1.0 / (rate * burstiness)  # gamma with mean 1/rate; burstiness 1 is Poisson
    return rng.gamma(shape=burstiness, scale=theta, size=n)


def headers(args: argparse.Namespace) -> dict[str, str]:
    out = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for item in args.header or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--header {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
