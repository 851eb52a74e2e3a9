"""Per-layer paged attention time, Triton against FlashAttention 4, for prefill, decode and mixed
steps at Llama-3-8B heads (32/8, head dim 128, bf16) on one GPU.

Run: `python -m pagedserve.kernels.bench_attention [--json PATH] [--write-choice PATH]`. Each case
checks both backends against the torch reference, then times them (median GPU time of a CUDA-graph
replay, as the runner's graphs run them; eager when a backend does not capture). FA4 runs at our
default block size 16 (its cp.async page gather) and at 128 (a page per key tile: TMA loads).
`--write-choice` writes `{gpu name: {step kind: faster backend at block size 16}}`, the format of
kernels/attention_choice.json that `--attention-backend auto` reads.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from pagedserve.kernels.attention import paged_attention_ref
from pagedserve.kernels.bench_kernels import HKV, HQ, D, random_batch, relative_error

# (kind, name, cached tokens per row, new tokens per row); W5 = 16k prompts, W6 = 2k shared prefix.
CASES = [
    ("prefill", "8 x 1024 prompts (W1)", [0] * 8, [1024] * 8),
    ("prefill", "1 x 8192 chunk at 8k (W5)", [8192], [8192]),
    ("prefill", "64 x 128 after 2k prefix (W6)", [2048] * 64, [128] * 64),
    ("decode", "1 x ctx 4096", [4095], [1]),
    ("decode", "64 x ctx 2048", [2047] * 64, [1] * 64),
    ("decode", "256 x ctx 2300 (W6)", [2299] * 256, [1] * 256),
    ("decode", "24 x ctx 16k (W5)", [16383] * 24, [1] * 24),
    ("mixed", "62 dec + 2 x 512", [2048] * 62 + [0, 0], [1] * 62 + [512, 512]),
    ("mixed", "23 dec@16k + 8192 chunk (W5)", [16400] * 23 + [0], [1] * 23 + [8192]),
    ("mixed", "200 dec + 40 x 128 (W6)", [2200] * 200 + [2048] * 40, [1] * 200 + [128] * 40),
]


def _time(fn: Callable[[], object]) -> float:
    """Median ms of a graph replay, or of eager calls when `fn` does not capture."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, return_mode="median")
    except Exception:  # noqa: BLE001 - a backend that does not capture is timed eagerly
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")


def run_case(
    computed: list[int], new: list[int], block_size: int, split: bool = True
) -> dict[str, float]:
    """Error and time of each backend on one batch; a mixed batch also as the runner runs an
    eager mixed step (`*_split`: decode rows and prompt rows as two calls)."""
    from pagedserve.kernels.attention_dispatch import per_step_kind
    from pagedserve.kernels.flash_attention import flash_paged_attention
    from pagedserve.kernels.triton_attention import triton_paged_attention

    q, kv, meta = random_batch(computed, new, HQ, HKV, D, block_size, torch.bfloat16, "cuda")
    scale = D**-0.5
    ref = paged_attention_ref(q, kv, meta, scale)
    result = {}
    fns = [("triton", triton_paged_attention), ("flash", flash_paged_attention)]
    if split and 1 in new and max(new) > 1:
        kinds = ("prefill", "decode", "mixed")
        fns += [(f"{name}_split", per_step_kind(dict.fromkeys(kinds, fn), 1)) for name, fn in fns]
    for name, fn in fns:
        try:
            result[f"{name}_err"] = relative_error(fn(q, kv, meta, scale), ref)
            result[f"{name}_ms"] = _time(lambda fn=fn: fn(q, kv, meta, scale))
        except Exception as e:  # noqa: BLE001 - report the failure, keep measuring
            print(f"  !! {name} failed at block size {block_size}: {type(e).__name__}: {e}")
            result[f"{name}_err"], result[f"{name}_ms"] = float("inf"), float("inf")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every row here")
    p.add_argument("--write-choice", help="write the per-step-kind choice here")
    args = p.parse_args()
    rows, totals = [], {}
    print(f"{'kind':<8} {'case':<32} {'triton ms':>9} {'fa4 ms':>8} {'fa4@128':>8} {'max err':>8}")
    for kind, name, computed, new in CASES:
        row = {"kind": kind, "case": name, **run_case(computed, new, 16)}
        row["flash128_ms"] = run_case(computed, new, 128, split=False)["flash_ms"]
        rows.append(row)
        for backend in ("triton", "flash"):
            totals[(kind, backend)] = totals.get((kind, backend), 0.0) + row[f"{backend}_ms"]
        err = max(v for k, v in row.items() if k.endswith("_err"))
        split = ""
        if "triton_split_ms" in row:
            split = f"  split: triton {row['triton_split_ms']:.4f} fa4 {row['flash_split_ms']:.4f}"
        print(
            f"{kind:<8} {name:<32} {row['triton_ms']:>9.4f} {row['flash_ms']:>8.4f} "
            f"{row['flash128_ms']:>8.4f} {err:>8.1e}" + ("  !! error" if err > 1e-2 else "") + split
        )
    choice = {
        kind: min(("triton", "flash"), key=lambda b, kind=kind: totals[(kind, b)])
        for kind in ("prefill", "decode", "mixed")
    }
    print("faster per step kind (block size 16):", choice)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "choice": choice}, f)
    if args.write_choice:
        with open(args.write_choice, "w") as f:
            json.dump({torch.cuda.get_device_name(): choice}, f, indent=1)


if __name__ == "__main__":
    main()
