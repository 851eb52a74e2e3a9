"""A worker process: one per GPU (or CPU rank). Receives plans, runs them, the driver replies.

Run as `python -m pagedserve.worker.worker_process --config JSON --rank R --plans ADDR
--results ADDR --dist-port PORT` (started by the EngineCore, or by `launch --node-rank K`).
Life: load weights -> report KV capacity (WorkerReady "profiled") -> allocate on InitCache
(WorkerReady "cache_ready") -> execute every StepPlan in order. Any exception is reported to the
core as WorkerError (with the traceback) before the process exits, so the core can say why.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import NoReturn

import zmq

from pagedserve import settings
from pagedserve.config import EngineConfig
from pagedserve.ipc.curve import load_key
from pagedserve.ipc.messages import (
    CompileGrammar,
    CoreToWorker,
    GrammarCompiled,
    InitCache,
    LoadLoRA,
    LoRALoaded,
    ShutdownWorkers,
    StepPlan,
    WorkerError,
    WorkerReady,
    WorkerToCore,
)
from pagedserve.ipc.process import die_with_parent, freeze_startup_heap
from pagedserve.ipc.sockets import CoreAddresses, StepReceiver, StepSender, deliver_before_exit

logger = logging.getLogger("pagedserve.worker")
POLL_S = 50e-6  # while a step runs on the GPU: how often to look for the next plan
GRAMMAR_POLL_S = 1e-3  # while idle and a grammar compiles (an adapter loads): how often to look


def serve(config: EngineConfig, rank: int, addresses: CoreAddresses, dist_port: int) -> None:
    # Over TCP (multi-node) the core only talks CURVE, to holders of the shared key.
    secure = load_key().client_options() if addresses.plans.startswith("tcp://") else None
    results: StepSender[WorkerToCore] = StepSender(addresses.results, bind=False, options=secure)
    plans: StepReceiver[CoreToWorker] = StepReceiver(
        addresses.plans, CoreToWorker, bind=False, kind=zmq.SUB, options=secure
    )
    try:
        run_loop(config, rank, dist_port, plans, results)
    except Exception:
        results.send(WorkerError(rank, traceback.format_exc()))
        plans.close()
        results.close(flush_timeout=2.0)
        deliver_before_exit(timeout=2.0)
        raise
    results.close()
    plans.close()


def run_loop(
    config: EngineConfig, rank: int, dist_port: int, plans: StepReceiver, results: StepSender
) -> None:
    start = time.perf_counter()
    clock = PhaseClock()
    # torch is imported here so that a bad install is reported to the core as a WorkerError.
    from pagedserve.parallel.groups import init_distributed, rank_info
    from pagedserve.worker.device import resolve_device, set_cpu_threads, weight_bytes
    from pagedserve.worker.model_runner import ModelRunner

    clock.mark("torch import")
    parallel = config.parallel
    info = rank_info(parallel, rank)
    local_rank = parallel.first_local_device + rank % parallel.ranks_per_node
    device = resolve_device(parallel.device, local_rank)
    init_distributed(
        info,
        parallel.master_addr,
        dist_port,
        device,
        config.pipelined_async,
        custom_all_reduce=not parallel.disable_custom_all_reduce,
        ranks_per_host=parallel.ranks_per_node,
    )
    clock.mark("device and process groups")
    runner = ModelRunner(config, device, info)
    if device.type == "cpu":
        set_cpu_threads(parallel.local_ranks_of_host, weight_bytes(runner.model))
    clock.mark("weights")
    num_blocks = runner.profile_num_blocks()
    clock.mark("memory profile")
    results.send(
        WorkerReady(
            rank,
            num_blocks,
            "profiled",
            time.perf_counter() - start,
            clock.timings,
            num_host_blocks=runner.num_host_blocks(),
        )  # fmt: skip
    )
    # One step may stay unfinished while the next is queued on the device: if the next plan is
    # already here (async scheduling sends it early; with pipeline stages the core keeps one plan
    # per stage out), it starts before this one's sampled ids are read back, so the device runs
    # step N+1 while the host reports step N. A later pipeline stage's receive is queued on the
    # device too (NCCL's stream), so starting N+1 never waits for the neighbour on the host. On a
    # CPU the forward runs as it is queued (and gloo's receive blocks), so looking ahead would
    # only hold step N's result back for a whole forward: there each step is reported as soon as
    # it is sampled, and the core plans N + 2 while this worker computes N + 1.
    lookahead = device.type == "cuda"
    # The last of several pipeline stages reports step N before it queues an eager step N+1:
    # queueing one behind N waits for the device (its launch queue, most likely) until N and
    # most of N+1 have run, and the core, which needs N's tokens for that micro-batch's next
    # plan, would get them a whole stage forward late while the first stage idles (measured:
    # prompt steps' results came in pairs, 3 stage forwards after their plans instead of 2).
    # N+1 cannot start before its hidden states arrive anyway.
    report_first = lookahead and info.is_last_stage and parallel.pipeline_parallel_size > 1
    freeze_startup_heap()
    pending = None
    trace = _open_trace(config, rank)
    try:
        while True:
            if runner.grammars.pending:
                _report_grammars(runner, rank, results)
            if runner.lora is not None and runner.lora.loading:
                for lora_id, error in runner.lora.poll():
                    results.send(LoRALoaded(rank, lora_id, error))
            msg = _next_message(plans, runner, pending)
            if isinstance(msg, StepPlan) and lookahead:
                pending = _step_ahead(runner, msg, pending, results, trace, report_first)
                continue
            _finish(runner, pending, results)
            pending = None
            if msg is None:
                continue
            if isinstance(msg, StepPlan):
                _finish(runner, runner.sample(runner.start(msg, None)), results)
            elif isinstance(msg, InitCache):
                start = time.perf_counter()
                timings = runner.init_cache(msg.num_blocks, msg.num_host_blocks)
                costs = runner.tier_costs
                results.send(
                    WorkerReady(
                        rank,
                        msg.num_blocks,
                        "cache_ready",
                        time.perf_counter() - start,
                        timings,
                        num_host_blocks=msg.num_host_blocks,
                        block_bytes=int(costs.get("block_bytes", 0)),
                        swap_s_per_block=costs.get("swap_s_per_block", 0.0),
                        recompute_s_per_token=costs.get("recompute_s_per_token", 0.0),
                    )  # fmt: skip
                )
                if costs and rank == 0:
                    _say_tier(costs)
            elif isinstance(msg, CompileGrammar):
                if info.is_last_stage:  # only the sampling ranks need grammars
                    runner.grammars.submit(msg.key, msg.spec, msg.drop_keys)
            elif isinstance(msg, LoadLoRA) and runner.lora is not None:
                runner.lora.submit(msg.lora, msg.drop_ids)  # read on a thread: poll() reports
            elif isinstance(msg, ShutdownWorkers):
                _memory_report(runner, rank)
                if runner.host_tier is not None and rank == 0:
                    print(f"pagedserve: {runner.host_tier.report()}", file=sys.stderr, flush=True)
                return
    finally:
        runner.grammars.close()
        if runner.lora is not None:
            runner.lora.close()
        if trace is not None:
            trace.close()


def _step_ahead(
    runner, plan: StepPlan, pending, results: StepSender, trace: StepTrace | None, report_first
):
    """Queue `plan` on the device, then report the step before (`pending`; first when
    `report_first` and `plan` runs eagerly) and queue `plan`'s sampling; returns `plan`'s
    pending step."""
    if report_first and pending is not None and runner.runs_eager(plan):
        _finish(runner, pending, results)
        pending = None
    t0 = time.monotonic()
    gpu_begin = trace.gpu_mark() if trace is not None else None
    started = runner.start(plan, pending)
    t1 = time.monotonic()
    _finish(runner, pending, results)
    t2 = time.monotonic()
    pending = runner.sample(started)
    if trace is not None:
        trace.step(plan, t0, t1, t2, gpu_begin)
    return pending


def _memory_report(runner, rank: int) -> None:
    """PAGEDSERVE_MEMORY_REPORT=FILE (GPU): this rank's profiled peak (weights + the worst
    step) plus its KV cache, against the real peak since the profile, as JSON in FILE.rank."""
    path = runner.config.settings.memory_report
    if not path or runner.device.type != "cuda" or runner.profiled_peak is None:
        return
    import json

    import torch

    # layers of one KV slot share a tensor; linear-attention layers have none
    shared = {id(c): c for c in runner.kv_caches if c is not None}
    kv = sum(c.numel() * c.element_size() for c in shared.values())
    report = {"profiled_peak": runner.profiled_peak, "kv_cache": kv,
              "predicted_peak": runner.profiled_peak + kv,
              "real_peak": torch.cuda.max_memory_allocated(runner.device),
              "total": torch.cuda.mem_get_info(runner.device)[1]}  # fmt: skip
    with open(f"{path}.{rank}", "w") as f:
        json.dump(report, f)


class PhaseClock:
    """Seconds per start-up step, in order: `mark(name)` closes the step that just ended."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = now - self._last
        self._last = now


