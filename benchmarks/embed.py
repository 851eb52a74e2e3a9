"""`pagedserve bench embed`: offline embedding throughput of a pooling model (docs/pooling.md).

Random token-id prompts of exact lengths (as `bench throughput`), run through `LLM.embed` with
`--runner pooling`; the rate is prompt tokens per second. `bench throughput --output-len 1` on
the same model and lengths gives the generate runner's prefill rate beside it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagedserve.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    random_lengths,
    random_prompts,
    vocab_size,
)


def add_embed_parser(kinds: Any) -> argparse.ArgumentParser:
    p = kinds.add_parser("embed", help="offline embedding throughput (--runner pooling)")
    add_engine_flags(p)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=10000)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--pooler-config", default=None, help="JSON, as launch's flag")
    return p


def bench_embed(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM

    rng = np.random.default_rng(args.seed)
    lens = random_lengths(args.input_len, args.random_range_ratio, args.num_prompts, rng)
    vocab = vocab_size(args.model)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lens, vocab, rng)]
    warm = random_prompts(lens[:8], vocab, np.random.default_rng(args.seed + 1))
    kw = engine_kwargs(args)
    with LLM(args.model, runner="pooling", pooler_config=args.pooler_config, **kw) as llm:
        llm.embed([{"prompt_token_ids": p} for p in warm], use_tqdm=False)
        start = time.perf_counter()
        outs = llm.embed(prompts, use_tqdm=True)
        elapsed = time.perf_counter() - start
    assert len(outs) == len(prompts)
    return {
        "elapsed_s": elapsed, "requests_per_s": len(outs) / elapsed,
        "prompt_tokens_per_s": sum(lens) / elapsed, "num_prompts": len(outs),
        "input_len": args.input_len, "dim": len(outs[0].outputs.embedding),
    }  # fmt: skip
