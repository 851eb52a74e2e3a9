"""Time FP8 GEMMs at Llama-3-8B shapes on a GPU, and sweep our Triton kernels' launch configs.

`python -m pagedserve.benchmarks.kernels.bench_fp8` prints, per (M, N, K), the median time of the
bf16 matmul, `fp8_linear` per channel (activation quantization + `torch._scaled_mm`; at M <= 16 the
weight-only kernel) and per 128-block (quantization + our Triton GEMM; at M <= 16 the same
weight-only kernel), with the weight-streaming bandwidth and TFLOP/s. `--sweep` times every
candidate config of the block GEMM per shape and M bucket and prints JSON in the form of
`fp8_block_configs.json` (the fastest per bucket).

Small M (decode), where a GEMM only streams its weight: `--gemv [--out F.json]` prints GB/s of
weight read per (N, K) at M = 1, 4, 16 for our weight-only kernel (kernels/triton_fp8_gemv.py),
the w8a8 path it replaces (per-token quantization + `torch._scaled_mm`) and bf16 `torch.matmul`
(GB/s of its bf16 weight); `--sweep-gemv [--out F.json]` picks the fastest launch config per
shape and M bucket and writes `fp8_gemv_configs.json`'s form. Both cycle through enough weight
copies (>= 256 MB) that every call reads HBM, not the 50 MB L2, as a decode step does.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton

from pagedserve.kernels import fp8
from pagedserve.kernels.triton_fp8 import triton_quantize_rows, triton_w8a8_block_matmul
from pagedserve.kernels.triton_fp8_gemv import CONFIG_FILE as GEMV_CONFIG_FILE
from pagedserve.kernels.triton_fp8_gemv import triton_fp8_gemv

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
BUCKETS = {16: [1, 16], 64: [64], 256: [256], 1_000_000_000: [2048, 8192]}


def _bench(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, return_mode="median")


def _per_copy_ms(op, copies: list, replays: int = 10) -> float:
    """Median ms of `op(copy)` over 5 timings of `replays` replays of one CUDA graph that runs
    it once per copy (cheaper to capture than do_bench_cudagraph's unrolled graphs: sweeps
    time hundreds of configs)."""
    op(copies[0])  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            op(c)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays / len(copies))
    return sorted(times)[2]


def _weight_copies(n: int, k: int, dtype: torch.dtype, group: int | None = None) -> list:
    """`(weight, scale)` pairs, enough of them to hold >= 256 MB (fp8 weights when `dtype` is
    FP8, else `dtype` weights with scale None)."""
    count = max(1, -(-(256 << 20) // (n * k * torch.finfo(dtype).bits // 8)))
    out = []
    for _ in range(count):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out.append(fp8.quantize_rows(w, group) if dtype == fp8.FP8 else (w.to(dtype), None))
    return out


def compare_gemv(out_path: str | None) -> None:
    rows = []
    print(f"{'M':>3} {'N':>6} {'K':>6} {'gemv us':>8} {'GB/s':>6} {'w8a8 us':>8} {'GB/s':>6} "
          f"{'bf16 us':>8} {'GB/s':>6} {'blk gemv us':>11}")  # fmt: skip
    for n, k in SHAPES:
        w8, wb16, wblk = (_weight_copies(n, k, fp8.FP8), _weight_copies(n, k, torch.bfloat16),
                          _weight_copies(n, k, fp8.FP8, 128))  # fmt: skip
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = {
                "gemv": _per_copy_ms(lambda c, x=x: triton_fp8_gemv(x, c[0], c[1]), w8),
                "w8a8": _per_copy_ms(lambda c, x=x: _w8a8(x, c[0], c[1]), w8),
                "bf16": _per_copy_ms(lambda c, x=x: torch.matmul(x, c[0].t()), wb16),
                "gemv_block": _per_copy_ms(
                    lambda c, x=x: triton_fp8_gemv(x, c[0], c[1], None, 128), wblk
                ),
            }
            gbps = {key: n * k * (2 if key == "bf16" else 1) / ms / 1e6 for key, ms in t.items()}
            rows.append(dict(m=m, n=n, k=k, us={a: b * 1e3 for a, b in t.items()}, gbps=gbps))
            print(f"{m:>3} {n:>6} {k:>6} {t['gemv'] * 1e3:>8.1f} {gbps['gemv']:>6.0f} "
                  f"{t['w8a8'] * 1e3:>8.1f} {gbps['w8a8']:>6.0f} {t['bf16'] * 1e3:>8.1f} "
                  f"{gbps['bf16']:>6.0f} {t['gemv_block'] * 1e3:>11.1f}")  # fmt: skip
        del w8, wb16, wblk
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


def _w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The large-M path at any M: per-token quantization, then `torch._scaled_mm`."""
    xq, xs = triton_quantize_rows(x)
    return fp8.scaled_mm_rowwise(xq, xs, w, s, x.dtype)


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


