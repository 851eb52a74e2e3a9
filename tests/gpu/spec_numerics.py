"""Greedy output with speculation on against off: where each request first differs, and whether
that is numerics (a near tie that the verification step and the plain decode step round apart)
or a bug (a wrong position, stale KV, a rejected draft's KV read).

    python -m pagedserve.tests.gpu.spec_numerics [--arch smollm2|tiny|DIR] [--dtype ...]

The model is SmolLM2-135M's shape (`--arch smollm2`, 30 layers of 576, vocab 49152) or a tiny
Llama, as a config.json with dummy weights (nothing to carry to a GPU), or any HF directory.
Prompts are a random 32-token phrase said four times, so ngram drafts often. Both arms run each
prompt alone (batch 1, as `bench spec` does) with greedy sampling and top-2 logprobs. Per prompt:
- `first`: the first output position where the arms differ (None: the same tokens);
- `margin_off`, `margin_on`: there, the top-1 minus top-2 logprob in each arm (= the logit
  margin: both share one normalizer);
- `noise`: the largest |difference| between the arms of the chosen token's logprob at the
  positions before `first` (same context in both arms: what the two paths' numerics differ by).
A flip at a margin at or below `noise` is rounding; a bug shows as `noise` far above it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.args import parse_size

ARCHS = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, rope_theta=10000.0,
                 tie_word_embeddings=False),
}  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def model_dir(arch: str) -> tuple[str, str]:
    """(directory, load format): an HF directory as is, or a config of `arch` (dummy weights)."""
    if arch not in ARCHS:
        return arch, "auto"
    path = os.path.join(tempfile.gettempdir(), f"spec-numerics-{arch}")
    os.makedirs(path, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  max_position_embeddings=4096, hidden_act="silu", torch_dtype="float32",
                  bos_token_id=1, eos_token_id=2, **ARCHS[arch])  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path, "dummy"


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(32)] * 4 for _ in range(n)]


def generate(model: str, spec: dict | None, batch: list[list[int]], out_len: int, **kw) -> dict:
    """Each prompt alone: its tokens and per position (chosen logprob, top-1 - top-2 margin)."""
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, logprobs=2)
    runs = []
    with LLM(model, speculative_config=spec, skip_tokenizer_init=True, **kw) as llm:
        for p in batch:
            out = llm.generate([{"prompt_token_ids": p}], greedy)[0].outputs[0]
            chosen, margin = [], []
            for token, lps in zip(out.token_ids, out.logprobs, strict=True):
                top = sorted(v.logprob for v in lps.values())[::-1]
                chosen.append(lps[token].logprob)
                margin.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            runs.append({"tokens": list(out.token_ids), "chosen": chosen, "margin": margin})
        stats = llm.last_stats
    counts = (stats.spec_num_drafts, stats.spec_num_accepted_tokens) if spec and stats else (0, 0)
    return {"runs": runs, "verifications": counts[0], "accepted": counts[1]}


def compare(off: dict, on: dict) -> list[dict]:
    rows = []
    for a, b in zip(off["runs"], on["runs"], strict=True):
        pairs = list(zip(a["tokens"], b["tokens"], strict=True))
        first = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
        upto = len(pairs) if first is None else first
        noise = max((abs(a["chosen"][j] - b["chosen"][j]) for j in range(upto)), default=0.0)
        row = {"first": first, "noise": noise, "min_margin_off": min(a["margin"][:upto])}
        if first is not None:
            row.update(margin_off=a["margin"][first], margin_on=b["margin"][first],
                       token_off=pairs[first][0], token_on=pairs[first][1])  # fmt: skip
        rows.append(row)
    return rows


def run(arch: str, dtype: str, n: int, out_len: int, spec: dict, **kw) -> list[dict]:
    path, load_format = model_dir(arch)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    batch = prompts(min(vocab, 5000), n)
    kw = dict(dtype=dtype, load_format=load_format, max_model_len=1024, max_num_seqs=4, **kw)
    off = generate(path, None, batch, out_len, **kw)
    on = generate(path, spec, batch, out_len, **kw)
    print(
        f"{dtype}: {on['verifications']} verification steps, {on['accepted']} drafts accepted, "
        f"{len(batch) * out_len} tokens an arm"
    )
    return compare(off, on)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="smollm2", help="smollm2, tiny or an HF directory")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache-memory", type=parse_size, default=None)
    ap.add_argument("--label", default="", help="a tag for the printed lines (e.g. the tree)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    spec = {**NGRAM, "num_speculative_tokens": args.k}
    kw = {"enforce_eager": args.enforce_eager}
    kw.update({k: v for k, v in (("device", args.device), ("kv_cache_memory",
              args.kv_cache_memory)) if v is not None})  # fmt: skip
    results = {}
    for dtype in args.dtype:
        rows = run(args.arch, dtype, args.num_prompts, args.output_len, spec, **kw)
        results[dtype] = rows
        for i, r in enumerate(rows):
            where = "same tokens"
            if r["first"] is not None:
                where = (
                    f"first differs at {r['first']}: off {r['token_off']} (margin "
                    f"{r['margin_off']:.3g}), on {r['token_on']} (margin {r['margin_on']:.3g})"
                )
            print(
                f"{args.label} {args.arch} {dtype} prompt {i}: {where}; noise before "
                f"{r['noise']:.3g}; smallest margin before {r['min_margin_off']:.3g}"
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"label": args.label, "arch": args.arch, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
