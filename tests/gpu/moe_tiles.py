"""The grouped Triton MoE kernel's tiles at the gpt-oss-20b expert shape (32 experts of
2880 x 2880, top 4, biases, clamped SwiGLU, bf16), on a GPU:

    python3 tests/gpu/moe_tiles.py [--batch 1 2 4 8 64]

For each batch size, the grouped kernel (kernels/triton_moe.py) with each (BLOCK_N, BLOCK_K,
num_warps, num_stages) of `TILES` and, for a few tokens, the two GEMVs of
kernels/triton_moe_decode.py with each of `DECODE_TILES`: the whole expert layer's time in a
CUDA graph (triton.testing.do_bench_cudagraph, median) and the expert weights it reads per second
(the experts the batch touches, 3 x 2880 x 2880 bf16 each), with its relative error against the
torch reference.
"""

from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench_cudagraph

from pagedserve.benchmarks.kernels.bench_kernels import relative_error
from pagedserve.kernels.gpt_oss_moe import clamped_swiglu, gpt_oss_experts_ref, route
from pagedserve.kernels.triton_moe import DEFAULT_TILES, SMALL_M_TILES, triton_fused_moe
from pagedserve.kernels.triton_moe_decode import triton_moe_decode

E, H, I, K = 32, 2880, 2880, 4
TILES = [DEFAULT_TILES, SMALL_M_TILES]  # the grouped kernel's
DECODE_TILES = [(16, 256, 4, 3), (32, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (8, 512, 4, 2)]


def sweep(batch: int, gen: torch.Generator, w13, w2, bias) -> list[tuple]:
    x = torch.randn(batch, H, generator=gen).to("cuda", torch.bfloat16)
    weights, ids = route(torch.randn(batch, E, generator=gen).to("cuda"), K)
    ref = gpt_oss_experts_ref(x, w13, bias, w2, weights, ids, 1.702, 7.0)
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    touched = ids.unique().numel()
    rows = []
    grouped = functools.partial(triton_fused_moe, w13_bias=bias, activation=act)
    gemvs = functools.partial(triton_moe_decode, w13_bias=bias, clamp=(1.702, 7.0))
    variants = [("grouped", grouped, t) for t in TILES]
    if batch * K <= 16:  # (past use_moe_decode's bound too, to place it)
        variants += [("gemvs", gemvs, t) for t in DECODE_TILES]
    for name, kernel, tiles in variants:
        fn = functools.partial(kernel, x, w13, w2, weights, ids, tiles=tiles)
        err = relative_error(fn(), ref)
        us = do_bench_cudagraph(fn, return_mode="median") * 1e3
        rows.append((batch, touched, name, tiles, us, touched * 3 * H * I * 2 / us / 1e6, err))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 64])
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(E, 2 * I, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    print(
        "| batch | experts | BLOCK_N, BLOCK_K, warps, stages | us per layer | TB/s | rel. error |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in args.batch:
        for b, touched, name, tiles, us, tbs, err in sweep(batch, gen, w13, w2, bias):
            mark = " (default)" if tiles == DEFAULT_TILES else ""
            print(f"| {b} | {touched} | {name} {tiles}{mark} | {us:.1f} | {tbs:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
