"""One engine, three measurements of a hybrid model (dummy weights), for tests/gpu/hybrid_gpu.sh:
W3 (batch 1, 128-token prompt, 256 new tokens: ms per output token), one prefill step (a
1024-token prompt, one token out: the chunked delta rule's share of it comes from the
bench-rule step) and W1-shaped throughput (N prompts of 1024 tokens, 128 out), beside the
weight-read floor (the bytes a batch-1 decode step reads: every weight, for MoE only the routed
experts' share, over HBM bandwidth; bf16, or fp8 + block scales where the config has a
`quantization_config`).

  python tests/gpu/hybrid_bench.py MODEL_DIR --prompts 200 [--hbm-tbps 3.35] [--json out.json]
      [--max-num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PLAIN_PROJECTIONS = ("in_proj_ba", "in_proj_a", "in_proj_b")  # bf16 in FP8 checkpoints too


def param_bytes(name: str, param: torch.Tensor, fp8: bool) -> int:
    """A weight's bytes: bf16, or in a block-FP8 checkpoint 1 byte for the decoder's
    projections (routed and shared experts too) plus one float32 scale per 128 x 128 block."""
    parts = name.split(".")
    module = parts[-2] if parts[-1] == "weight" else parts[-1]
    if fp8 and "layers" in parts and "_proj" in module and module not in PLAIN_PROJECTIONS:
        return param.numel() + param.numel() // (128 * 128) * 4
    return 2 * param.numel()


def floor_bytes(model_dir: str) -> tuple[float, float]:
    """(all weights, weights a batch-1 decode reads) in bytes, from the config alone: bf16, or
    the checkpoint's block FP8."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    fp8 = getattr(config, "quantization_config", None) is not None
    if fp8:
        del config.quantization_config  # a meta model of the layout, no quantizer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = 0
    for name, p in model.named_parameters():
        size = param_bytes(name, p, fp8)
        total += size
        if ".experts." in name and "shared_expert" not in name:
            experts += size
    routed = getattr(config, "num_experts_per_tok", 0) / max(getattr(config, "num_experts", 1), 1)
    embed = 2 * config.vocab_size * config.hidden_size  # the input embedding: one row per token
    return total, total - experts + experts * routed - embed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--hbm-tbps", type=float, default=3.35)  # H100 SXM
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    from pagedserve import LLM, SamplingParams

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": torch.randint(3, 500, (length,), generator=gen).tolist()}
                for _ in range(n)]  # fmt: skip

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def timed(batch: list[dict], n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(batch, params(n), use_tqdm=False)
        return time.perf_counter() - t0

    out: dict = {"model": args.model, "device": torch.cuda.get_device_name() if
                 args.device == "cuda" else "cpu"}  # fmt: skip
    total, per_token = floor_bytes(args.model)
    out["weights_gb"], out["decode_read_gb"] = total / 1e9, per_token / 1e9
    out["floor_ms_per_token"] = per_token / (args.hbm_tbps * 1e12) * 1e3
    t0 = time.perf_counter()
    with LLM(args.model, device=args.device, dtype=dtype, load_format="dummy",
             max_model_len=4096, max_num_seqs=args.max_num_seqs) as llm:  # fmt: skip
        out["start_s"] = time.perf_counter() - t0
        print(f"started in {out['start_s']:.1f} s", flush=True)  # each result as it comes
        timed(prompts(1, 128), 16)  # warm-up
        w3 = [timed(prompts(1, 128), 256) for _ in range(3)]
        out["w3_ms_per_token"] = min(w3) / 256 * 1e3
        out["w3_over_floor"] = out["w3_ms_per_token"] / out["floor_ms_per_token"]
        print(f"W3 {out['w3_ms_per_token']:.2f} ms/token (floor "
              f"{out['floor_ms_per_token']:.2f})", flush=True)  # fmt: skip
        out["prefill_1024_ms"] = min(timed(prompts(1, 1024), 1) for _ in range(3)) * 1e3
        print(f"one 1024-token prefill {out['prefill_1024_ms']:.1f} ms", flush=True)
        seconds = timed(prompts(args.prompts, 1024), 128)
        out["w1_prompts"] = args.prompts
        out["w1_output_tok_s"] = args.prompts * 128 / seconds
        out["w1_total_tok_s"] = args.prompts * (1024 + 128) / seconds
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
