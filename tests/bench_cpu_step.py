"""Worker-side cost of one decode step on a CPU: `ModelRunner.execute` of B running requests at a
given context, in thread and process CPU time (steadier than wall time on a shared machine) and
wall time. `--constrained F`: that share of the rows follow `bench structured`'s JSON schema.

    python tests/bench_cpu_step.py [--model DIR] [--batch 32] [--context 128] [--dtype float32]
        [--constrained 0.5] [--compiled] [--linear-ab]

`--linear-ab`: the CPU linears' plain float32 weights (the few-row C++ kernel, cpu_linear.py)
against the same weights in oneDNN's blocked layout (`PAGEDSERVE_CPU_LINEAR=packed`), swapped in
alternating blocks of 10 steps in one process, wall time (the weight reads are the step here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import pagedserve
from pagedserve.benchmarks.structured import SCHEMA
from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import (
    CachedDelta,
    NewRequest,
    SamplingParams,
    StepPlan,
    StructuredOutputs,
)
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

EMBEDDED = os.path.join(os.path.dirname(pagedserve.__file__), "frontend", "default_model")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--constrained", type=float, default=0.0)
    ap.add_argument("--compiled", action="store_true", help="eager vs compiled forward, A/B")
    ap.add_argument("--linear-ab", action="store_true", help="plain vs oneDNN-packed weights")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    config = build_engine_config(a.model, device="cpu", dtype=a.dtype, load_format=a.load_format,
                                 num_gpu_blocks_override=2048)  # fmt: skip
    runner = ModelRunner(config, torch.device("cpu"), rank_info(config.parallel, 0))
    runner.init_cache(2048)
    per_row = -(-(a.context + 2 * a.steps + 8) // 16)
    greedy = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    spec = StructuredOutputs(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True,
                                 structured_outputs=spec)  # fmt: skip
    if a.constrained:
        runner.grammars.hold(spec)  # the core would wait for it before the plan
    news = [
        NewRequest(f"r{i}", list(range(5, 5 + a.context)),
                   list(range(i * per_row, (i + 1) * per_row)),
                   constrained if i < round(a.constrained * a.batch) else greedy, 0)
        for i in range(a.batch)
    ]  # fmt: skip
    ids = [n.req_id for n in news]
    runner.execute(StepPlan(0, ids, [a.context] * a.batch, new_requests=news))

    def decode(k: int) -> StepPlan:
        cached = [CachedDelta(r, [], [], a.context + k - 1) for r in ids]
        return StepPlan(k, ids, [1] * a.batch, cached=cached)

    for k in range(1, 4):
        runner.execute(decode(k))
    if a.compiled:
        compare_compiled(runner, decode, 4, a)
        return
    if a.linear_ab:
        compare_linear_layouts(runner, decode, 4, a)
        return
    cpu, proc, wall = time.thread_time(), time.process_time(), time.perf_counter()
    for k in range(4, 4 + a.steps):
        runner.execute(decode(k))
    cpu, proc = time.thread_time() - cpu, time.process_time() - proc
    wall = time.perf_counter() - wall
    print(f"decode batch {a.batch} ({a.constrained:.0%} constrained) at context ~{a.context}: "
          f"{cpu / a.steps * 1e3:.2f} ms thread CPU, {proc / a.steps * 1e3:.2f} ms process CPU, "
          f"{wall / a.steps * 1e3:.2f} ms wall per step")  # fmt: skip


def compare_linear_layouts(runner: ModelRunner, decode, first: int, a: argparse.Namespace) -> None:
    """Each layer's plain weight (as loaded) and a oneDNN-packed copy of it, swapped in blocks."""
    layers = [m for m in runner.model.modules() if getattr(m, "packed", None) is not None]
    plain = [m.packed for m in layers]
    assert all(p.layout == torch.strided for p in plain), "load with PAGEDSERVE_CPU_LINEAR=onednn"
    packed = [torch.ops.mkldnn._reorder_linear_weight(p, None) for p in plain]
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    k = first
    for _ in range(max(a.steps // 20, 1)):
        for name, weights in (("plain", plain), ("packed", packed)):
            for m, w in zip(layers, weights, strict=True):
                m.packed = w
            runner.execute(decode(k))  # one step outside the timing after switching
            t = time.perf_counter()
            for step in range(k + 1, k + 11):
                runner.execute(decode(step))
            times[name].append((time.perf_counter() - t) / 10 * 1e3)
            k += 11
    for name, ms in times.items():
        print(
            f"decode batch {a.batch} at context ~{a.context}, {name} weights: median "
            f"{statistics.median(ms):.2f} ms wall a step (min {min(ms):.2f}, {len(ms)} blocks)"
        )


def compare_compiled(runner: ModelRunner, decode, first: int, a: argparse.Namespace) -> None:
    """Eager and compiled forwards (worker/cpu_compile.py) in alternating blocks of 10 steps in
    one process, so both see the same machine; waits for the package first."""
    compiler = runner.cpu_compiler
    assert compiler is not None, "no compiled forward for this model (cpu_compile.eligible)"
    t = time.perf_counter()
    if compiler.child is not None:
        compiler.child.proc.wait()
    assert compiler.forward() is not None, "the package did not build"
    print(f"compiled forward ready after {time.perf_counter() - t:.1f} s")
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    k = first
    for _ in range(max(a.steps // 20, 1)):
        for name in times:
            runner.cpu_compiler = compiler if name == "compiled" else None
            runner.execute(decode(k))  # one step outside the timing after switching
            cpu = time.thread_time()
            for step in range(k + 1, k + 11):
                runner.execute(decode(step))
            times[name].append((time.thread_time() - cpu) / 10 * 1e3)
            k += 11
    for name, ms in times.items():
        print(f"decode batch {a.batch} at context ~{a.context}, {name}: median "
              f"{statistics.median(ms):.2f} ms thread CPU a step (min {min(ms):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
