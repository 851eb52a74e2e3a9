"""Where a decode step's time goes, on a GPU: the model runner alone (no processes, no ipc).

    python -m pagedserve.tests.gpu.profile_step MODEL_DIR [--batch 1 64 256] [--ctx 128]

For each batch size: GPU time of one decode-graph replay (CUDA events), host time of a full
`ModelRunner.execute` (input prep, replay, logits, sampling, the one device->host copy), and the
top kernels of one step from the torch profiler. Compared with `bench latency`'s ms/token, the
difference is the cost of the engine loop around the runner (scheduler, ipc).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner


def prefill_plan(batch: int, ctx: int, block_size: int) -> StepPlan:
    blocks_per = -(-(ctx + 64) // block_size)
    news = [
        NewRequest(f"r{i}", list(range(10, 10 + ctx)),
                   list(range(i * blocks_per, (i + 1) * blocks_per)),
                   SamplingParams(temperature=0, max_tokens=64), 0)
        for i in range(batch)
    ]  # fmt: skip
    return StepPlan(0, [n.req_id for n in news], [ctx] * batch, new_requests=news)


def decode_plan(step: int, batch: int, num_computed: int) -> StepPlan:
    cached = [CachedDelta(f"r{i}", [11], [], num_computed) for i in range(batch)]
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.execute(decode_plan(99, batch, ctx + 40))
        torch.cuda.synchronize()
    print(f"--- batch {batch}: top CUDA kernels of one step")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
    )
    runner.execute(StepPlan(100, [], [], finished_ids=[f"r{i}" for i in range(batch)]))
    return {"batch": batch, "graph_replay_ms": replay_ms, "execute_ms": host_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=128)
    args = ap.parse_args()
    config = build_engine_config(args.model, load_format="dummy", dtype="bfloat16",
                                 gpu_memory_utilization=0.85)  # fmt: skip
    runner = ModelRunner(config, torch.device("cuda", 0), rank_info(config.parallel, 0))
    runner.init_cache(runner.profile_num_blocks())
    rows = [profile_batch(runner, b, args.ctx) for b in args.batch]
    print(f"{'batch':>6} {'graph replay ms':>16} {'execute() ms':>13} {'host overhead ms':>17}")
    for r in rows:
        overhead = r["execute_ms"] - r["graph_replay_ms"]
        print(f"{r['batch']:>6} {r['graph_replay_ms']:>16.3f} {r['execute_ms']:>13.3f} "
              f"{overhead:>17.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
