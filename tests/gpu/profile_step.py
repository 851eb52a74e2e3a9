"""Where a decode step's time goes, on a GPU: the model runner alone (no processes, no ipc).

    python -m pagedserve.tests.gpu.profile_step MODEL_DIR [--batch 1 64 256] [--ctx 128] [--fp8]

For each batch size: GPU time of one decode-graph replay (CUDA events), host time of a full
`ModelRunner.execute` (input prep, replay, logits, sampling, the one device->host copy), host
time per step when each step starts before the last one finished (the worker's loop under async
scheduling: the host work hides behind the device's), and the top kernels of one step from the
torch profiler, also summed by kind (`step_kinds`: FP8 GEMV, activation quantization, GEMMs,
attention, ...) so that one line says where a step's time goes. Compared with `bench latency`'s
ms/token, the difference is the cost of the engine loop around the runner (scheduler, ipc).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("moe", ("grouped_gemm", "moe", "argsort", "scatter", "searchsorted", "topk")),
    ("fp8 gemv", ("fp8_gemv",)),
    ("act quant", ("quant_token", "quant_groups")),
    ("fp8 block gemm", ("w8a8_block",)),
    ("gemm", ("gemm", "sm90", "sm80", "cutlass", "xmma", "nvjet", "scaled_mm")),
    ("attention", ("attention", "attn", "flash", "_reduce_kernel")),
    ("kv write", ("cache",)),
    ("norm", ("norm",)),
    ("rotary", ("rotary", "rope")),
    ("silu", ("silu", "act_and_mul")),
)


def step_kinds(prof: torch.profiler.profile) -> str:
    """`kind us (share)` of a profiled step's CUDA time, largest first, one line."""
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, subs in KINDS if any(s in name for s in subs)), "other")
        totals[kind] = totals.get(kind, 0.0) + us
    whole = sum(totals.values()) or 1.0
    parts = sorted(totals.items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{kind} {us:.0f} ({100 * us / whole:.0f}%)" for kind, us in parts)
    return f"{whole:.0f} us: {shares}"


def kernel_gaps(prof: torch.profiler.profile) -> str:
    """Kernels of a profiled step on the GPU's timeline: how many, their summed time, and the
    idle time between one kernel's end and the next one's start (launch gaps, even in a graph)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )
    busy = sum(end - start for start, end in spans)
    idle, last_end = 0.0, None
    for start, end in spans:
        if last_end is not None and start > last_end:
            idle += start - last_end
        last_end = end if last_end is None else max(last_end, end)
    return f"{len(spans)} kernels, {busy:.0f} us busy, {idle:.0f} us idle between them"


def prefill_plan(batch: int, ctx: int, block_size: int) -> StepPlan:
    blocks_per = -(-(ctx + 160) // block_size)
    news = [
        NewRequest(f"r{i}", list(range(10, 10 + ctx)),
                   list(range(i * blocks_per, (i + 1) * blocks_per)),
                   SamplingParams(temperature=0, max_tokens=64), 0)
        for i in range(batch)
    ]  # fmt: skip
    return StepPlan(0, [n.req_id for n in news], [ctx] * batch, new_requests=news)


def decode_plan(
    step: int, batch: int, num_computed: int, told: list[int] | None = None
) -> StepPlan:
    cached = [CachedDelta(f"r{i}", told or [], [], num_computed) for i in range(batch)]
    return StepPlan(step, [c.req_id for c in cached], [1] * batch, cached=cached)


def profile_batch(runner: ModelRunner, batch: int, ctx: int) -> dict[str, float]:
    runner.execute(prefill_plan(batch, ctx, runner.block_size))
    for step in range(5):  # warm-up
        runner.execute(decode_plan(step + 1, batch, ctx + step))
    n, t0 = 30, time.perf_counter()
    for step in range(n):
        runner.execute(decode_plan(step + 10, batch, ctx + 5 + step))
    host_ms = 1000 * (time.perf_counter() - t0) / n
    graph = runner.graphs.graphs[runner.graphs.bucket(batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / n
    pipelined_ms = pipelined(runner, batch, ctx + 35, 60, n)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pipelined(runner, batch, ctx + 36 + n, 60 + n + 1, 5)
    print(f"--- batch {batch}: 5 pipelined steps: {kernel_gaps(prof)}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.execute(decode_plan(99, batch, ctx + 42 + n))
        torch.cuda.synchronize()
    print(f"--- batch {batch}: one decode step by kind: {step_kinds(prof)}")
    print(f"--- batch {batch}: {kernel_gaps(prof)}")
    print(f"--- batch {batch}: top CUDA kernels of one step")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60)
    )
    profile_eager(runner, batch, ctx + 43 + n)
    runner.execute(StepPlan(100, [], [], finished_ids=[f"r{i}" for i in range(batch)]))
    return {"batch": batch, "graph_replay_ms": replay_ms, "execute_ms": host_ms,
            "pipelined_ms": pipelined_ms}  # fmt: skip


def profile_eager(runner: ModelRunner, batch: int, ctx: int) -> None:
    """The same decode step run eagerly (the graphs set aside), so the profiler names every
    kernel of the step (inside a replay the kernels are one opaque span on some builds)."""
    graphs = runner.graphs, runner.mixed_graphs
    runner.graphs = runner.mixed_graphs = None
    try:
        for step in range(3):  # warm-up of the eager shapes
            runner.execute(decode_plan(120 + step, batch, ctx + step))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner.execute(decode_plan(130, batch, ctx + 3))
            torch.cuda.synchronize()
    finally:
        runner.graphs, runner.mixed_graphs = graphs
    print(f"--- batch {batch}: one EAGER decode step by kind: {step_kinds(prof)}")
    print(f"--- batch {batch}: eager {kernel_gaps(prof)}")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70)
    )


def pipelined(runner: ModelRunner, batch: int, ctx: int, first_step: int, n: int) -> float:
    """ms per decode step run as the worker runs them under async scheduling: step N+1 is
    queued before step N's sampled ids are read back."""
    pending = runner.sample(runner.start(decode_plan(first_step, batch, ctx), None))
    t0 = time.perf_counter()
    for step in range(n):
        started = runner.start(decode_plan(first_step + 1 + step, batch, ctx + 1 + step), pending)
        runner.finish(pending)
        pending = runner.sample(started)
    runner.finish(pending)
    return 1000 * (time.perf_counter() - t0) / n


def profile_prefill(runner: ModelRunner, num_seqs: int, prompt_len: int) -> None:
    """One eager step of `num_seqs` whole prompts (W1's shape): time, matmul TFLOP/s, kernels."""
    plan = prefill_plan(num_seqs, prompt_len, runner.block_size)
    for i in range(3):
        runner.execute(StepPlan(200 + i, *_replan(plan)))
        runner.execute(StepPlan(300 + i, [], [], finished_ids=plan.scheduled_ids))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.execute(StepPlan(400, *_replan(plan)))
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0)
    runner.execute(StepPlan(401, [], [], finished_ids=plan.scheduled_ids))
    params = sum(  # the matmul weights every token goes through (not embedding, LM head)
        p.numel()
        for n, p in runner.model.named_parameters()
        if "embed" not in n and "lm_head" not in n
    )
    tflops = 2 * params * num_seqs * prompt_len / ms / 1e9
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.execute(StepPlan(402, *_replan(plan)))
        torch.cuda.synchronize()
    runner.execute(StepPlan(403, [], [], finished_ids=plan.scheduled_ids))
    print(f"--- prefill step: {num_seqs} x {prompt_len} tokens: {ms:.1f} ms, "
          f"{tflops:.0f} TFLOP/s of layer matmuls")  # fmt: skip
    print(f"--- prefill step by kind: {step_kinds(prof)}")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    )


