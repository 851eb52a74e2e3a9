"""Which `num_speculative_tokens` pays for ngram on a workload, without timing an engine per k:
replay a greedy output through the proposer and the core's speculation rules, and price its steps
with measured step costs (issue 38).

    python -m pagedserve.benchmarks.spec_replay --model DIR --workload code-edit \
        --num-prompts 4 --output-len 256 --k 2 4 6 8 10 [--step-cost verify-cost.json]

Greedy output is the same with speculation on and off, so one generation (speculation off, the
workload's prompts through the chat template, cached in `--tokens-json`) fixes what every k
would do: the core's scheduler plans each step (two plans in flight, speculating rows planned
ahead of their results, the per-row rules of `core/spec_decode/decoder.py`: misses, the
acceptance window, the back-off), the sampling worker's ngram drafts them from the tokens known,
and the accepted ones are the longest prefix that matches the output. Printed per k: the
steps, verifications, mean acceptance length, and with `--step-cost` (the JSON of
`tests/gpu/spec_verify_cost.py`: ms per step for k drafts a row, k = 0 a plain decode) the
predicted speedup over plain decoding: tokens x decode cost / the steps' summed cost. Loaded
machines change both arms of a timed A/B; the acceptance side of this is exact and load-free.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from pagedserve.benchmarks.spec_decode import workload
from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.spec_decode.ngram import NgramProposer
from pagedserve.ipc.messages import AddRequest, SamplingParams, StepResult
from pagedserve.speculative_config import SpeculativeConfig
from pagedserve.worker.sampler_drafts import SamplerDrafts


def generate(args: argparse.Namespace) -> list[dict]:
    """[{prompt, output}] token ids of each conversation, greedy, speculation off."""
    if args.tokens_json and os.path.isfile(args.tokens_json):
        with open(args.tokens_json) as f:
            return json.load(f)
    from pagedserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.output_len)
    convs = workload(args.workload, args.num_prompts, args.file_lines)
    kw = dict(device=args.device, dtype=args.dtype, max_model_len=4096)
    with LLM(args.model, **kw) as llm:
        outs = [llm.chat(c, greedy, use_tqdm=False)[0] for c in convs]
    runs = [{"prompt": o.prompt_token_ids, "output": o.outputs[0].token_ids} for o in outs]
    if args.tokens_json:
        with open(args.tokens_json, "w") as f:
            json.dump(runs, f)
    return runs


def replay(prompt: list[int], output: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Drafts verified per decode step (0: a plain step) when the engine generates `output`
    greedily for `prompt` at batch 1 with ngram: the core's own scheduler and speculation rules
    (core/spec_decode/decoder.py), two plans in flight as async scheduling keeps them, and the
    sampling worker's drafting (worker/sampler_drafts.py), with `output` standing for the model
    (a draft is accepted where it is the next token of `output`)."""
    spec = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
         "prompt_lookup_max": hi}
    )  # fmt: skip
    max_len = len(prompt) + len(output) + k + 1
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max(len(prompt), 2048)),
        CacheConfig(block_size=16, enable_prefix_caching=False),
        max_len, -(-max_len // 16) + 1, async_scheduling=True, workers_keep_samples=True,
        speculative=spec,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=len(output), ignore_eos=True)
    sched.add_request(AddRequest("r", list(prompt), sampling=params, eos_token_ids=[]))
    drafter = SamplerDrafts(lambda: NgramProposer(lo, hi))
    seq, steps, inflight = list(prompt), [], []
    while sched.has_unfinished_requests():
        while len(inflight) < 2 and (plan := sched.schedule()).scheduled_ids:
            inflight.append(plan)
        plan = inflight.pop(0)
        if plan.new_requests:  # the prompt's step gives the first token
            sampled, num_drafts = [output[0]], 0
        else:
            drafts = drafter.propose("r", np.array(seq), plan.num_sampler_drafts.get("r", 0))
            num_drafts, pos, sampled = len(drafts), len(seq) - len(prompt), []
            for d in drafts:  # accepted while each is the output's next token
                if pos + len(sampled) >= len(output) - 1 or d != output[pos + len(sampled)]:
                    break
                sampled.append(d)
            sampled.append(output[pos + len(sampled)])
            steps.append(num_drafts)
        seq += sampled
        result = StepResult(plan.step_id, [sampled])
        if plan.num_sampler_drafts:
            result.num_drafts = [num_drafts]
        sched.update_from_output(plan, result)
    return steps


def step_costs(path: str | None) -> dict[int, float] | None:
    if not path:
        return None
    with open(path) as f:
        rows = json.load(f)
    return {r["k"]: r["ms_per_step"] for r in rows if r["batch"] == min(x["batch"] for x in rows)}


def cost(costs: dict[int, float], drafts: int) -> float:
    """ms of a step verifying `drafts` drafts: measured, else linear between measured k."""
    if drafts in costs:
        return costs[drafts]
    ks = sorted(costs)
    lo = max((x for x in ks if x < drafts), default=ks[0])
    hi = min((x for x in ks if x > drafts), default=ks[-1])
    if lo == hi:
        return costs[lo]
    return costs[lo] + (costs[hi] - costs[lo]) * (drafts - lo) / (hi - lo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--workload", choices=["code-edit", "chat"], default="code-edit")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--file-lines", type=int, default=40)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6, 8, 10])
    ap.add_argument("--prompt-lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--step-cost", help="spec_verify_cost.py's JSON (ms per step by k)")
    ap.add_argument("--tokens-json", help="cache of the generated tokens (read if present)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    runs, costs = generate(args), step_costs(args.step_cost)
    tokens = sum(len(r["output"]) - 1 for r in runs)  # after the prompt's step
    print(f"{args.workload}: {len(runs)} requests, {tokens} tokens from decode steps")
    for k in args.k:
        steps = [s for r in runs for s in replay(r["prompt"], r["output"], k, *args.prompt_lookup)]
        verifs = [s for s in steps if s]
        spec_tokens = tokens - (len(steps) - len(verifs))
        line = (f"k {k:>2}: {len(steps)} steps, {len(verifs)} verifications, mean acceptance "
                f"length {spec_tokens / max(len(verifs), 1):.2f}")  # fmt: skip
        if costs:
            total = sum(cost(costs, s) for s in steps)
            line += f", predicted speedup {tokens * costs[0] / total:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
