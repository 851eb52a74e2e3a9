"""Where LoRA's time goes, on a GPU: the model runner alone (no processes, no ipc), one runner
with `--max-loras 4` random rank-16 adapters on all seven projections (benchmarks/lora.py's),
the same steps once with every row on an adapter and once with base-model rows only:

    python3 tests/gpu/profile_lora.py MODEL_DIR [--decode 1 256] [--prefill 8] [--device cuda]

- decode at each batch size: GPU ms of one decode-graph replay, the kernels of one step and
  kernels per layer (torch profiler), top kernels;
- one eager prefill step of `--prefill` prompts of `--prompt-len` tokens (1,024: W1's prompt
  steps): ms and the step's CUDA time by kind (profile_step's `step_kinds`).

Adapter rows run round robin over the 4 adapters. Base rows in a LoRA runner still replay the
graphs' LoRA kernels (they exit at once); eager base rows skip LoRA. `PAGEDSERVE_DISABLE_FUSIONS=
lora-gemv` gives the decode path before the shrink rode the base GEMV.
"""

from __future__ import annotations

import argparse
import time

import torch
from profile_step import decode_plan, kernel_gaps, prefill_plan, step_kinds

from pagedserve.benchmarks.lora import write_random_adapter
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import LoRARequest, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

NUM_LORAS, RANK, CTX = 4, 16, 128
ACTIVITIES = [  # (CPU: a smoke run's)
    torch.profiler.ProfilerActivity.CUDA
    if torch.cuda.is_available()
    else torch.profiler.ProfilerActivity.CPU
]


def load_adapters(runner: ModelRunner, root: str) -> list[LoRARequest]:
    hf = runner.config.model.hf
    loras = [
        LoRARequest(f"a{i}", i + 1, write_random_adapter(hf, RANK, root, i))
        for i in range(NUM_LORAS)
    ]
    for lora in loras:
        runner.lora.submit(lora, [])
    done: list = []
    while len(done) < NUM_LORAS:
        time.sleep(0.05)
        done += runner.lora.poll()
    assert all(error is None for _, error in done), done
    return loras


def with_loras(plan: StepPlan, loras: list[LoRARequest] | None) -> StepPlan:
    for i, new in enumerate(plan.new_requests):
        new.lora = None if loras is None else loras[i % len(loras)]
    return plan


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graph_replay_ms(runner: ModelRunner, batch: int, n: int = 50) -> float:
    """GPU ms of one replay of the batch's decode graph (nan without graphs: a CPU smoke)."""
    if runner.graphs is None:
        return float("nan")
    graph = runner.graphs.graphs[runner.graphs.bucket(batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def profile_decode(runner: ModelRunner, batch: int, loras: list | None, tag: str) -> None:
    runner.execute(with_loras(prefill_plan(batch, CTX, runner.block_size), loras))
    for step in range(5):
        runner.execute(decode_plan(step + 1, batch, CTX + step))
    replay_ms = graph_replay_ms(runner, batch)  # the last step's inputs and LoRA rows
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        runner.execute(decode_plan(20, batch, CTX + 5))
        sync()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sum(1 for e in prof.events() if e.device_type == cuda and e.time_range.end > 0)
    layers = runner.config.model.hf["num_hidden_layers"]
    print(f"=== decode batch {batch}, {tag}: graph replay {replay_ms:.3f} ms, "
          f"{kernels} kernels ({kernels / layers:.1f} a layer): {kernel_gaps(prof)}")  # fmt: skip
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))  # fmt: skip
    runner.execute(StepPlan(21, [], [], finished_ids=[f"r{i}" for i in range(batch)]))


def profile_prefill(
    runner: ModelRunner, num_seqs: int, prompt_len: int, loras: list | None, tag: str
) -> None:
    plan = prefill_plan(num_seqs, prompt_len, runner.block_size)
    ids = plan.scheduled_ids

    def run(step: int) -> None:
        fresh = with_loras(prefill_plan(num_seqs, prompt_len, runner.block_size), loras)
        runner.execute(StepPlan(step, ids, fresh.num_scheduled_tokens, fresh.new_requests))
        runner.execute(StepPlan(step + 1, [], [], finished_ids=ids))

    for i in range(3):
        run(200 + 2 * i)
    sync()
    t0 = time.perf_counter()
    for i in range(3):
        run(300 + 2 * i)
    sync()
    ms = 1000 * (time.perf_counter() - t0) / 3
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        run(400)
        sync()
    print(f"=== prefill {num_seqs} x {prompt_len}, {tag}: {ms:.1f} ms a step; {step_kinds(prof)}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                    max_name_column_width=60))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--adapters", default="/tmp/profile-loras")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of a tiny model")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    config = build_engine_config(args.model, load_format="dummy", enable_lora=True,
                                 dtype="bfloat16" if cuda else "float32",
                                 gpu_memory_utilization=0.85, max_loras=NUM_LORAS,
                                 max_lora_rank=RANK, device=args.device)  # fmt: skip
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    runner = ModelRunner(config, device, rank_info(config.parallel, 0))
    runner.init_cache(runner.profile_num_blocks())
    loras = load_adapters(runner, args.adapters)
    for batch in args.decode:
        profile_decode(runner, batch, None, "base rows")
        profile_decode(runner, batch, loras, f"{NUM_LORAS} adapters")
    if args.prefill:
        for loras_or_none, tag in ((None, "base rows"), (loras, f"{NUM_LORAS} adapters")):
            profile_prefill(runner, args.prefill, args.prompt_len, loras_or_none, tag)


if __name__ == "__main__":
    main()
