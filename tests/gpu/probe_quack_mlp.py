"""Probe (issue 18, W1/W5): does quack's CuTe-DSL GEMM with a SwiGLU epilogue (installed beside
FA4 by `fa4-install`) beat cuBLAS' gate/up GEMM followed by our silu-and-mul at prefill shapes?

    python tests/gpu/probe_quack_mlp.py [--m 8192 4096 2304] [--tune]

The Triton version of this fusion lost to cuBLAS (probe_gemm_silu.py: 3.07 against 2.67 ms at
M = 8,192). quack's `gemm_act(..., activation="swiglu", concat_layout=("B",))` reads our
[gate; up] weight as it is stored and writes only silu(gate) * up, so the [M, 2I] intermediate
never reaches memory. Times (ms, median of CUDA-graph replays): cuBLAS gate/up + silu-and-mul,
quack fused with its default config and (with --tune) its autotuned one, and the other layer
GEMMs (plain) on cuBLAS against quack, for the rest of a prefill step. Each fused result is
checked against the unfused one; the first call's compile time is printed.
"""

from __future__ import annotations

import argparse
import time

import torch
from probe_fp8_pdl import graph_ms  # run as a script: tests/gpu is on sys.path
from quack.gemm_interface import gemm, gemm_act

from pagedserve.kernels.triton_activation import triton_silu_and_mul


def _first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class _Rows(list):
    """Prints each row as it comes, so a run cut short by its timeout still reports."""

    def append(self, row) -> None:
        m, label, ms, tf = row
        print(f"M={m:<6} {label:<66} {ms:8.3f} ms {tf:6.0f} TFLOP/s", flush=True)
        super().append(row)


def _failed(rows, m, label, e) -> None:
    rows.append((m, f"{label}: {type(e).__name__} {str(e)[:90]}", float("nan"), 0.0))


def probe_m(rows, m: int, w_gu, others, tune: bool) -> None:
    """One prompt-chunk size: the gate/up pair both ways, then the other GEMMs both ways."""
    dev, (n2, K) = w_gu.device, w_gu.shape
    inter = n2 // 2
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16) * 0.5
    flop = 2 * m * n2 * K
    gu = torch.empty(m, n2, device=dev, dtype=torch.bfloat16)
    t_mm = graph_ms(lambda: torch.mm(x, w_gu.t(), out=gu))
    t_both = t_mm + graph_ms(lambda: triton_silu_and_mul(gu))
    rows.append((m, "cuBLAS gate/up", t_mm, flop / t_mm / 1e9))
    rows.append((m, "cuBLAS gate/up + silu-and-mul", t_both, flop / t_both / 1e9))
    ref = triton_silu_and_mul(x @ w_gu.t()).float()
    out = torch.empty(m, inter, device=dev, dtype=torch.bfloat16)
    for tuned in (False, True) if tune else (False,):

        def fused(tuned=tuned):
            gemm_act(x, w_gu.t(), activation="swiglu", postact_out=out, store_preact=False,
                     concat_layout=("B",), tuned=tuned)  # fmt: skip

        label = f"quack swiglu {'tuned' if tuned else 'default'}"
        try:
            first = _first_call_s(fused)
            err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
            t = graph_ms(fused)
            rows.append((m, f"{label} (1st {first:.1f} s, rel err {err:.2g})", t, flop / t / 1e9))
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            _failed(rows, m, label, e)
    for name, w in others.items():
        a = x if w.shape[1] == K else torch.randn(m, w.shape[1], device=dev, dtype=x.dtype)
        f = 2 * m * w.shape[0] * w.shape[1]
        o = torch.empty(m, w.shape[0], device=dev, dtype=x.dtype)
        t_c = graph_ms(lambda a=a, w=w, o=o: torch.mm(a, w.t(), out=o))
        rows.append((m, f"cuBLAS {name}", t_c, f / t_c / 1e9))
        try:
            t_q = graph_ms(lambda a=a, w=w, o=o: gemm(a, w.t(), out=o, tuned=False))
            rows.append((m, f"quack {name}", t_q, f / t_q / 1e9))
        except Exception as e:  # noqa: BLE001
            _failed(rows, m, f"quack {name}", e)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[8192, 8448, 4096, 2304])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--tune", action="store_true", help="also time quack's autotuned config")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    K, inter = args.k, args.inter
    w_gu = torch.randn(2 * inter, K, device=dev, dtype=torch.bfloat16) * 0.02
    others = {  # name: weight [N, K] (nn.Linear layout), Llama-3-8B's other layer GEMMs
        "qkv": torch.randn(6144, K, device=dev, dtype=torch.bfloat16) * 0.02,
        "o_proj": torch.randn(K, K, device=dev, dtype=torch.bfloat16) * 0.02,
        "down": torch.randn(K, inter, device=dev, dtype=torch.bfloat16) * 0.02,
    }
    print(f"K={K} I={inter}", flush=True)
    rows = _Rows()
    for m in args.m:
        probe_m(rows, m, w_gu, others, args.tune)


if __name__ == "__main__":
    main()
