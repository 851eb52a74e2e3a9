"""The small-batch GEMV (kernels/triton_gemv.py) against `torch.matmul` (cuBLAS) at Llama-3-8B's
weight shapes, bf16, on a GPU: GB/s of weight read (the figure of merit at small M; the H100's
copy ceiling is ~3000 GB/s) for M = 1, 2, 4, 8, both timed replaying a CUDA graph, and which one
the model's dispatch (kernels/linear.py, which measures both itself) picks.

    python -m pagedserve.benchmarks.kernels.bench_gemv [--sweep] [--qkv-rope] [--json PATH]
        [--shapes llama3-8b|llama3-70b-tp4]

`--sweep` also times every candidate launch configuration per shape at M = 1, the weights out of
L2 as a decode step reads them, and prints the best (what `gemv_config` should return). Each row
checks the GEMV against F.linear first. `--qkv-rope` times the qkv GEMV with rotary and the cache
write in its epilogue (kernels/triton_qkv_rope.py) per launch config at M = 1, the same way,
against the plain qkv GEMV and the GEMV + rotary/cache kernel pair it replaces, with 16 and 8
rotary pairs a program, 256-1024 columns a tile and 2-6 tiles in flight. `--shapes
llama3-70b-tp4`: the weights one rank of Llama-3-70B holds at `--tp 4` (16 query and 2 KV heads,
a quarter of the MLP and of the LM head).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPE_SETS = {  # name: ({weight: (N, K)}, (query heads, KV heads) of the qkv weight)
    "llama3-8b": (
        {"o_proj": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336), "lm_head": (128256, 4096)},
        (32, 8),
    ),
    "llama3-70b-tp4": (
        {"o_proj": (8192, 2048), "qkv": (2560, 8192), "gate_up": (14336, 8192),
         "down": (8192, 7168), "lm_head": (32064, 8192)},
        (16, 2),
    ),
}  # fmt: skip
SHAPES = SHAPE_SETS["llama3-8b"][0]  # the default set (tests/gpu/probe_gemm_mid.py reads it)


def _ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, return_mode="median")


def candidates() -> list[dict[str, int]]:
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))
    return [
        {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
        for n, k, w, s in grid
        if n * k <= 32768 and not (w == 8 and n == 16)
    ]


def compare(shapes: dict[str, tuple[int, int]]) -> list[dict[str, float]]:
    from pagedserve.benchmarks.kernels.bench_kernels import relative_error
    from pagedserve.kernels.linear import GEMV_WINS, linear
    from pagedserve.kernels.triton_gemv import gemv_config, triton_gemv

    rows = []
    print(f"{'shape':<8} {'N x K':>13} {'M':>2} {'gemv us':>8} {'GB/s':>6} {'cublas us':>9} "
          f"{'GB/s':>6} {'speedup':>7}  config")  # fmt: skip
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            err = relative_error(triton_gemv(x, w), F.linear(x, w))
            ours = _ms(lambda x=x, w=w: triton_gemv(x, w))
            theirs = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            gb = n * k * 2 / 1e6
            rows.append({"shape": name, "n": n, "k": k, "m": m, "gemv_us": ours * 1e3,
                         "cublas_us": theirs * 1e3, "gemv_gbps": gb / ours,
                         "cublas_gbps": gb / theirs, "rel_err": err})  # fmt: skip
            linear(x, w, None)  # what the model's dispatch picks, by its own measurement
            picked = "gemv" if GEMV_WINS[(m, n, k, "plain", x.dtype, x.device)] else "cublas"
            flag = f"  picks {picked}" + (f"  !! rel_err {err:.1e}" if err > 1e-2 else "")
            print(f"{name:<8} {n:>6}x{k:<6} {m:>2} {ours * 1e3:8.1f} {gb / ours:6.0f} "
                  f"{theirs * 1e3:9.1f} {gb / theirs:6.0f} {theirs / ours:6.2f}x  "
                  f"{gemv_config(n, k)}{flag}")  # fmt: skip
    total = {k: sum(r[k] for r in rows if r["m"] == 1) for k in ("gemv_us", "cublas_us")}
    print(f"M=1, one each of the five: gemv {total['gemv_us']:.1f} us, cuBLAS "
          f"{total['cublas_us']:.1f} us")  # fmt: skip
    return rows


def sweep(shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    """Every candidate launch config per shape at M = 1, timed as the decode chain meets the
    weights: each timed call runs the GEMV over enough distinct copies of the weight (>= 400 MB)
    that none is in the 50 MB L2 when its turn comes (one copy timed alone reads the smaller
    shapes partly from L2). Prints cuBLAS, the current config and the best; `down` also in the
    silu-folded (gated) form."""
    cases = [(name, n, k, False) for name, (n, k) in shapes.items()]
    cases.append(("down+silu", *shapes["down"], True))
    return {name: _sweep_case(name, n, k, gated) for name, n, k, gated in cases}


def _cold_weights(n: int, k: int) -> list[torch.Tensor]:
    """Distinct [n, k] bf16 weights, >= 400 MB in all: none is in the 50 MB L2 when its turn
    comes in a call over all of them."""
    copies = max(2, -(-400_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]


def _per_weight_ms(one: Callable[[torch.Tensor], object], ws: list[torch.Tensor]) -> float:
    return _ms(lambda: [one(w) for w in ws]) / len(ws)


def _sweep_case(name: str, n: int, k: int, gated: bool) -> dict[str, int]:
    from pagedserve.kernels.triton_gemv import gemv_config, triton_gemv

    ws = _cold_weights(n, k)
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)

    def cublas(w: torch.Tensor) -> torch.Tensor:
        return torch.matmul(F.silu(x[:, :k]) * x[:, k:] if gated else x, w.t())

    timed = [(_per_weight_ms(cublas, ws), "cublas")]
    for cfg in [gemv_config(n, k, gated), *candidates()]:
        try:
            gemv = lambda w, c=cfg: triton_gemv(x, w, gated=gated, config=c)  # noqa: E731
            timed.append((_per_weight_ms(gemv, ws), cfg))
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
            print(f"  {name} {cfg}: {type(exc).__name__}")
    gb = n * k * 2 / 1e6
    for ms, cfg in timed[:2]:
        print(f"{name:<9} {ms * 1e3:7.1f} us {gb / ms:6.0f} GB/s {cfg}")
    ms, cfg = min(timed[1:], key=lambda t: t[0])
    print(f"{name:<9} best {ms * 1e3:7.1f} us {gb / ms:6.0f} GB/s {cfg} "
          f"({timed[0][0] / ms:.2f}x cuBLAS)")  # fmt: skip
    return cfg


def qkv_rope(n: int, k: int, hq: int, hkv: int) -> None:
    from pagedserve.kernels.rotary import rope_config
    from pagedserve.kernels.triton_gemv import gemv_config, triton_gemv
    from pagedserve.kernels.triton_qkv_rope import triton_qkv_rope_cache
    from pagedserve.kernels.triton_rope_cache import triton_rope_and_cache
    from pagedserve.worker.layers.rotary import RotaryEmbedding

    ws = _cold_weights(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cos_sin = RotaryEmbedding(128, 8192, rope_config({"rope_theta": 5e5})).cos_sin_cache.cuda()
    pos = torch.tensor([300], device="cuda")
    slots = torch.tensor([4000], device="cuda")
    kv = torch.zeros(512, 2, 16, hkv, 128, device="cuda", dtype=torch.bfloat16)

    def pair(w: torch.Tensor) -> torch.Tensor:
        q, kk, v = triton_gemv(x, w).split([hq * 128, hkv * 128, hkv * 128], dim=-1)
        return triton_rope_and_cache(pos, q, kk, v, kv, slots, cos_sin)

    def fused(w: torch.Tensor, cfg: dict | None) -> torch.Tensor:
        return triton_qkv_rope_cache(x, w, None, pos, cos_sin, kv, slots, hq, config=cfg)

    gb = n * k * 2 / 1e6
    rows = [("gemv alone", lambda w: triton_gemv(x, w)), ("gemv + rope/cache kernel", pair)]
    rows.append(("fused, default config", lambda w: fused(w, None)))
    for block_h, block_k, stages in itertools.product((16, 8), (256, 512, 1024), (2, 3, 4, 5, 6)):
        cfg = {**gemv_config(n, k), "BLOCK_K": block_k, "num_stages": stages, "BLOCK_H": block_h}
        rows.append((f"fused {cfg}", lambda w, c=cfg: fused(w, c)))
    for label, one in rows:
        try:
            ms = _per_weight_ms(one, ws)
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory)
            print(f"qkv {label}: {type(exc).__name__}")
            continue
        print(f"qkv {ms * 1e3:6.1f} us {gb / ms:6.0f} GB/s  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--qkv-rope", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="llama3-8b")
    args = parser.parse_args()
    shapes, (hq, hkv) = SHAPE_SETS[args.shapes]
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), f"bf16 GEMV vs cuBLAS, {args.shapes} weight shapes")
    result = {"compare": compare(shapes)}
    if args.sweep:
        result["sweep"] = sweep(shapes)
    if args.qkv_rope:
        qkv_rope(*shapes["qkv"], hq, hkv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
