"""`pagedserve bench spec`: batch-1 decode speed with speculative decoding against without.

Two workloads of real text through the model's chat template, greedy:
- `code-edit`, as editors and agents use a model: the prompt holds a file (a slice of one of
  pagedserve's own modules, so the workload is the same wherever it runs) and asks for the whole
  file back with one small change, so most of the reply repeats the prompt;
- `chat`: open questions, whose answers repeat little.

Both engines (speculation off, and `--speculative-config`) are alive at once and the requests
alternate between them, one at a time: A/B back to back, so the load of a shared machine drifts
into both arms alike. Greedy outputs must be the same in both arms (reported). Tokens/s is each
arm's output tokens over its summed request times; the median of the per-request speedups is
the figure a burst of load on a shared machine moves least.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from pagedserve.benchmarks.common import add_engine_flags, engine_kwargs

_SOURCES = ["core/scheduler.py", "core/block_pool.py", "core/policy.py", "worker/sampler.py",
            "core/kv_cache_manager.py", "frontend/detokenizer.py"]  # fmt: skip
_EDITS = [
    "Add the comment `# reviewed` as the first line",
    "Rename every `req` to `request`",
    "Change the first docstring's first word to uppercase",
    "Add the line `import sys` after the last import",
]
CHAT = [
    "Why is the sky blue? Answer in a paragraph.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What should I consider when adopting a dog?",
    "Explain the difference between weather and climate.",
    "Suggest a weekend itinerary for a rainy city trip.",
]


def add_spec_parser(kinds: Any) -> argparse.ArgumentParser:
    p = kinds.add_parser("spec", help="speculative decoding against none, batch 1, A/B")
    add_engine_flags(p)
    p.add_argument("--speculative-config", required=True, help="JSON, as `launch` takes it")
    p.add_argument("--workload", choices=["code-edit", "chat"], nargs="+", default=["code-edit"],
                   help="one or several, measured on the same two engines")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--num-rounds", type=int, default=1, help="passes over the prompts")
    p.add_argument("--output-len", type=int, default=512, help="max_tokens of each request")
    p.add_argument("--file-lines", type=int, default=40, help="code-edit: lines of each file")
    return p


def workload(name: str, num_prompts: int, file_lines: int) -> list[list[dict[str, str]]]:
    """Chat conversations (one user turn each) of the workload."""
    if name == "chat":
        return [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(num_prompts)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for i in range(num_prompts):
        with open(os.path.join(root, _SOURCES[i % len(_SOURCES)])) as f:
            lines = f.read().splitlines()
        start = (i // len(_SOURCES)) * file_lines % max(1, len(lines) - file_lines)
        code = "\n".join(lines[start : start + file_lines])
        edit = _EDITS[i % len(_EDITS)]
        content = (
            f"Here is a Python file:\n```python\n{code}\n```\n{edit}. Reply with the complete "
            "updated file in one ```python block and nothing else."
        )
        out.append([{"role": "user", "content": content}])
    return out


def bench_spec(args: argparse.Namespace) -> dict[str, Any]:
    """One workload's result, or {workload: result} for several, measured on the same two engines
    (so a GPU run starts them once)."""
    from pagedserve import LLM, SamplingParams

    kw = engine_kwargs(args)
    names = args.workload if isinstance(args.workload, list) else [args.workload]
    with LLM(args.model, **kw) as off, LLM(args.model, speculative_config=args.speculative_config,
                                          **kw) as on:  # fmt: skip
        engines = {"off": off, "on": on}
        first = workload(names[0], 1, args.file_lines)[0]
        for llm in engines.values():  # warm-up: first-step costs out of the measurement
            llm.chat(first, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        results = {name: _measure(engines, name, args) for name in names}
    return results[names[0]] if len(names) == 1 else results


def _measure(engines: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Requests of workload `name` alternating between the arms; the counters are the `on`
    engine's for this workload alone (its cumulative stats minus those before)."""
    from pagedserve import SamplingParams

    conversations = workload(name, args.num_prompts, args.file_lines)
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    tokens, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    same, ratios = True, []  # per request: off seconds per token over on seconds per token
    before = engines["on"].last_stats
    for _ in range(args.num_rounds):
        for conv in conversations:
            outputs, took = {}, {}
            for arm, llm in engines.items():
                start = time.perf_counter()
                (out,) = llm.chat(conv, params, use_tqdm=False)
                took[arm] = time.perf_counter() - start
                seconds[arm] += took[arm]
                tokens[arm] += len(out.outputs[0].token_ids)
                outputs[arm] = out.outputs[0].token_ids
            ratios.append(took["off"] / len(outputs["off"]) / (took["on"] / len(outputs["on"])))
            same = same and outputs["off"] == outputs["on"]
            print(f"{name}: request {len(outputs['on'])} tokens; so far off {tokens['off']} in "
                  f"{seconds['off']:.1f} s, on {tokens['on']} in {seconds['on']:.1f} s",
                  flush=True)  # fmt: skip
    return _result(name, args, tokens, seconds, ratios, same, before, engines["on"].last_stats)


def _result(name: str, args: argparse.Namespace, tokens: dict[str, int],
            seconds: dict[str, float], ratios: list[float], same: bool, before: Any,
            stats: Any) -> dict[str, Any]:  # fmt: skip
    rate = {arm: tokens[arm] / seconds[arm] for arm in tokens}
    keys = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
    count = {key: getattr(stats, key) - (getattr(before, key) if before else 0) for key in keys}
    prev = list(before.spec_accepted_per_pos) if before else []  # shorter until a longer draft
    prev += [0] * (len(stats.spec_accepted_per_pos) - len(prev))
    per_pos = [a - b for a, b in zip(stats.spec_accepted_per_pos, prev, strict=True)]
    return {
        "workload": name, "speculative_config": args.speculative_config,
        "requests_per_arm": args.num_rounds * args.num_prompts,
        "output_tokens_per_arm": tokens["on"], "off_tokens_per_s": rate["off"],
        "on_tokens_per_s": rate["on"], "speedup": rate["on"] / rate["off"],
        "speedup_median_of_requests": float(statistics.median(ratios)),
        "speedup_per_request": [round(r, 3) for r in ratios], "same_outputs": same, **count,
        "mean_acceptance_length": 1 + count["spec_num_accepted_tokens"]
        / max(count["spec_num_drafts"], 1),
        "accepted_per_pos": per_pos,
    }  # fmt: skip
