"""The real scheduler on an offline workload, with a rough H100 cost per step instead of a GPU:
when requests finish, how many preemptions, where completions pause. For questions such as W5's
"first request after 18 s, then a pause mid-run": is that the schedule or a stall?

    python tests/sim_schedule.py --input-len 16384 --output-len 256 --num-prompts 64

Step cost (Llama-3-8B, bf16): layer matmuls at MATMUL_FLOPS (decode-only steps never below the
5.3 ms weight read), prompt attention at ATTN_FLOPS (causal, 32 heads x 128 x 32 layers), decode
attention at KV_BYTES_PER_S over each row's context (128 KiB of K+V per token over 32 layers).
The default KV capacity (26,000 blocks of 16) is what an H100 leaves at 0.9 utilization.
"""

from __future__ import annotations

import argparse

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepResult

MATMUL_FLOPS, ATTN_FLOPS, KV_BYTES_PER_S = 650e12, 450e12, 2.8e12
PARAMS, KV_TOKEN_BYTES, HEADS_DIM_LAYERS = 8e9, 131072, 32 * 128 * 32


def step_seconds(scheduled: list[tuple[int, int]]) -> float:
    """(tokens this step, context after it) per row -> modelled GPU time."""
    tokens = sum(n for n, _ in scheduled)
    seconds = max(5.3e-3, 2 * PARAMS * tokens / MATMUL_FLOPS)
    for n, ctx in scheduled:
        if n > 1:
            seconds += 4 * n * (ctx - n / 2) * HEADS_DIM_LAYERS / ATTN_FLOPS
        else:
            seconds += ctx * KV_TOKEN_BYTES / KV_BYTES_PER_S
    return seconds


def simulate(args: argparse.Namespace) -> dict[str, float]:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget),
        CacheConfig(block_size=16),
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
    )
    prefix = list(range(10**7, 10**7 + args.prefix_len))
    for i in range(args.num_prompts):
        first = i * (args.input_len + 1)
        s.add_request(AddRequest(
            req_id=str(i), prompt_token_ids=prefix + list(range(first, first + args.input_len)),
            sampling=SamplingParams(max_tokens=args.output_len, ignore_eos=True),
            eos_token_ids=[2], arrival_time=0.0,
        ))  # fmt: skip
    now, done = 0.0, []
    while s.has_unfinished_requests():
        plan = s.schedule()
        rows = [s.requests[r] for r in plan.scheduled_ids]
        counts = plan.num_scheduled_tokens
        now += step_seconds([(n, r.num_computed_tokens) for n, r in zip(counts, rows, strict=True)])
        sampled = [[7] if r.num_computed_tokens == r.num_tokens else [] for r in rows]
        s.update_from_output(plan, StepResult(plan.step_id, sampled))
        done += [now for r in plan.scheduled_ids if r not in s.requests]
    gaps = [b - a for a, b in zip(done[:-1], done[1:], strict=True)]
    return {
        "seconds": now, "requests_per_s": len(done) / now, "first_done_s": done[0],
        "longest_gap_s": max(gaps, default=0.0), "preemptions": s.num_preemptions,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--num-prompts", 64), ("--input-len", 16384), ("--output-len", 256),
                          ("--prefix-len", 0), ("--num-blocks", 26000), ("--budget", 8192),
                          ("--max-num-seqs", 256), ("--max-model-len", 32768)):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    for key, value in simulate(p.parse_args()).items():
        print(f"{key:>16}: {value:.3g}")


if __name__ == "__main__":
    main()