def _open_trace(config: EngineConfig, rank: int) -> StepTrace | None:
    """PAGEDSERVE_STEP_TRACE=FILE (see core/engine_core.py): this rank's times per step."""
    path = config.settings.step_trace
    return StepTrace(f"{path}.worker{rank}") if path else None


class StepTrace:
    """One line per step run ahead of its predecessor's result (a CUDA worker's loop), written
    when the step before has finished: `start` (monotonic s), host seconds in start(), in
    finish() of the step before and in sample(); then for the step before, its requests and
    tokens, the GPU's idle ms before it (its first kernel waited for the host) and its GPU ms
    (first kernel to the copy of its sampled ids), from CUDA events around each step's work."""

    def __init__(self, path: str) -> None:
        import torch

        self._torch = torch
        self._file = open(path, "w", buffering=1)  # noqa: SIM115
        self._steps: list = []  # (plan, begin event, end event) of the last steps, up to three

    def gpu_mark(self):
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step(self, plan: StepPlan, t0: float, t1: float, t2: float, gpu_begin) -> None:
        host = f"{t0:.6f} {t1 - t0:.6f} {t2 - t1:.6f} {time.monotonic() - t2:.6f}"
        self._steps.append((plan, gpu_begin, self.gpu_mark()))
        gpu = ""
        if len(self._steps) == 3:  # the middle one has finished, so have its neighbours' ends
            (_, _, before_end), (done, begin, end), _ = self._steps
            end.synchronize()
            gap, busy = before_end.elapsed_time(begin), begin.elapsed_time(end)
            tokens = sum(done.num_scheduled_tokens)
            gpu = f" {len(done.scheduled_ids)} {tokens} {gap:.3f} {busy:.3f}"
            self._steps.pop(0)
        self._file.write(host + gpu + "\n")

    def close(self) -> None:
        self._file.close()


