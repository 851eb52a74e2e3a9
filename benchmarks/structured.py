"""`pagedserve bench structured`: what JSON-schema constrained decoding costs, offline.

One engine runs the same batch (random prompts, `--output-len` tokens each) with 0%, 50% and 100%
of the requests constrained by a JSON schema that cannot end early (an array of at least 10,000
small objects), so every constrained row is masked at every step. The fractions take turns
(`--repeats` rounds) so that a noisy machine's drift hits each alike; each fraction reports its
median output tokens per second and its cost relative to 0%.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagedserve.benchmarks.common import add_engine_flags, engine_kwargs, random_prompts, vocab_size

SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}},
        "required": ["id", "name"],
    },
}


def add_structured_parser(kinds: Any) -> argparse.ArgumentParser:
    p = kinds.add_parser("structured", help="throughput with 0/50/100%% JSON-schema requests")
    add_engine_flags(p)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--fractions", default="0,0.5,1", help="shares of constrained requests")
    p.add_argument("--repeats", type=int, default=3)
    return p


def bench_structured(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams, StructuredOutputs

    rng = np.random.default_rng(args.seed)
    lengths = [args.input_len] * args.num_prompts
    prompts = [
        {"prompt_token_ids": p} for p in random_prompts(lengths, vocab_size(args.model), rng)
    ]
    fractions = [float(f) for f in args.fractions.split(",")]
    spec = StructuredOutputs(json=SCHEMA)

    def params(fraction: float) -> list[SamplingParams]:
        constrained = round(fraction * len(prompts))
        return [
            SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                           structured_outputs=spec if i < constrained else None)
            for i in range(len(prompts))
        ]  # fmt: skip

    rates: dict[float, list[float]] = {f: [] for f in fractions}
    with LLM(args.model, **engine_kwargs(args)) as llm:
        llm.generate(prompts[:8], params(1.0)[:8])  # warm-up, and the grammar compiles
        for _ in range(args.repeats):
            for f in fractions:
                start = time.perf_counter()
                outs = llm.generate(prompts, params(f))
                elapsed = time.perf_counter() - start
                rates[f].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    base = float(np.median(rates[fractions[0]]))
    result: dict[str, Any] = {"num_prompts": len(prompts), "output_len": args.output_len}
    for f in fractions:
        median = float(np.median(rates[f]))
        result[f"{f:.0%} constrained tok/s"] = median
        result[f"{f:.0%} constrained / 0%"] = round(median / base, 3)
        result[f"{f:.0%} constrained cost"] = f"{100 * (1 - median / base):+.1f}%"
    return result
