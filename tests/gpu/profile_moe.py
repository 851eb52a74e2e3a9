"""The MoE kernel's share of a decode step, and its fraction of the GPU's peak.

    python tests/gpu/profile_moe.py MODEL_DIR [--batch 1 64] [--ctx 128] [--json OUT.json]

Per batch size, on the model runner alone (dummy bf16 weights): the step's GPU time (a decode
graph replay timed with CUDA events; an eager step without graphs), the grouped-GEMM kernel's
time in one step from the torch profiler and its share of all kernel time, and its fraction of
peak: at small batch memory-bound (expert weights read / kernel time, against `--peak-tbs`
TB/s), at large batch compute-bound (expert FLOPs / kernel time, against `--peak-tflops`). The
experts a step reads are counted from the router's real choices (one eager pass with hooks).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.tests.gpu.profile_step import decode_plan
from pagedserve.worker.layers.moe import FusedMoE
from pagedserve.worker.model_runner import ModelRunner

MOE_KERNEL = "_grouped_gemm_kernel"


def _self_device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def step_gpu_ms(runner: ModelRunner, batch: int, plan_at) -> float:
    """One decode step's GPU time: a graph replay on CUDA, else a timed eager step."""
    if runner.graphs is not None and runner.graphs.bucket(batch) is not None:
        graph = runner.graphs.graphs[runner.graphs.bucket(batch)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20
    t0 = time.perf_counter()
    runner.execute(plan_at(0))
    return 1000 * (time.perf_counter() - t0)


def experts_read(runner: ModelRunner, plan: StepPlan) -> tuple[int, int]:
    """(distinct experts summed over the MoE layers, routed token-expert pairs) of one eager
    step: forward hooks on the routers see the real routing."""
    counts: list[tuple[int, int]] = []

    def hook(module: FusedMoE, args, out) -> None:
        ids = torch.topk(out, module.top_k, dim=-1).indices  # [T, K]
        counts.append((int(ids.unique().numel()), int(ids.numel())))

    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    handles = [m.gate.register_forward_hook(lambda g, a, o, m=m: hook(m, a, o)) for m in moes]
    graphs, mixed = runner.graphs, runner.mixed_graphs
    runner.graphs = runner.mixed_graphs = None  # eager: hooks do not run inside a replay
    try:
        runner.execute(plan)
    finally:
        runner.graphs, runner.mixed_graphs = graphs, mixed
        for h in handles:
            h.remove()
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def prefill_plan(batch: int, ctx: int, block_size: int, vocab: int) -> StepPlan:
    """Prompts of different tokens per request, so that tokens route to different experts (as
    real traffic does; equal prompts would send every row to the same few)."""
    gen = torch.Generator().manual_seed(0)
    per = -(-(ctx + 200) // block_size)  # max_model_len is ctx + 256
    news = [
        NewRequest(f"r{i}", torch.randint(10, vocab, (ctx,), generator=gen).tolist(),
                   list(range(i * per, (i + 1) * per)), SamplingParams(temperature=0), 0)
        for i in range(batch)
    ]  # fmt: skip
    return StepPlan(0, [n.req_id for n in news], [ctx] * batch, new_requests=news)


def profile(runner: ModelRunner, batch: int, ctx: int, args) -> dict:
    vocab = min(runner.config.model.vocab_size, 100_000)
    runner.execute(prefill_plan(batch, ctx, runner.block_size, vocab))
    step = iter(range(1, 10_000))
    computed = [ctx]

    def plan_at(_: int) -> StepPlan:
        plan = decode_plan(next(step), batch, computed[0])
        computed[0] += 1
        return plan

    for _ in range(5):
        runner.execute(plan_at(0))
    step_ms = step_gpu_ms(runner, batch, plan_at)
    cuda = runner.device.type == "cuda"  # on a CPU only a smoke run: no kernel to find
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(3):
            runner.execute(plan_at(0))
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    total_us = sum(_self_device_us(e) for e in events) / 3
    moe_us = sum(_self_device_us(e) for e in events if MOE_KERNEL in e.key) / 3
    distinct, pairs = experts_read(runner, plan_at(0))
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    hidden, inter = moe.w2_weight.shape[1], moe.w2_weight.shape[2]
    elem = moe.w2_weight.element_size()
    weight_bytes = distinct * 3 * hidden * inter * elem  # w13 (2I x H) and w2 (H x I) per expert
    flops = 2 * pairs * 3 * hidden * inter
    seconds = moe_us / 1e6 if moe_us else float("nan")
    runner.execute(StepPlan(next(step), [], [], finished_ids=[f"r{i}" for i in range(batch)]))
    return {
        "batch": batch,
        "step_ms": step_ms,
        "kernel_ms_total": total_us / 1000,
        "moe_ms": moe_us / 1000,
        "moe_share": moe_us / total_us if total_us else float("nan"),
        "experts_read_per_step": distinct,
        "moe_tb_per_s": weight_bytes / seconds / 1e12,
        "moe_frac_peak_bw": weight_bytes / seconds / 1e12 / args.peak_tbs,
        "moe_tflops": flops / seconds / 1e12,
        "moe_frac_peak_flops": flops / seconds / 1e12 / args.peak_tflops,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--peak-tbs", type=float, default=3.0)
    ap.add_argument("--peak-tflops", type=float, default=783.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = build_engine_config(args.model, load_format="dummy", dtype=dtype, device=args.device,
                                 gpu_memory_utilization=0.85, max_num_seqs=max(args.batch),
                                 max_model_len=args.ctx + 256)  # fmt: skip
    runner = ModelRunner(config, device, rank_info(config.parallel, 0))
    runner.init_cache(runner.profile_num_blocks())
    rows = [profile(runner, b, args.ctx, args) for b in args.batch]
    for r in rows:
        print(f"moe batch {r['batch']:>3}: step {r['step_ms']:.3f} ms, grouped GEMM "
              f"{r['moe_ms']:.3f} ms = {100 * r['moe_share']:.0f}% of kernel time, "
              f"{r['experts_read_per_step']} experts read, {r['moe_tb_per_s']:.2f} TB/s "
              f"({100 * r['moe_frac_peak_bw']:.0f}% of {args.peak_tbs}), "
              f"{r['moe_tflops']:.1f} TFLOP/s ({100 * r['moe_frac_peak_flops']:.1f}% of "
              f"{args.peak_tflops:.0f})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
