"""`method: draft_model` on a GPU: greedy outputs with the draft on equal off, and what a step
costs with a draft of one layer (the target's shape cut to `--draft-layers`), dummy weights.

    python -m pagedserve.tests.gpu.spec_draft_smoke MODEL_DIR [--draft-layers 1] [--k 3]

The draft directory is the target's config.json and tokenizer with fewer layers (dummy weights
load for both, from the same seed, so the draft's layers equal the target's first ones). With
random weights acceptance is whatever it is; the check is that greedy rows give the same tokens
on and off (on the GPU's kernels, CUDA graphs for the target), and the timing shows what the
draft's eager forwards cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from pagedserve import LLM, SamplingParams


def draft_dir(model: str, num_layers: int) -> str:
    path = os.path.join(tempfile.gettempdir(), f"draft-{num_layers}layer")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(model, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def run(model: str, spec: dict | None, prompts: list[list[int]], out_len: int, **kw) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    with LLM(model, load_format="dummy", speculative_config=spec, **kw) as llm:
        batch = [{"prompt_token_ids": p} for p in prompts]
        tokens = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
        llm.generate(batch[:1], greedy)  # warm-up at batch 1
        t0 = time.perf_counter()
        llm.generate(batch[:1], greedy)
        ms = 1000 * (time.perf_counter() - t0) / out_len
        stats = llm.last_stats
    accepted, drafted = stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens
    return {"tokens": tokens, "ms_per_token_b1": ms, "accepted": accepted, "drafted": drafted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--method", choices=["draft_model", "ngram"], default="draft_model",
                    help="ngram: the same check without a draft model (is a difference the "
                    "draft's, or the verification kernels' numerics?)")  # fmt: skip
    args = ap.parse_args()
    kw = {"dtype": args.dtype, "enforce_eager": args.enforce_eager}
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = min(5000, json.load(f)["vocab_size"])
    prompts = [[3 + (i * 31 + j * 17) % (vocab - 3) for j in range(100 + 20 * i)] for i in range(4)]
    spec = {"method": "draft_model", "model": draft_dir(args.model, args.draft_layers),
            "num_speculative_tokens": args.k}  # fmt: skip
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}  # fmt: skip
    off = run(args.model, None, prompts, args.output_len, **kw)
    on = run(args.model, spec, prompts, args.output_len, **kw)
    same = off["tokens"] == on["tokens"]
    b1 = f"off {off['ms_per_token_b1']:.2f} ms/token, on {on['ms_per_token_b1']:.2f} ms/token"
    for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"], strict=True)):
        if a != b:
            pos = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            print(f"prompt {i} differs first at output token {pos}")
    print(f"{args.method} ({args.draft_layers} layer(s), k={args.k}): greedy same tokens: {same}; "
          f"accepted {on['accepted']} of {on['drafted']} drafts; batch 1: {b1}")  # fmt: skip


if __name__ == "__main__":
    main()
