"""Where LoRA's time goes, on a GPU: the model runner alone (no processes, no ipc), one runner
with `--max-loras 4` random rank-16 adapters on all seven projections (benchmarks/lora.py's),
the same steps once with every row on an adapter and once with base-model rows only:

    python3 tests/gpu/profile_lora.py MODEL_DIR [--decode 1 256] [--prefill 8] [--device cuda]
        [--mixed 248:776 200:7992] [--pipelined 256]

- decode at each batch size: GPU ms of one decode-graph replay, the kernels of one step and
  kernels per layer (torch profiler), top kernels;
- one eager prefill step of `--prefill` prompts of `--prompt-len` tokens (1,024: W1's prompt
  steps): ms and the step's CUDA time by kind (profile_step's `step_kinds`);
- `--mixed D:P`: one step of D decodes plus a P-token prompt (W1's mixed steps: up to 1,024
  tokens a mixed graph, above that eager), GPU ms and kernels;
- `--pipelined B`: host ms a decode step of B rows takes when steps are queued as the worker
  queues them (async scheduling), with the graph's LoRA rows staged as now and as the lora39b
  tree staged them (a pageable copy, which waits for the GPU);
- every case: base rows against adapter rows by kernel, the largest differences first
  (`kernel_diff`).

Adapter rows run round robin over the 4 adapters. Base rows in a LoRA runner still replay the
graphs' LoRA kernels (they exit at once); eager base rows skip LoRA. `PAGEDSERVE_DISABLE_FUSIONS=
lora-gemv` gives the decode path before the shrink rode the base GEMV.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from profile_step import decode_plan, kernel_gaps, pipelined, prefill_plan, step_kinds

from pagedserve.benchmarks.lora import write_random_adapter
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, LoRARequest, NewRequest, SamplingParams, StepPlan
from pagedserve.kernels.lora import group_layout
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.lora.manager import LoRAManager
from pagedserve.worker.model_runner import ModelRunner

NUM_LORAS, RANK, CTX = 4, 16, 128
ACTIVITIES = [  # (CPU: a smoke run's)
    torch.profiler.ProfilerActivity.CUDA
    if torch.cuda.is_available()
    else torch.profiler.ProfilerActivity.CPU
]
# the host's side too (its CUDA runtime calls) where the device is profiled
HOST = [torch.profiler.ProfilerActivity.CPU] if torch.cuda.is_available() else []


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


def top_kernels(prof: torch.profiler.profile) -> dict[str, tuple[int, float]]:
    """Kernels of a profile (ops' CPU time on a CPU smoke): name -> (calls, us)."""
    cuda = torch.cuda.is_available()
    out: dict[str, tuple[int, float]] = {}
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            out[event.key] = (event.count, us)
    return out


def kernel_diff(base: dict, lora: dict, tag: str, top: int = 12) -> None:
    """Adapter rows against base rows by kernel, the largest time differences first."""
    total = sum(us for _, us in lora.values()) - sum(us for _, us in base.values())
    print(f"--- {tag}: by kernel, {NUM_LORAS} adapters - base rows = {total:+.0f} us")
    print(f"{'kernel':<64} {'calls':>11} {'base us':>9} {'lora us':>9} {'diff us':>9}")
    names = sorted(
        set(base) | set(lora),
        key=lambda n: -abs(lora.get(n, (0, 0.0))[1] - base.get(n, (0, 0.0))[1]),
    )
    for name in names[:top]:
        (bc, bu), (lc, lu) = base.get(name, (0, 0.0)), lora.get(name, (0, 0.0))
        print(f"{name[:64]:<64} {bc:>5}/{lc:<5} {bu:>9.0f} {lu:>9.0f} {lu - bu:>+9.0f}")


def profile_decode(runner: ModelRunner, batch: int, loras: list | None, tag: str) -> dict:
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
    runner.execute(StepPlan(21, [], [], finished_ids=[f"r{i}" for i in range(batch)]))
    return top_kernels(prof)


def stage_pageable(self) -> None:
    """The lora39b tree's `LoRAManager.stage_graph`: a copy from pageable memory, which waits
    for the GPU's queue to drain before it starts (CUDA's rule for pageable host-to-device)."""
    if self.batch.segments is None and self.graph_empty:
        return
    host, _, _ = group_layout(*(self.batch.segments or ([0], [])), self.graph_rows,
                              self.config.max_loras)  # fmt: skip
    self.graph_buf.copy_(torch.from_numpy(host), non_blocking=True)
    self.graph_empty = self.batch.segments is None


def pipelined_ms(runner: ModelRunner, batch: int, loras: list | None, n: int = 30) -> float:
    """Host ms per decode step queued as the worker queues them: step N + 1 starts before step
    N's sampled ids are read back (profile_step's `pipelined`, after a prefill of `loras`)."""
    runner.execute(with_loras(prefill_plan(batch, CTX, runner.block_size), loras))
    for step in range(3):
        runner.execute(decode_plan(step + 1, batch, CTX + step))
    ms = pipelined(runner, batch, CTX + 3, 10, n)
    runner.execute(StepPlan(10 + n + 2, [], [], finished_ids=[f"r{i}" for i in range(batch)]))
    return ms


def profile_pipelined(runner: ModelRunner, batch: int, loras: list) -> None:
    base = pipelined_ms(runner, batch, None)
    now = pipelined_ms(runner, batch, loras)
    staged = LoRAManager.stage_graph
    LoRAManager.stage_graph = stage_pageable
    try:
        before = pipelined_ms(runner, batch, loras)
    finally:
        LoRAManager.stage_graph = staged
    print(
        f"=== pipelined decode batch {batch}: host ms a step: base rows {base:.3f}, "
        f"{NUM_LORAS} adapters {now:.3f}, with the pageable staging copy {before:.3f}"
    )


def mixed_plan(step: int, decodes: int, prompt: int, block_size: int, lora) -> StepPlan:
    """D running decodes (`prefill_plan`'s requests) and one new P-token prompt."""
    first = decodes * -(-(CTX + 160) // block_size)  # past the decodes' blocks
    new = NewRequest("p", list(range(10, 10 + prompt)),
                     list(range(first, first + -(-prompt // block_size))),
                     SamplingParams(temperature=0, max_tokens=8), 0, lora=lora)  # fmt: skip
    cached = [CachedDelta(f"r{i}", [], [], CTX + step) for i in range(decodes)]
    ids = [c.req_id for c in cached] + ["p"]
    return StepPlan(100 + 2 * step, ids, [1] * decodes + [prompt], [new], cached=cached)


PHASES = ("start", "sample", "finish", "2nd execute")


def host_calls(prof: torch.profiler.profile, top: int = 8) -> str:
    """The host's costliest CUDA runtime calls in a profiled step, `name us/calls` (a sync, a
    copy from pageable memory or a pinned allocation on the step path shows here)."""
    calls = sorted(
        ((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()
         if e.key.startswith("cuda") and e.self_cpu_time_total > 0),
        reverse=True,
    )[:top]  # fmt: skip
    return ", ".join(f"{key} {us:.0f}/{n}" for us, n, key in calls)


class GcTimer:
    """Milliseconds Python's garbage collector ran while this is on (gc.callbacks)."""

    def __init__(self) -> None:
        self.ms, self.count, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += 1000 * (time.perf_counter() - self._t0)
            self.count += 1


def profile_mixed(runner: ModelRunner, decodes: int, prompt: int, loras: list | None, tag: str):
    runner.execute(with_loras(prefill_plan(decodes, CTX, runner.block_size), loras))
    lora = None if loras is None else loras[decodes % len(loras)]

    def run(step: int) -> list[float]:  # host ms of each phase (`PHASES`)
        t = [time.perf_counter()]
        started = runner.start(mixed_plan(step, decodes, prompt, runner.block_size, lora), None)
        t.append(time.perf_counter())
        pending = runner.sample(started)
        t.append(time.perf_counter())
        runner.finish(pending)
        t.append(time.perf_counter())
        runner.execute(StepPlan(101 + 2 * step, [], [], finished_ids=["p"]))
        t.append(time.perf_counter())
        return [1000 * (b - a) for a, b in zip(t, t[1:], strict=False)]

    for step in range(3):
        run(step)
    sync()
    gc_timer = GcTimer()
    gc.callbacks.append(gc_timer)
    t0 = time.perf_counter()
    phases = [sum(p) / 3 for p in zip(*(run(step) for step in range(3, 6)), strict=True)]
    sync()
    ms = 1000 * (time.perf_counter() - t0) / 3
    gc.callbacks.remove(gc_timer)
    with torch.profiler.profile(activities=ACTIVITIES + HOST) as prof:
        run(6)
        sync()
    split = ", ".join(f"{name} {v:.2f}" for name, v in zip(PHASES, phases, strict=True))
    print(f"=== mixed {decodes} decodes + {prompt}-token prompt, {tag}: {ms:.1f} ms a step "
          f"(2 executes; host ms: {split}; gc {gc_timer.ms:.1f} ms in {gc_timer.count}); "
          f"{kernel_gaps(prof)}; {step_kinds(prof)}")  # fmt: skip
    print(f"    host's CUDA calls (us/calls): {host_calls(prof)}")
    runner.execute(StepPlan(199, [], [], finished_ids=[f"r{i}" for i in range(decodes)]))
    return top_kernels(prof)


def profile_prefill(
    runner: ModelRunner, num_seqs: int, prompt_len: int, loras: list | None, tag: str
) -> dict:
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
    return top_kernels(prof)


def both(fn, runner: ModelRunner, loras: list, tag: str, *args) -> None:
    """`fn` on base rows, then on adapter rows, and their difference by kernel."""
    base = fn(runner, *args, None, "base rows")
    lora = fn(runner, *args, loras, f"{NUM_LORAS} adapters")
    kernel_diff(base, lora, tag)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--mixed", nargs="*", default=[], help="D:P, D decodes + a P-token prompt")
    ap.add_argument("--pipelined", type=int, nargs="*", default=[])
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
    for batch in args.pipelined:
        profile_pipelined(runner, batch, loras)
    for batch in args.decode:
        both(profile_decode, runner, loras, f"decode batch {batch}", batch)
    for case in args.mixed:
        decodes, prompt = (int(v) for v in case.split(":"))
        both(profile_mixed, runner, loras, f"mixed {case}", decodes, prompt)
    if args.prefill:
        both(profile_prefill, runner, loras, f"prefill {args.prefill}", args.prefill,
             args.prompt_len)  # fmt: skip


if __name__ == "__main__":
    main()
