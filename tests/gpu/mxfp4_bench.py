"""gpt-oss-20b's experts (32 of 2880 x 2880, top 4, biases, clamped SwiGLU) read in MXFP4 against
the same weights dequantized to bf16, on a GPU:

    python3 tests/gpu/mxfp4_bench.py [--batch 1 2 8 64 256 2048]

For each batch: the bf16 kernels as the engine runs them (the two GEMVs of
kernels/triton_moe_decode.py for <= 8 token-expert pairs, the grouped kernel of
kernels/triton_moe.py) and the MXFP4 ones (kernels/triton_moe_mxfp4_decode.py,
kernels/triton_moe_mxfp4.py) with a few tiles each: one expert layer's time in a CUDA graph
(`do_bench_cudagraph`, median), the expert bytes it reads per second (bf16: 2 bytes a weight;
MXFP4: 17/32) and the relative error against the torch reference over the dequantized weights.
"""

from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench_cudagraph

from pagedserve.benchmarks.kernels.bench_kernels import relative_error
from pagedserve.kernels.gpt_oss_moe import clamped_swiglu, gpt_oss_experts_ref, route
from pagedserve.kernels.mxfp4 import dequantize_mxfp4
from pagedserve.kernels.triton_moe import triton_fused_moe
from pagedserve.kernels.triton_moe_decode import triton_moe_decode
from pagedserve.kernels.triton_moe_mxfp4 import triton_fused_moe_mxfp4
from pagedserve.kernels.triton_moe_mxfp4_decode import MXFP4_DECODE_TILES, triton_moe_mxfp4_decode

E, H, I, K = 32, 2880, 2880, 4
CLAMP = (1.702, 7.0)
GEMV_TILES = [MXFP4_DECODE_TILES, (8, 16, 8, 2), (4, 32, 4, 2), (16, 8, 8, 2)]
GROUPED_TILES = [None, (64, 128, 4, 3), (64, 64, 8, 2), (128, 64, 8, 3)]  # None: the defaults


def packed(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (E, n, k // 32, 16), device="cuda", generator=gen)
    scales = torch.randint(117, 122, (E, n, k // 32), device="cuda", generator=gen)
    return blocks.byte(), scales.byte()


def variants(batch: int, w13, w2, d13, d2, bias):
    act = functools.partial(clamped_swiglu, alpha=CLAMP[0], limit=CLAMP[1])
    if batch * K <= 8:
        yield "bf16 gemvs", None, functools.partial(triton_moe_decode, w13=d13, w2=d2,
                                                    w13_bias=bias, clamp=CLAMP)  # fmt: skip
        for tiles in GEMV_TILES:
            yield (
                "mxfp4 gemvs",
                tiles,
                functools.partial(
                    triton_moe_mxfp4_decode, w13=w13, w2=w2, w13_bias=bias, clamp=CLAMP, tiles=tiles
                ),
            )
    yield "bf16 grouped", None, functools.partial(triton_fused_moe, w13=d13, w2=d2,
                                                  w13_bias=bias, activation=act)  # fmt: skip
    for tiles in GROUPED_TILES:
        yield (
            "mxfp4 grouped",
            tiles,
            functools.partial(
                triton_fused_moe_mxfp4, w13=w13, w2=w2, w13_bias=bias, activation=act, tiles=tiles
            ),
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 8, 64, 256, 2048])
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    w13, w2 = packed(2 * I, H, gen), packed(H, I, gen)
    d13 = dequantize_mxfp4(*w13, torch.bfloat16)
    d2 = dequantize_mxfp4(*w2, torch.bfloat16)
    bias = (torch.randn(E, 2 * I, device="cuda", generator=gen) * 0.1).bfloat16()
    print("| batch | experts | kernel | tiles | us per layer | TB/s of expert bytes | rel. error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in args.batch:
        x = torch.randn(batch, H, device="cuda", generator=gen).bfloat16()
        weights, ids = route(torch.randn(batch, E, device="cuda", generator=gen), K)
        ref = gpt_oss_experts_ref(x, d13, bias, d2, weights, ids, *CLAMP)
        touched = ids.unique().numel()
        for name, tiles, kernel in variants(batch, w13, w2, d13, d2, bias):
            fn = functools.partial(kernel, x, topk_weights=weights, topk_ids=ids)
            try:
                err = relative_error(fn(), ref)
                us = do_bench_cudagraph(fn, return_mode="median") * 1e3
            except Exception as e:  # a tile that does not compile: say so, go on
                print(f"| {batch} | {touched} | {name} | {tiles} | failed: {type(e).__name__} |")
                continue
            per_weight = 2 if name.startswith("bf16") else 17 / 32
            tbs = touched * 3 * H * I * per_weight / us / 1e6
            print(f"| {batch} | {touched} | {name} | {tiles} | {us:.1f} | {tbs:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