GEMV_BUCKETS = (1, 4, 16)  # each M bucket is timed at its bound


def gemv_candidates(m: int, n: int) -> list[dict[str, int]]:
    """Launch configs worth timing at this M bound: element-wise ones (USE_DOT 0, with and
    without PREFETCH; num_stages does not matter to them) that keep <= 64 float32 accumulators
    per thread and load >= 16 weight bytes per thread per K step, tl.dot ones from M = 4; K
    split in 4 only for an N small enough that N alone gives few programs per SM."""
    block_m = triton.next_power_of_2(m)
    splits = (1, 2, 4) if n <= 2048 else (1, 2)
    out = []
    for bn, bk, w, sk, pf in itertools.product(
        (8, 16, 32), (128, 256, 512, 1024), (4, 8), splits, (0, 1)
    ):
        if block_m * bn * bk <= 64 * 32 * w and bn * bk >= 16 * 32 * w:
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, USE_DOT=0, PREFETCH=pf,
                            num_warps=w, num_stages=1))  # fmt: skip
    if m >= 4:
        for bn, bk, st, sk in itertools.product((16, 32, 64), (128, 256), (2, 4), splits[:2]):
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, USE_DOT=1, PREFETCH=0,
                            num_warps=4, num_stages=st))  # fmt: skip
    return out


def sweep_gemv(out_path: str | None) -> None:
    with open(GEMV_CONFIG_FILE) as f:
        stored = json.load(f)
    table = {"_doc": stored["_doc"], "default": stored["default"]}  # for shapes not swept
    for n, k in SHAPES:
        copies = _weight_copies(n, k, fp8.FP8)
        entries = []
        for m in GEMV_BUCKETS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            best = None
            for cfg in gemv_candidates(m, n):
                try:
                    ms = _per_copy_ms(
                        lambda c, x=x, cfg=cfg: triton_fp8_gemv(x, c[0], c[1], config=cfg), copies
                    )
                except Exception as e:  # e.g. out of shared memory: not a candidate here
                    print(f"N={n} K={k} M={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            print(f"N={n} K={k} M<={m}: {best[1]} {best[0] * 1e3:.1f} us "
                  f"{n * k / best[0] / 1e6:.0f} GB/s", file=sys.stderr)  # fmt: skip
            entries.append([m, best[1]])
        table[f"{n},{k}"] = entries
        del copies
        if out_path:  # after every shape: a sweep cut short still leaves what it found
            with open(out_path, "w") as f:
                f.write(config_json(table))
    print(config_json(table))


def config_json(table: dict) -> str:
    """A config table as JSON with one `[max_m, config]` entry per line."""
    lines = [f" {json.dumps('_doc')}: {json.dumps(table['_doc'])}"]
    for key, entries in table.items():
        if key != "_doc":
            rows = ",\n".join(f"  {json.dumps(e)}" for e in entries)
            lines.append(f" {json.dumps(key)}: [\n{rows}\n ]")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    torch.manual_seed(0)
    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    if "--sweep-gemv" in argv:
        sweep_gemv(out)
    elif "--gemv" in argv:
        compare_gemv(out)
    elif "--sweep" in argv:
        sweep()
    else:
        compare()
