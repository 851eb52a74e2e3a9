"""Per-layer paged attention time, Triton against FlashAttention 4, for prefill, decode and mixed
steps at Llama-3-8B heads (32/8, head dim 128, bf16) on one GPU.

Run: `python -m pagedserve.benchmarks.kernels.bench_attention [--json PATH] [--write-choice PATH]`.
Each case checks both backends against the torch reference, then times them (median GPU time of a
CUDA-graph replay, as the runner's graphs run them; eager when a backend does not capture). FA4 runs
at our default block size 16 (its cp.async page gather) and at 128 (a page per key tile: TMA loads).
`--write-choice` writes `{gpu name: {step kind: faster backend at block size 16}}`, the format of
kernels/attention/attention_choice.json that `--attention-backend auto` reads. `--cascade [--sweep]`
times the Triton kernel on W6 decode steps (256 / 512 rows behind a 2,048-token shared prefix) with
the cascade off and on (kernels/attention/cascade.py), and with `--sweep` over the prefix pass's
settings.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

import torch

from pagedserve.benchmarks.kernels.bench_kernels import HKV, HQ, D, random_batch, relative_error
from pagedserve.kernels.attention.reference import paged_attention_ref

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
    from pagedserve.kernels.attention.dispatch import per_step_kind
    from pagedserve.kernels.attention.flash import flash_paged_attention
    from pagedserve.kernels.attention.triton import triton_paged_attention

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


# W6 decode steps: rows sharing a 2,048-token prefix (128 blocks of 16), each with its own tokens.
CASCADE_CASES = [
    (32, 128),
    (64, 128),
    (256, 128),
    (256, 256),
    (512, 128),
    (512, 256),
]  # (rows, own)
PREFIX_TOKENS = 2048


def run_cascade(rows: int, own: int, sweep: bool) -> dict[str, float]:
    """The Triton kernel on one W6 decode step with the cascade off and on (ms per layer, graph
    replay), with `sweep` also over the prefix pass's key splits and tile height."""
    from pagedserve.kernels.attention.triton import triton_paged_attention

    computed = [PREFIX_TOKENS + own - 1 - (i % 16) for i in range(rows)]
    blocks = PREFIX_TOKENS // 16
    q, kv, meta = random_batch(
        computed, [1] * rows, HQ, HKV, D, 16, torch.bfloat16, "cuda", 0, blocks
    )
    scale = D**-0.5
    ref = paged_attention_ref(q, kv, meta, scale)
    plain = {"off": {}}
    configs = dict(plain, on={})
    if sweep:
        configs.update(
            {f"on_s{s}_m{m}": {"prefix_splits": s, "prefix_block_m": m}
             for s in (1, 2, 4, 8) for m in (64, 128)}
        )  # fmt: skip
    cascade_meta = replace(meta, scratch={}, cascade_len=PREFIX_TOKENS)
    cascade_meta.cascade_len_dev = torch.tensor([PREFIX_TOKENS], dtype=torch.int32, device=q.device)
    result = {}
    for name, kw in configs.items():
        m = meta if name == "off" else cascade_meta
        fn = lambda m=m, kw=kw: triton_paged_attention(q, kv, m, scale, **kw)  # noqa: E731
        result[f"{name}_err"] = relative_error(fn(), ref)
        result[f"{name}_ms"] = _time(fn)
    return result


def cascade_main(json_path: str | None, sweep: bool) -> None:
    print(f"{'rows':>5} {'own':>5} {'off us':>8} {'on us':>8} {'speedup':>8}  best sweep")
    rows_out = []
    for rows, own in CASCADE_CASES:
        r = run_cascade(rows, own, sweep)
        rows_out.append({"rows": rows, "own": own, **r})
        errs = max(v for k, v in r.items() if k.endswith("_err"))
        best = min((k for k in r if k.endswith("_ms")), key=r.get)
        print(
            f"{rows:>5} {own:>5} {1e3 * r['off_ms']:>8.1f} {1e3 * r['on_ms']:>8.1f} "
            f"{r['off_ms'] / r['on_ms']:>8.2f}  {best[:-3]} {1e3 * r[best]:.1f} us"
            + ("  !! error" if errs > 1e-2 else "")
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every row here")
    p.add_argument("--write-choice", help="write the per-step-kind choice here")
    p.add_argument("--cascade", action="store_true", help="W6 decode steps, cascade off vs on")
    p.add_argument("--sweep", action="store_true", help="with --cascade: prefix-pass configs")
    args = p.parse_args()
    if args.cascade:
        return cascade_main(args.json, args.sweep)
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