def _say_tier(costs: dict[str, float]) -> None:
    print(
        f"pagedserve: host KV tier: {costs['d2h_bytes_per_s'] / 1e9:.2f} GB/s out, "
        f"{costs['h2d_bytes_per_s'] / 1e9:.2f} GB/s in (a plain torch copy: "
        f"{costs['plain_d2h_bytes_per_s'] / 1e9:.2f} out, "
        f"{costs['plain_h2d_bytes_per_s'] / 1e9:.2f} in), "
        f"{costs['swap_s_per_block'] * 1e6:.1f} us/block; recompute "
        f"{costs['recompute_s_per_token'] * 1e6:.2f} us/token",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _report_grammars(runner, rank: int, results: StepSender) -> None:
    for key, error in runner.grammars.poll():
        results.send(GrammarCompiled(rank, key, error))


def _next_message(plans: StepReceiver, runner, pending):
    """The next message; while a step is on the device, poll for the next plan only until that
    step is done (then None: report it, the core may be waiting for it to plan more). While a
    grammar compiles or an adapter loads, wait briefly (then None: report it when done)."""
    if pending is None:
        loading = runner.lora is not None and runner.lora.loading
        return plans.get(timeout=GRAMMAR_POLL_S if runner.grammars.pending or loading else 1.0)
    while True:
        msg = plans.get(timeout=0.0)
        if msg is not None or runner.is_done(pending):
            return msg
        time.sleep(POLL_S)


def _finish(runner, pending, results: StepSender) -> None:
    if pending is not None:
        result = runner.finish(pending)
        if result is not None:
            results.send(result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedserve-worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--plans", required=True, help="address of the core's plan broadcast")
    ap.add_argument("--results", required=True, help="address of the core's result socket")
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--parent-pid", type=int)
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: exit_now(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when workers stop
    try:
        addresses = CoreAddresses(args.plans, args.results)
        config = EngineConfig.from_json(args.config)
        settings.activate(config.settings)
        serve(config, args.rank, addresses, args.dist_port)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown. A worker has nothing left to save once it
    stops (its results went out, the core is shutting down or gave up on it), and the teardown
    is where the noise comes from: SIGTERM's SystemExit raised inside a finalizer (`Exception
    ignored in ... SystemExit: 0`), and extension modules reporting objects still alive at exit
    (`nanobind: leaked N instances` from triton: GPU kernels import it, and so does torch._dynamo,
    which transformers loads when the GGUF loader builds its meta model)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
