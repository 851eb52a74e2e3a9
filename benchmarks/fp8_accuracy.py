"""How much FP8 changes a model's predictions: teacher-forced top-1 agreement and mean KL.

`python -m pagedserve.benchmarks.fp8_accuracy [--model DIR] [--windows N]` runs the model
(default: the embedded one) over held-out text (default: the standard library's `json/*.py`,
which the embedded model never trained on) in windows of `--context` tokens, once in full
precision (float32 weights and cache) and once per variant: bf16 (for scale), FP8 weights
(`--quantization fp8`: per-channel weights, per-token activations), an FP8 KV cache, and both.
Each window is one prefill through the paged cache, so the FP8 cache is written and read back
exactly as in serving. Per variant it prints the share of positions whose argmax equals the
full-precision one and the mean KL(full || variant) in nats.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from pagedserve.config import ModelConfig
from pagedserve.kernels.attention.metadata import build_attention_metadata
from pagedserve.worker.models import build_model

VARIANTS = {  # name: (model dtype, --quantization, FP8 cache)
    "bf16": (torch.bfloat16, None, False),
    "fp8 weights": (torch.float32, "fp8", False),
    "fp8 KV cache": (torch.float32, None, True),
    "fp8 weights + KV": (torch.float32, "fp8", True),
}
BLOCK = 16


def held_out_windows(model_dir: str, context: int, num_windows: int) -> list[list[int]]:
    """Consecutive `context`-token windows of the stdlib's json package, tokenized."""
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    text = "".join(p.read_text() for p in sorted((Path(os.__file__).parent / "json").glob("*.py")))
    ids = tokenizer.encode(text).ids
    return [ids[i : i + context] for i in range(0, num_windows * context, context)]


def window_logits(model: torch.nn.Module, tokens: list[int], kv_dtype: torch.dtype):
    """Teacher-forced logits [T, V] (float32) of one prefill through a fresh paged cache."""
    blocks = -(-len(tokens) // BLOCK)
    meta, positions = build_attention_metadata([0], [len(tokens)], [list(range(blocks))], BLOCK)
    shape = (blocks, 2, BLOCK, model.num_kv_heads_per_rank, model.head_dim)
    caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(model.num_layers)]
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), positions, caches, meta)
        return model.compute_logits(hidden).float()


def all_logits(model_dir: str, windows: list[list[int]], variant: tuple | None) -> torch.Tensor:
    dtype, quantization, kv_fp8 = variant or (torch.float32, None, False)
    config = ModelConfig(model=model_dir, quantization=quantization)
    model = build_model(config, dtype, "cpu", kv_fp8=kv_fp8)
    kv_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    return torch.cat([window_logits(model, w, kv_dtype) for w in windows])  # [N, V]


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    ref_logp, got_logp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)  # [N]
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    return {"top1_agreement": agree.mean().item(), "mean_kl": kl.mean().item()}


def run(model_dir: str, context: int, num_windows: int) -> dict[str, dict[str, float]]:
    windows = held_out_windows(model_dir, context, num_windows)
    ref = all_logits(model_dir, windows, None)
    return {name: compare(ref, all_logits(model_dir, windows, v)) for name, v in VARIANTS.items()}


def main(argv: list[str] | None = None) -> int:
    from pagedserve.frontend.hub import default_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded model)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--windows", type=int, default=16)
    args = p.parse_args(argv)
    model_dir = args.model or default_model_dir()
    torch.manual_seed(0)
    results = run(model_dir, args.context, args.windows)
    print(f"{args.windows} windows x {args.context} tokens of held-out text, vs float32:")
    print(f"{'variant':<18} {'top-1 agreement':>16} {'mean KL (nats)':>15}")
    for name, r in results.items():
        print(f"{name:<18} {100 * r['top1_agreement']:>15.2f}% {r['mean_kl']:>15.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
