"""Probe (issue 18, W1): can a Triton GEMM that applies silu-and-mul in its epilogue beat
cuBLAS' gate/up GEMM followed by our silu-and-mul kernel, at W1's prefill shape?

    python tests/gpu/probe_gemm_silu.py [--m 8192]

A W1 prefill step spends ~4% of its GPU time in silu-and-mul (it reads the [M, 2I] GEMM output
and writes [M, I]); folding it into the GEMM only pays if the GEMM itself stays as fast as
cuBLAS. Times (ms, median of CUDA-graph replays): cuBLAS gate/up, our silu-and-mul, the fused
Triton kernel per launch config, and a plain Triton GEMM of the same tiles (no epilogue) for
Triton's own GEMM efficiency. The fused result is checked against the unfused one.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from probe_fp8_pdl import graph_ms  # run as a script: tests/gpu is on sys.path
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedserve.kernels.triton_activation import silu_mul, triton_silu_and_mul


@triton.jit
def _tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> (m tile, n tile), grouped along M so that a group shares weight tiles."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


@triton.jit
def _gate_up_silu_kernel(
    a_desc, b_desc, c_desc, M, inter, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """Persistent: program p takes tiles p, p + NUM_PROGS, ... of the [M, inter] output. FUSED:
    each tile dots x with the gate rows [n, n + BN) and the up rows [inter + n, ...) of the
    weight and stores silu(gate) * up; else it is a plain GEMM tile of the [M, N] output."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(inter, BN)
    k_tiles = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGS, flatten=True):
        pm, pn = _tile(t, num_m, num_n, GROUP_M)
        off_m, off_n = pm * BM, pn * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([off_m, kk * BK])
            acc_g = tl.dot(a, b_desc.load([off_n, kk * BK]).T, acc_g)
            if FUSED:
                acc_u = tl.dot(a, b_desc.load([inter + off_n, kk * BK]).T, acc_u)
        if FUSED:
            gate = acc_g.to(c_desc.dtype)
            up = acc_u.to(c_desc.dtype)
            c_desc.store([off_m, off_n], silu_mul(gate, up).to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc_g.to(c_desc.dtype))


def persistent_gemm(x, w, cfg, fused=True):
    """x @ w.T by the kernel above; `fused`: w is [2I, K] gate | up, the result silu(gate) * up."""
    M, K = x.shape
    inter = w.shape[0] // 2 if fused else w.shape[0]
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    a = TensorDescriptor.from_tensor(x, [BM, BK])
    b = TensorDescriptor.from_tensor(w, [BN, BK])
    c = TensorDescriptor.from_tensor(out, [BM, BN])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(M, BM) * triton.cdiv(inter, BN)
    progs = min(sms * cfg.get("per_sm", 1), tiles)
    _gate_up_silu_kernel[(progs,)](
        a, b, c, M, inter, K, BM=BM, BN=BN, BK=BK, GROUP_M=cfg.get("GROUP_M", 8),
        NUM_PROGS=progs, FUSED=fused, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16) * 0.5
    w = torch.randn(2 * args.inter, args.k, device=dev, dtype=torch.bfloat16) * 0.02
    flop = 2 * args.m * 2 * args.inter * args.k
    rows = []
    gu = torch.empty(args.m, 2 * args.inter, device=dev, dtype=torch.bfloat16)
    t_mm = graph_ms(lambda: torch.mm(x, w.t(), out=gu))
    t_silu = graph_ms(lambda: triton_silu_and_mul(gu))
    rows.append(("cuBLAS gate/up", t_mm, flop / t_mm / 1e9))
    rows.append(("silu-and-mul kernel", t_silu, 0.0))
    rows.append(("cuBLAS + silu", t_mm + t_silu, flop / (t_mm + t_silu) / 1e9))
    ref = triton_silu_and_mul(x @ w.t())
    configs = [
        dict(BM=128, BN=128, BK=64, warps=8, stages=3),
        dict(BM=128, BN=128, BK=64, warps=8, stages=4),
        dict(BM=128, BN=64, BK=64, warps=8, stages=4),
        dict(BM=128, BN=64, BK=64, warps=4, stages=4),
        dict(BM=64, BN=128, BK=64, warps=4, stages=4),
        dict(BM=128, BN=128, BK=64, warps=8, stages=3, GROUP_M=16),
    ]
    for cfg in configs:
        name = " ".join(f"{k}={v}" for k, v in cfg.items())
        try:
            out = persistent_gemm(x, w, cfg)
            err = (out.float() - ref.float()).abs().max().item()
            t = graph_ms(lambda cfg=cfg: persistent_gemm(x, w, cfg))
            rows.append((f"fused {name} (err {err:.3g})", t, flop / t / 1e9))
            cfg2 = dict(cfg, BN=2 * cfg["BN"]) if cfg["BN"] <= 128 else cfg
            t2 = graph_ms(lambda cfg2=cfg2: persistent_gemm(x, w, cfg2, fused=False))
            rows.append((f"plain BN={cfg2['BN']} {name}", t2, flop / t2 / 1e9))
        except Exception as e:  # a config the shared memory cannot hold
            rows.append((f"fused {name}: {type(e).__name__} {str(e)[:80]}", float("nan"), 0.0))
    print(f"M={args.m} K={args.k} I={args.inter}")
    for label, ms, tf in rows:
        print(f"{label:<72} {ms:8.3f} ms {tf:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