def profile_mixed_host(runner: ModelRunner, decodes: int, prompt_len: int, ctx: int) -> None:
    """Host time to queue one mixed step (W2's shape: a batch of decodes plus one new prompt,
    eager), against its GPU time, and where the host time goes (cProfile)."""
    import cProfile
    import pstats

    runner.execute(prefill_plan(decodes, ctx, runner.block_size))
    blocks = list(range(3000, 3000 + -(-prompt_len // runner.block_size)))
    for i in range(4):
        new = NewRequest(f"p{i}", list(range(10, 10 + prompt_len)), blocks,
                         SamplingParams(temperature=0, max_tokens=8), 0)  # fmt: skip
        cached = [CachedDelta(f"r{j}", [], [], ctx + i) for j in range(decodes)]
        ids = [f"r{j}" for j in range(decodes)] + [new.req_id]
        plan = StepPlan(500 + 2 * i, ids, [1] * decodes + [prompt_len], new_requests=[new],
                        cached=cached)  # fmt: skip
        torch.cuda.synchronize()
        prof = cProfile.Profile() if i == 3 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        started = runner.start(plan, None)
        if prof is not None:
            prof.disable()
        host_ms = 1000 * (time.perf_counter() - t0)
        runner.finish(runner.sample(started))
        gpu_ms = 1000 * (time.perf_counter() - t0)
        runner.execute(StepPlan(501 + 2 * i, [], [], finished_ids=[new.req_id]))
    print(f"--- mixed step ({decodes} decodes + {prompt_len}-token prompt): queueing it takes "
          f"{host_ms:.1f} ms of host time, start to sampled ids {gpu_ms:.1f} ms")  # fmt: skip
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    runner.execute(StepPlan(599, [], [], finished_ids=[f"r{j}" for j in range(decodes)]))


def _replan(plan: StepPlan) -> tuple:
    return plan.scheduled_ids, plan.num_scheduled_tokens, plan.new_requests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--fp8", action="store_true", help="FP8 weights and KV cache")
    ap.add_argument("--decode-only", action="store_true", help="no prefill and mixed steps")
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()
    fp8 = dict(quantization="fp8", kv_cache_dtype="fp8") if args.fp8 else {}
    if args.max_model_len:
        fp8["max_model_len"] = args.max_model_len
    config = build_engine_config(args.model, load_format="dummy", dtype="bfloat16",
                                 gpu_memory_utilization=0.85, **fp8)  # fmt: skip
    runner = ModelRunner(config, torch.device("cuda", 0), rank_info(config.parallel, 0))
    runner.init_cache(runner.profile_num_blocks())
    rows = [profile_batch(runner, b, args.ctx) for b in args.batch]
    if not args.decode_only:
        profile_prefill(runner, 8, 1024)
        profile_mixed_host(runner, 48, 512, 600)
    print(f"{'batch':>6} {'graph replay ms':>16} {'execute() ms':>13} {'pipelined ms':>13}")
    for r in rows:
        print(f"{r['batch']:>6} {r['graph_replay_ms']:>16.3f} {r['execute_ms']:>13.3f} "
              f"{r['pipelined_ms']:>13.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
