"""Time FP8 GEMMs at Llama-3-8B shapes on a GPU, and sweep the block GEMM's launch configs.

`python -m pagedserve.kernels.bench_fp8` prints, per (M, N, K), the median time of the bf16
matmul, `fp8_linear` per channel (activation quantization + `torch._scaled_mm`) and per 128-block
(quantization + our Triton GEMM), with the weight-streaming bandwidth and TFLOP/s.
`--sweep` times every candidate config of the block GEMM per shape and M bucket and prints
JSON in the form of `fp8_block_configs.json` (the fastest per bucket).
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from pagedserve.kernels import fp8
from pagedserve.kernels.triton_fp8 import triton_quantize_rows, triton_w8a8_block_matmul

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
BUCKETS = {16: [1, 16], 64: [64], 256: [256], 1_000_000_000: [2048, 8192]}


def _bench(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, return_mode="median")


def compare() -> None:
    print(f"{'M':>5} {'N':>6} {'K':>6} {'bf16 us':>9} {'fp8 ch us':>10} {'fp8 blk us':>11} "
          f"{'ch GB/s':>8} {'ch TFLOP/s':>11}")  # fmt: skip
    for (n, k), m in itertools.product(SHAPES, (1, 64, 256, 8192)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wc, sc = fp8.quantize_rows(w)
        wb, sb = fp8.quantize_rows(w, 128)
        t_bf16 = _bench(lambda x=x, w=w: x @ w.t())
        t_ch = _bench(lambda x=x, wc=wc, sc=sc: fp8.fp8_linear(x, wc, sc))
        t_blk = _bench(lambda x=x, wb=wb, sb=sb: fp8.fp8_linear(x, wb, sb, None, 128))
        print(f"{m:>5} {n:>6} {k:>6} {t_bf16 * 1e3:>9.1f} {t_ch * 1e3:>10.1f} "
              f"{t_blk * 1e3:>11.1f} {n * k / t_ch / 1e6:>8.0f} "
              f"{2 * m * n * k / t_ch / 1e9:>11.0f}")  # fmt: skip


def candidates(max_m: int) -> list[dict[str, int]]:
    block_ms = [16] if max_m <= 16 else [32, 64] if max_m <= 64 else [64, 128]
    return [
        dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=1 if max_m <= 16 else 8, num_warps=w, num_stages=s)
        for bm, bn, w, s in itertools.product(block_ms, (64, 128), (4, 8), (3, 4))
    ]


def sweep() -> None:
    table = {}
    for n, k in SHAPES:
        entries = []
        for max_m, ms in BUCKETS.items():
            best = None
            for cfg in candidates(max_m):
                total = 0.0
                for m in ms:
                    a, a_s = triton_quantize_rows(torch.randn(m, k, device="cuda"), 128)
                    b, b_s = fp8.quantize_rows(torch.randn(n, k, device="cuda"), 128)
                    total += _bench(
                        lambda a=a, a_s=a_s, b=b, b_s=b_s, cfg=cfg: triton_w8a8_block_matmul(
                            a, a_s, b, b_s, 128, torch.bfloat16, config=dict(cfg)
                        )
                    )
                if best is None or total < best[0]:
                    best = (total, cfg)
            print(f"N={n} K={k} M<={max_m}: {best[1]} {best[0] * 1e3:.1f} us", file=sys.stderr)
            entries.append([max_m, best[1]])
        table[f"{n},{k}"] = entries
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    torch.manual_seed(0)
    sweep() if "--sweep" in sys.argv[1:] else compare()
