"""`pagedserve bench throughput|latency|startup`: offline runs of an in-process `LLM`, and the
time from `launch` to the first 200 on /health.

Workloads use random token-id prompts of exact lengths and `ignore_eos`, as vLLM's random
dataset does, so the numbers sit beside `vllm bench` ones (flags keep vLLM's names).
`--random-prefix-len N` puts one shared random N-token prefix before every prompt (W6).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

from pagedserve.benchmarks.common import engine_kwargs, random_lengths, random_prompts, vocab_size
from pagedserve.benchmarks.lora import lora_engine_kwargs, lora_requests


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    in_lens = random_lengths(args.input_len, args.random_range_ratio, args.num_prompts, rng)
    out_lens = random_lengths(args.output_len, args.random_range_ratio, args.num_prompts, rng)
    vocab = vocab_size(args.model)
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
    loras = lora_requests(args, len(prompts))  # --num-loras: adapters spread uniformly
    with LLM(args.model, **engine_kwargs(args), **lora_engine_kwargs(args),
             speculative_config=args.speculative_config) as llm:  # fmt: skip
        warm = [{"prompt_token_ids": p} for p in warm_up]
        llm.generate(warm, params[: len(warm_up)], lora_request=loras and loras[: len(warm)])
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True, lora_request=loras)
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
    prompts = random_prompts([args.input_len] * args.batch_size, vocab_size(args.model), rng)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times = []
    loras = lora_requests(args, len(batch))
    with LLM(args.model, **engine_kwargs(args), **lora_engine_kwargs(args),
             speculative_config=args.speculative_config) as llm:  # fmt: skip
        for i in range(args.num_iters_warmup + args.num_iters):
            start = time.perf_counter()
            llm.generate(batch, params, lora_request=loras)
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
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "launch", "--port",
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
