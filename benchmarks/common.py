"""What the `pagedserve bench` commands share: the offline engine flags (`add_engine_flags`,
`engine_kwargs`), random prompts of exact lengths (vLLM's random dataset), and the report.

A leaf of benchmarks/: every bench module imports this one and this one imports none of them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from pagedserve.config import ModelConfig
from pagedserve.entrypoints.args import parse_size

ENGINE_FLAGS = {
    "--tp": ("tensor_parallel_size", int, 1),
    "--pp": ("pipeline_parallel_size", int, 1),
    "--data-parallel-size,-dp": ("data_parallel_size", int, 1),
    "--dtype": ("dtype", str, "auto"),
    "--max-model-len": ("max_model_len", int, None),
    "--max-num-seqs": ("max_num_seqs", int, None),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, None),
    "--block-size": ("block_size", int, 16),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float, 0.9),
    "--load-format": ("load_format", str, "auto"),
    "--seed": ("seed", int, 0),
    "--device": ("device", str, "auto"),
    "--quantization": ("quantization", str, None),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "auto"),
    "--attention-backend": ("attention_backend", str, "auto"),
    "--kv-cache-memory": ("kv_cache_memory", parse_size, None),
    "--kv-offloading-size": ("kv_offloading_size", float, None),
    "--preemption-mode": ("preemption_mode", str, None),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    for flag, (dest, typ, default) in ENGINE_FLAGS.items():
        p.add_argument(*flag.split(","), dest=dest, type=typ, default=default)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = [dest for dest, _, _ in ENGINE_FLAGS.values()]
    flags = [
        "enable_prefix_caching",
        "enforce_eager",
        "async_scheduling",
        "disable_custom_all_reduce",
    ]
    kw = {k: getattr(args, k) for k in keys + flags}
    return {k: v for k, v in kw.items() if v is not None}


def random_lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)] (vLLM's --random-range-ratio)."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_prompts(lengths: list[int], vocab: int, rng: np.random.Generator) -> list[list[int]]:
    # Ids from 10 up avoid the special tokens a tokenizer keeps at the start of its vocabulary.
    return [rng.integers(10, vocab, size=n).tolist() for n in lengths]


def vocab_size(model: str) -> int:
    return ModelConfig(model).vocab_size


def report(name: str, result: dict[str, Any], path: str | None) -> None:
    print(f"== {name} ==")
    for key, value in result.items():
        print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def positive_int(text: str) -> int:
    """An argparse type: an integer, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value
