"""`pagedserve bench throughput|latency|startup` (offline and start-up) and the `serve` hook.

Workloads use random token-id prompts of exact lengths and `ignore_eos`, as vLLM's random
dataset does, so the numbers sit beside `vllm bench` ones (flags keep vLLM's names).
`--random-prefix-len N` puts one shared random N-token prefix before every prompt (W6).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

from pagedserve.config import ModelConfig

ENGINE_FLAGS = {
    "--tp": ("tensor_parallel_size", int, 1),
    "--pp": ("pipeline_parallel_size", int, 1),
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
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    for flag, (dest, typ, default) in ENGINE_FLAGS.items():
        p.add_argument(flag, dest=dest, type=typ, default=default)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = [dest for dest, _, _ in ENGINE_FLAGS.values()]
    flags = ["enable_prefix_caching", "enforce_eager", "async_scheduling"]
    kw = {k: getattr(args, k) for k in keys + flags}
    return {k: v for k, v in kw.items() if v is not None}


def random_lengths(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)] (vLLM's --random-range-ratio)."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_prompts(lengths: list[int], vocab: int, rng: np.random.Generator) -> list[list[int]]:
    # Ids from 10 up avoid the special tokens a tokenizer keeps at the start of its vocabulary.
    return [rng.integers(10, vocab, size=n).tolist() for n in lengths]


def _vocab(model: str) -> int:
    return ModelConfig(model).vocab_size


def report(name: str, result: dict[str, Any], path: str | None) -> None:
    print(f"== {name} ==")
    for key, value in result.items():
        print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    in_lens = random_lengths(args.input_len, args.random_range_ratio, args.num_prompts, rng)
    out_lens = random_lengths(args.output_len, args.random_range_ratio, args.num_prompts, rng)
    vocab = _vocab(args.model)
    prefix = (
        random_prompts([args.random_prefix_len], vocab, rng)[0] if args.random_prefix_len else []
    )
    prompts = [{"prompt_token_ids": prefix + p} for p in random_prompts(in_lens, vocab, rng)]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)
              for n in out_lens]  # fmt: skip
    # The warm-up runs prompts of its own (same lengths, other tokens, no shared prefix): the
    # measured ones must not find the warm-up's KV in the prefix cache. vLLM's bench runs no
    # warm-up, so its first request computes the shared prefix too.
    warm_up = random_prompts(in_lens[:8], vocab, np.random.default_rng(args.seed + 1))
    with LLM(args.model, **engine_kwargs(args)) as llm:
        llm.generate([{"prompt_token_ids": p} for p in warm_up], params[: len(warm_up)])
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    total = out_tokens + sum(in_lens) + len(prefix) * len(outs)
    return {
        "elapsed_s": elapsed, "requests_per_s": len(outs) / elapsed,
        "total_tokens_per_s": total / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "num_prompts": len(outs), "input_len": args.input_len, "output_len": args.output_len,
        "prefix_len": args.random_prefix_len,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
    }  # fmt: skip


def bench_latency(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = random_prompts([args.input_len] * args.batch_size, _vocab(args.model), rng)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times = []
    with LLM(args.model, **engine_kwargs(args)) as llm:
        for i in range(args.num_iters_warmup + args.num_iters):
            start = time.perf_counter()
            llm.generate(batch, params)
            if i >= args.num_iters_warmup:
                times.append(time.perf_counter() - start)
    mean = float(np.mean(times))
    return {
        "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "avg_latency_s": mean,
        "p50_latency_s": float(np.percentile(times, 50)),
        "p99_latency_s": float(np.percentile(times, 99)),
        "ms_per_output_token": 1000 * mean / args.output_len,
    }  # fmt: skip


def bench_startup(args: argparse.Namespace) -> dict[str, Any]:
    """Time from `pagedserve launch` to the first 200 on /health, over `--num-iters` starts."""
    times = []
    launch_args = [a for a in args.launch_args if a != "--"]
    for _ in range(args.num_iters):
        cmd = [sys.executable, "-m", "pagedserve.frontend.cli", "launch", "--port",
               str(args.port), "--host", "127.0.0.1", *launch_args]  # fmt: skip
        with tempfile.TemporaryFile() as log:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                times.append(_wait_health(args.port, proc, start, timeout=args.timeout))
            except RuntimeError:
                log.seek(0)
                print(log.read().decode(errors="replace")[-3000:], file=sys.stderr)
                raise
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    return {"ready_s_min": min(times), "ready_s_median": float(np.median(times)),
            "starts": len(times)}  # fmt: skip


def _wait_health(port: int, proc: subprocess.Popen, start: float, timeout: float) -> float:
    url = f"http://127.0.0.1:{port}/health"
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"launch exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"/health did not answer 200 within {timeout} s")


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, startup")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    tp = kinds.add_parser("throughput", help="offline throughput, in-process engine")
    add_engine_flags(tp)
    tp.add_argument("--input-len", type=int, default=1024)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--num-prompts", type=int, default=1000)
    tp.add_argument("--random-range-ratio", type=float, default=0.0)
    tp.add_argument("--random-prefix-len", type=int, default=0,
                    help="one shared random prefix before every prompt (vLLM's flag)")  # fmt: skip
    lat = kinds.add_parser("latency", help="batch-N fixed lengths, end-to-end latency")
    add_engine_flags(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--num-iters-warmup", type=int, default=2)
    lat.add_argument("--num-iters", type=int, default=5)
    st = kinds.add_parser("startup", help="launch to first 200 on /health")
    st.add_argument("--port", type=int, default=8011)
    st.add_argument("--num-iters", type=int, default=2)
    st.add_argument("--timeout", type=float, default=600)
    st.add_argument("launch_args", nargs=argparse.REMAINDER, help="flags passed to launch")
    from pagedserve.frontend.bench.serve import add_serve_parser

    add_serve_parser(kinds)
    from pagedserve.frontend.bench.structured import add_structured_parser

    so = add_structured_parser(kinds)
    for p in (tp, lat, st, so):
        p.add_argument("--output-json", default=None)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_kind == "serve":
        from pagedserve.frontend.bench.serve import bench_serve

        result = bench_serve(args)
    else:
        from pagedserve.frontend.bench.structured import bench_structured

        fn = {"throughput": bench_throughput, "latency": bench_latency, "startup": bench_startup,
              "structured": bench_structured}  # fmt: skip
        result = fn[args.bench_kind](args)
    report(args.bench_kind, result, getattr(args, "output_json", None))
    return 0
