"""The host KV tier's decisions at a GPU run's shape, on any CPU: the real core (Scheduler,
block pools, host tier) driven by a worker that computes nothing, so a run counts exactly what
the engine would compute and copy: tokens computed (prefill recomputed after preemptions
included), blocks copied out on the step path, out beside the forward (spills ahead), and in.

W1 at a quarter of its KV need, Llama-3-8B shape (2 MiB blocks of 16 tokens: 9 GiB is 4,608
blocks, the 16 GiB host tier 8,192), tier off against auto (a lazy swap) and eager swap:
  python3 -m pagedserve.benchmarks.kv_tier_sim
  python3 -m pagedserve.benchmarks.kv_tier_sim --num-prompts 300 --modes off,auto,swap
Each line also prices the run with H100 figures (`--token-us`: one token's 8B forward at ~700
TFLOP/s; `--block-us`: a 2 MiB block over PCIe at ~40 GB/s), as the work that separates the
modes: tokens computed plus the copies a step waits for (out before the step and in); spills
ahead run beside the forward and are not priced. A model of the difference, not a measurement:
tests/gpu/kv_tier_run.sh measures it.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_tier import TierSpec
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepResult


def make_scheduler(args: argparse.Namespace, mode: str, max_model_len: int) -> Scheduler:
    """`mode`: "off" (no tier: recompute), "auto" or "swap"/"recompute" (forced)."""
    tier = None
    if mode != "off":
        spec_mode = None if mode == "auto" else mode
        tier = TierSpec(args.host_blocks, args.block_us * 1e-6, args.token_us * 1e-6, 1, spec_mode)
    return Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget),
        CacheConfig(block_size=16),
        max_model_len=max_model_len,
        num_blocks=args.device_blocks,
        host_tier=tier,
    )


def step(args: argparse.Namespace, s: Scheduler, count: Counter) -> tuple[list, float]:
    """One plan and its result (each row that computed its last known token samples 7): the
    finished requests' deltas, and the step's priced seconds (`--step-ms` and the work)."""
    plan = s.schedule()
    work = Counter(
        steps=1, tokens=sum(plan.num_scheduled_tokens), out=len(plan.kv_to_host),
        ahead=len(plan.kv_to_host_ahead), into=len(plan.kv_from_host),
    )  # fmt: skip
    count.update(work)
    sampled = []
    for rid in plan.scheduled_ids:
        req = s.requests.get(rid)
        sampled.append([7] if req and req.num_computed_tokens == req.num_tokens else [])
    result = StepResult(step_id=plan.step_id, sampled_token_ids=sampled)
    deltas = [d for _, d in s.update_from_output(plan, result) if d.finish_reason]
    priced = work["tokens"] * args.token_us + (work["out"] + work["into"]) * args.block_us
    return deltas, args.step_ms / 1e3 + priced / 1e6


def w1(args: argparse.Namespace, mode: str) -> Counter:
    s = make_scheduler(args, mode, args.input_len + args.output_len)
    rng = random.Random(args.seed)
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(3, 32000) for _ in range(args.input_len)]
        s.add_request(AddRequest(f"r{i}", prompt, sampling, [2], 0.0))
    count = Counter()
    while s.has_unfinished_requests():
        count["priced_s"] += step(args, s, count)[1]
    return finish(s, count)


def multi_turn(args: argparse.Namespace, mode: str) -> Counter:
    """`--num-users` conversations of `--num-turns` turns (a shared 32-token system prompt, then
    256-token user turns and 64-token answers), each turn a think time (exponential, mean 1 s)
    after the previous answer, on a clock that steps advance by their priced time."""
    s = make_scheduler(args, mode, 32 + args.num_turns * 320)
    rng = random.Random(args.seed)
    system = [rng.randrange(3, 32000) for _ in range(32)]
    history = {u: list(system) for u in range(args.num_users)}
    turn, arrivals = dict.fromkeys(history, 0), [(0.0, u) for u in history]
    sampling = SamplingParams(max_tokens=64, ignore_eos=True)
    count, now = Counter(), 0.0
    while arrivals or s.has_unfinished_requests():
        arrivals.sort()
        if not s.has_unfinished_requests():
            now = max(now, arrivals[0][0])
        while arrivals and arrivals[0][0] <= now:
            _, u = arrivals.pop(0)
            history[u] += [rng.randrange(3, 32000) for _ in range(256)]
            s.add_request(AddRequest(f"u{u}t{turn[u]}", list(history[u]), sampling, [2], now))
            count["prompt_tokens"] += len(history[u])
        deltas, seconds = step(args, s, count)
        now += seconds
        for d in deltas:
            u = int(d.req_id[1 : d.req_id.index("t")])
            count["cached_tokens"] += d.num_cached_tokens
            history[u] += [7] * 64
            turn[u] += 1
            if turn[u] < args.num_turns:
                arrivals.append((now + rng.expovariate(1.0), u))
    count["priced_s"] = now
    return finish(s, count)


def finish(s: Scheduler, count: Counter) -> Counter:
    count["preemptions"] = s.num_preemptions
    if s.kv.tier is not None:  # evicted blocks the spill filter kept off the host
        count["skipped"] = s.kv.tier.filter.num_skipped
    return count


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["w1", "multi-turn"], default="w1")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-users", type=int, default=64)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--device-blocks", type=int, default=4608)
    p.add_argument("--host-blocks", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--token-us", type=float, default=23.0)
    p.add_argument("--block-us", type=float, default=50.0)
    p.add_argument("--step-ms", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,auto,swap")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    for mode in args.modes.split(","):
        c = (w1 if args.workload == "w1" else multi_turn)(args, mode)
        line = (
            f"{args.workload} {mode:<9} steps {c['steps']:5d}, tokens computed {c['tokens']:8d}, "
            f"preemptions {c['preemptions']:4d}; blocks out {c['out']:6d} before the step, "
            f"{c['ahead']:6d} ahead, in {c['into']:6d}, not spilled {c['skipped']:6d}; "
            f"priced {c['priced_s']:.2f} s"
        )
        if c["prompt_tokens"]:
            line += f", cached share {c['cached_tokens'] / c['prompt_tokens']:.3f}"
        print(line)


if __name__ == "__main__":
    main()
