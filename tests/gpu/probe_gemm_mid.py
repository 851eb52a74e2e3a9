"""Probe (issue 18, W1/W2 decode steps of 64-512 rows): does a Triton GEMM beat cuBLAS on
Llama-3-8B's layer shapes at mid-size M, the weights out of L2 as a decode step reads them?

    python tests/gpu/probe_gemm_mid.py [--m 64 128 256 512]

At M = 256 cuBLAS runs the four layer GEMMs at ~550 TFLOP/s (bench_fp8's bf16 column): neither
the weight read (~73 us a layer at 3 TB/s) nor the math (~74 us at 750 TFLOP/s) bounds it. Per
(M, shape): cuBLAS us, the best Triton launch config's us (the persistent TMA kernel of
probe_gemm_silu.py without its epilogue) and the ratio.
"""

from __future__ import annotations

import argparse

import torch
from probe_gemm_silu import persistent_gemm

from pagedserve.benchmarks.kernels.bench_gemv import SHAPES, _cold_weights, _per_weight_ms

CONFIGS = [
    dict(BM=bm, BN=bn, BK=bk, warps=w, stages=s, per_sm=p)
    for bm, bn, bk, w, s, p in [
        (64, 128, 64, 4, 4, 1), (64, 128, 128, 4, 3, 1), (64, 256, 64, 4, 4, 1),
        (64, 256, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
        (64, 128, 64, 4, 4, 2), (128, 128, 64, 4, 4, 1), (64, 64, 128, 4, 4, 2),
    ]
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{'M':>4} {'shape':<8} {'cuBLAS us':>9} {'Triton us':>9} {'ratio':>6}  best config")
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        ws = _cold_weights(n, k)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.matmul(x, ws[0].t())
            cublas = _per_weight_ms(lambda w, x=x: torch.matmul(x, w.t()), ws) * 1e3
            best = (float("inf"), None)
            for cfg in CONFIGS:
                if cfg["BM"] > max(64, m):
                    continue
                try:
                    out = persistent_gemm(x, ws[0], cfg, fused=False)
                    if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                        print(f"  {name} M={m} {cfg}: wrong result")
                        continue
                    us = _per_weight_ms(lambda w, x=x, c=cfg: persistent_gemm(x, w, c, False), ws)
                    best = min(best, (us * 1e3, cfg), key=lambda t: t[0])
                except Exception as exc:  # noqa: BLE001 - a config the GPU cannot hold
                    print(f"  {name} M={m} {cfg}: {type(exc).__name__}")
            ratio = cublas / best[0]
            print(f"{m:>4} {name:<8} {cublas:9.1f} {best[0]:9.1f} {ratio:6.2f}  {best[1]}")
        del ws


if __name__ == "__main__":
    main()
