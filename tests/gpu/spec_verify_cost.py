"""What verifying k drafts a row costs against a plain decode step: the model runner alone (no
processes, no ipc), as profile_step.py measures decode.

    python -m pagedserve.tests.gpu.spec_verify_cost MODEL_DIR [--batch 1 64] [--k 1 2 3 4 5]

Each row verifies k random drafts (the ngram path: `StepPlan.draft_token_ids`), so a step runs
k + 1 query tokens a row through the target (mixed CUDA graphs where the step fits one) and
samples every position. Random drafts are almost always rejected, so a step adds about one
token a row, as a decode does, and the context stays near `--ctx`. Printed: ms per step
(synchronous `execute`, the median of `--steps`) and its ratio to k = 0 (a plain decode step, on
decode CUDA graphs). With dummy weights acceptance means nothing; a real draft whose mean
acceptance length is L (tokens per step, the bonus token included) speeds decode up by at most
L / ratio. `--device cpu` runs it on a tiny model (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve.frontend.llm import build_engine_config
from pagedserve.ipc.messages import CachedDelta, NewRequest, SamplingParams, StepPlan
from pagedserve.parallel.groups import rank_info
from pagedserve.worker.model_runner import ModelRunner

# wall time; `--clock process` on a CPU: this process's CPU time (all its threads), which a
# loaded machine's other work inflates far less than the wall time (run with OMP_NUM_THREADS=1)
CLOCK = [time.perf_counter]


class Rows:
    """`batch` requests of a `ctx`-token prompt in the runner's batch, and plans for them."""

    def __init__(self, runner: ModelRunner, batch: int, ctx: int, room: int) -> None:
        self.runner, self.ids, self.step = runner, [f"r{i}" for i in range(batch)], 0
        self.top = min(1000, runner.config.model.vocab_size)  # token ids drawn below this
        per = -(-(ctx + room) // runner.block_size)
        news = [
            NewRequest(r, [3 + (j * 7 + i) % (self.top - 3) for j in range(ctx)],
                       list(range(i * per, (i + 1) * per)),
                       SamplingParams(temperature=0, max_tokens=room), 0)
            for i, r in enumerate(self.ids)
        ]  # fmt: skip
        self._run(StepPlan(self._next(), self.ids, [ctx] * batch, new_requests=news))

    def _next(self) -> int:
        self.step += 1
        return self.step

    def _run(self, plan: StepPlan) -> float:
        if plan.scheduled_ids and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = CLOCK[0]()
        self.runner.execute(plan)
        return CLOCK[0]() - t0

    def verify_step(self, k: int, gen: torch.Generator) -> float:
        """One step of every row verifying `k` random drafts (k = 0: a decode); seconds."""
        batch = self.runner.batch
        cached, drafts = [], {}
        for r in self.ids:
            num_tokens = int(batch.num_tokens[batch.requests[r].row])
            cached.append(CachedDelta(r, [], [], num_tokens - 1))
            if k:
                drafts[r] = torch.randint(3, self.top, (k,), generator=gen).tolist()
        n = [k + 1] * len(self.ids)
        plan = StepPlan(self._next(), self.ids, n, cached=cached, draft_token_ids=drafts)
        return self._run(plan)

    def close(self) -> None:
        self._run(StepPlan(self._next(), [], [], finished_ids=self.ids))


def sweep(runner: ModelRunner, batch: int, ks: list[int], ctx: int, steps: int,
          rounds: int = 1) -> list[dict]:  # fmt: skip
    """ms per step for k = 0 and each of `ks`; `rounds` > 1 interleaves them (each round runs
    `steps` steps of every k in turn), so a machine's changing load falls on every k alike."""
    gen = torch.Generator().manual_seed(0)
    room = rounds * (len(ks) + 1) * (steps + 3) * (max(ks) + 1) + 8
    rows = Rows(runner, batch, ctx, room=room)
    times: dict[int, list[float]] = {k: [] for k in [0, *ks]}
    for _ in range(rounds):
        for k in times:
            for _ in range(3):  # warm-up
                rows.verify_step(k, gen)
            times[k] += [rows.verify_step(k, gen) for _ in range(steps)]
    out, base = [], 1000 * statistics.median(times[0])
    for k, ts in times.items():
        ms = 1000 * statistics.median(ts)
        out.append({"batch": batch, "k": k, "ms_per_step": ms, "ratio_to_decode": ms / base})
        print(f"batch {batch:>3} k {k}: {ms:8.3f} ms/step  x{ms / base:.2f} of a decode step")
    rows.close()
    return out


def wait_compiled(runner: ModelRunner, timeout: float = 600) -> None:
    """On a CPU: until the compiled forward is built (worker/cpu_compile.py), as serving is."""
    end = time.monotonic() + timeout
    while runner.cpu_compiler is not None and runner.cpu_compiler.forward() is None:
        if time.monotonic() > end:
            raise TimeoutError("the compiled CPU forward was not ready in time")
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the k values")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    extra = dict(gpu_memory_utilization=0.85) if args.device == "cuda" else {}
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    config = build_engine_config(
        args.model, load_format=args.load_format, dtype=dtype, device=args.device,
        max_num_seqs=max(args.batch), **extra,
    )  # fmt: skip
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    runner = ModelRunner(config, device, rank_info(config.parallel, 0))
    runner.init_cache(runner.profile_num_blocks())
    wait_compiled(runner)
    CLOCK[0] = time.process_time if args.clock == "process" else time.perf_counter
    results = [r for b in args.batch
               for r in sweep(runner, b, args.k, args.ctx, args.steps, args.rounds)]  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{'batch':>6} {'k':>3} {'ms/step':>9} {'x decode':>9}")
    for r in results:
        print(f"{r['batch']:>6} {r['k']:>3} {r['ms_per_step']:>9.3f} {r['ratio_to_decode']:>9.2f}")


if __name__ == "__main__":
    main()
