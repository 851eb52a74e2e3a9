"""The batched LoRA pair (kernels/triton_lora.py) against its torch reference (kernels/lora.py)
and against the base layer's own matmul, at Llama-3-8B's projection shapes, bf16, on a GPU:
median microseconds of shrink + expand for 4 adapters mixed uniformly over the batch, rank 16 per
part (q/k/v three parts, gate/up two), the rows of one request contiguous (decode: one token per
request; prefill: 1,024-token requests).

    python -m pagedserve.benchmarks.kernels.bench_lora [--json PATH]

Each row first checks the Triton pair against the reference. Decode rows (<= 32 tokens) also
time, each inside a CUDA graph as a decode step replays it (no launch overhead; weights warm in
L2): the pair, the base layer's Triton GEMV alone, and the decode-size path (the shrink inside
that GEMV, one expand: `triton_lora_linear`, checked against GEMV + reference too); `lora us`
is what that path adds to the GEMV.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pagedserve.kernels.lora import SlotRows, lora_expand_ref, lora_shrink_ref

SHAPES = {  # name: (N, K, parts)
    "qkv": (6144, 4096, 3),
    "o_proj": (4096, 4096, 1),
    "gate_up": (28672, 4096, 2),
    "down": (4096, 14336, 1),
}
CASES = {  # name: (tokens, tokens per request)
    "decode-1": (1, 1),
    "decode-32": (32, 1),
    "decode-256": (256, 1),
    "prefill-8k": (8192, 1024),
}
NUM_LORAS, RANK = 4, 16


def _us(fn) -> float:
    from triton.testing import do_bench

    return 1000 * do_bench(fn, return_mode="median")


def _graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return 1000 * do_bench_cudagraph(fn, return_mode="median")


def decode_rows(x, w, a, b, rows, pair) -> dict[str, float]:
    """The graph-timed decode columns (see the module's docstring)."""
    from pagedserve.kernels.triton_gemv import triton_gemv
    from pagedserve.kernels.triton_lora import triton_lora_linear

    def fused() -> torch.Tensor:
        return triton_lora_linear(x, w, None, a, b, rows.token_slots)

    want = lora_expand_ref(F.linear(x, w), lora_shrink_ref(x, a, rows), b, rows)
    torch.testing.assert_close(fused().float(), want.float(), rtol=2e-2, atol=2e-2)
    gemv, path = _graph_us(lambda: triton_gemv(x, w)), _graph_us(fused)
    return {"pair_graph_us": _graph_us(pair), "gemv_graph_us": gemv, "fused_graph_us": path,
            "lora_graph_us": path - gemv}  # fmt: skip


def bench_row(n: int, k: int, parts: int, tokens: int, per_request: int) -> dict[str, float]:
    from pagedserve.kernels.triton_lora import triton_lora_expand, triton_lora_shrink

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
    a = torch.randn(NUM_LORAS, parts * RANK, k, device=dev, dtype=dt) * 0.02
    b = torch.randn(NUM_LORAS, n, parts * RANK, device=dev, dtype=dt) * 0.02
    starts = list(range(0, tokens + 1, per_request))
    rows = SlotRows.from_segments(starts, [i % NUM_LORAS for i in range(len(starts) - 1)], dev)
    y = torch.zeros(tokens, n, device=dev, dtype=dt)

    def triton_pair() -> torch.Tensor:
        return triton_lora_expand(y, triton_lora_shrink(x, a, rows), b, rows)

    def reference() -> torch.Tensor:
        return lora_expand_ref(y, lora_shrink_ref(x, a, rows), b, rows)

    y.zero_()
    got = triton_pair().float()
    y.zero_()
    want = reference().float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    from pagedserve.kernels.triton_lora import triton_lora_dense

    def dense() -> torch.Tensor:
        return triton_lora_dense(y, x, a, b, rows.token_slots)

    y.zero_()
    torch.testing.assert_close(dense().float(), want, rtol=2e-2, atol=2e-2)
    out = {
        "triton_us": _us(triton_pair),
        "dense_us": _us(dense),
        "torch_ref_us": _us(reference),
        "base_matmul_us": _us(lambda: F.linear(x, w)),
    }
    if tokens <= 32:
        out.update(decode_rows(x, w, a, b, rows, triton_pair))
    return out


def bench_swiglu(tokens: int) -> None:
    """A prompt's gate/up at 4 adapters: the deltas inside silu-and-mul (`triton_lora_swiglu`)
    against the dense expand then `silu_and_mul`, and `silu_and_mul` alone (the base's)."""
    from pagedserve.kernels.activation import silu_and_mul
    from pagedserve.kernels.triton_lora import triton_lora_dense, triton_lora_swiglu

    (n, k, parts), dev, dt = SHAPES["gate_up"], "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=dt)
    y = torch.randn(tokens, n, device=dev, dtype=dt)
    a = torch.randn(NUM_LORAS, parts * RANK, k, device=dev, dtype=dt) * 0.02
    b = torch.randn(NUM_LORAS, n, parts * RANK, device=dev, dtype=dt) * 0.02
    starts = list(range(0, tokens + 1, 1024))
    rows = SlotRows.from_segments(starts, [i % NUM_LORAS for i in range(len(starts) - 1)], dev)
    fused = triton_lora_swiglu(y, x, a, b, rows.token_slots)
    want = silu_and_mul(triton_lora_dense(y.clone(), x, a, b, rows.token_slots))
    torch.testing.assert_close(fused.float(), want.float(), rtol=2e-2, atol=2e-2)
    t = [
        _us(lambda: triton_lora_swiglu(y, x, a, b, rows.token_slots)),
        _us(lambda: silu_and_mul(triton_lora_dense(y, x, a, b, rows.token_slots))),
        _us(lambda: silu_and_mul(y)),
    ]
    print(f"gate_up {tokens} tokens: deltas in silu-and-mul {t[0]:.1f} us, dense expand + "
          f"silu_and_mul {t[1]:.1f}, silu_and_mul alone {t[2]:.1f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--swiglu", action="store_true", help="only `bench_swiglu` at 8,192 tokens")
    args = p.parse_args()
    if args.swiglu:
        return bench_swiglu(8192)
    rows = []
    print(f"{'layer':>8} {'case':>11} {'pair us':>8} {'dense us':>9} {'torch ref':>10} "
          f"{'base mm':>8} {'graph: pair':>12} {'gemv':>6} {'gemv+lora':>10} "
          f"{'lora us':>8}")  # fmt: skip
    for (name, (n, k, parts)), (case, (tokens, per)) in (
        (s, c) for s in SHAPES.items() for c in CASES.items()
    ):
        r = bench_row(n, k, parts, tokens, per)
        rows.append({"layer": name, "case": case, **r})
        graph = ""
        if "pair_graph_us" in r:
            graph = (f" {r['pair_graph_us']:>12.1f} {r['gemv_graph_us']:>6.1f} "
                     f"{r['fused_graph_us']:>10.1f} {r['lora_graph_us']:>8.1f}")  # fmt: skip
        print(f"{name:>8} {case:>11} {r['triton_us']:>8.1f} {r['dense_us']:>9.1f} "
              f"{r['torch_ref_us']:>10.1f} {r['base_matmul_us']:>8.1f}{graph}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
