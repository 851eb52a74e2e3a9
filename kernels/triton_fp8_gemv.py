"""FP8 weights times a few rows of activations (decode): weight-only dequantization in Triton.

At small M a linear layer is a stream over its weight, so the kernel's only job is to read the
fp8 `[N, K]` weight at the memory's bandwidth. No activation is quantized: each program loads
`BLOCK_N x BLOCK_K` fp8 tiles (16-byte vector loads along K), converts them in registers and
multiplies them by the model-dtype activations; per-output-channel scales are applied once at
the end, 128 x 128 block scales (row-expanded `[N, K/G]`, see kernels/fp8.py) once per group
of a K step.
Two inner forms, picked per launch config:

- `USE_DOT=False` (M of 1 to 4): `acc[BM, BN, BK] += x * w` element-wise and one reduction over
  K after the loop, so the K loop has no cross-thread reduction, only loads and FMAs. Triton
  does not software-pipeline loads that feed no tl.dot (num_stages has no effect here), so
  `PREFETCH` issues the next weight tile's load by hand before the current tile's FMAs.
- `USE_DOT=True` (M up to 16): `tl.dot` of the activation tile and the converted weight tile.

Programs split N; with `SPLIT_K > 1` (for a small N that would leave SMs idle) they also split K
and add their partials into a zeroed float32 output with atomics, cast afterwards. Every launch
has a fixed grid and no host synchronization, so it is captured in CUDA graphs as is.
Launch configs per (N, K) and M bound: `fp8_gemv_configs.json` beside this file
(`python -m pagedserve.benchmarks.kernels.bench_fp8 --sweep-gemv` measures them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_fp8 import pick_config

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "fp8_gemv_configs.json")
MAX_M = 16  # rows it takes: kernels/fp8.py's SMALL_M (kept there so CPU runs never import triton)


@triton.jit
def _elementwise_acc(
    x_ptr, w_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_sn, pid_n, pid_k,
    GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """`[BM, BN]` partial sums over this program's K steps, without tl.dot. Tiles are loaded
    4-D (x `[BM, 1, S, BK/S]`, w `[1, BN, S, BK/S]`, S = the K step's scale groups, 1 per
    channel) so the weight load's layout is the accumulator's, only the small activation tile
    is rearranged, and a block scale is loaded once per group, not once per element."""
    SUB: tl.constexpr = BLOCK_K if GROUP == 0 or GROUP >= BLOCK_K else GROUP
    SUBS: tl.constexpr = BLOCK_K // SUB
    rm = (tl.arange(0, BLOCK_M) % M)[:, None, None, None]
    rn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)[None, :, None, None]
    rs = tl.arange(0, SUBS)[None, None, :, None]
    rk = rs * SUB + tl.arange(0, SUB)[None, None, None, :]  # [1, 1, S, BK/S]: 0 .. BK-1
    x_ptrs = x_ptr + rm * stride_xm + pid_k * BLOCK_K + rk  # [BM, 1, S, BK/S]
    w_ptrs = w_ptr + rn * stride_wn + pid_k * BLOCK_K + rk  # [1, BN, S, BK/S]
    step = BLOCK_K * SPLIT_K
    acc = tl.zeros([BLOCK_M, BLOCK_N, SUBS, SUB], dtype=tl.float32)
    if PREFETCH:
        w_next = tl.load(w_ptrs, mask=pid_k * BLOCK_K + rk < K, other=0.0)
    for k0 in range(pid_k * BLOCK_K, K, step):
        if PREFETCH:  # the next tile's load is issued before this one's FMAs (Triton does not
            w = w_next  # pipeline loads that feed no tl.dot)
            w_next = tl.load(w_ptrs + step, mask=k0 + step + rk < K, other=0.0)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k0 + rk < K, other=0.0)
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k0 + rk < K, other=0.0)
        wf = w.to(tl.float32)
        if GROUP:  # [1, BN, S, 1]
            s_ok = k0 + rs * SUB < K
            wf *= tl.load(s_ptr + rn * stride_sn + k0 // GROUP + rs, mask=s_ok, other=0.0)
        acc += x.to(tl.float32) * wf
        x_ptrs += step
        w_ptrs += step
    return tl.sum(tl.sum(acc, 3), 2)


@triton.jit
def _dot_acc(
    x_ptr, w_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_sn, pid_n, pid_k,
    GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """`[BM, BN]` partial sums over this program's K steps: tl.dot of x and the converted w."""
    rm = tl.arange(0, BLOCK_M) % M
    rn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + pid_k * BLOCK_K + rk[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + pid_k * BLOCK_K + rk[None, :]  # [BN, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k0 + rk[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=k0 + rk[None, :] < K, other=0.0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)))  # [BM, BN] float32
        if GROUP:
            part *= tl.load(s_ptr + rn * stride_sn + k0 // GROUP)[None, :]
        acc += part
        x_ptrs += BLOCK_K * SPLIT_K
        w_ptrs += BLOCK_K * SPLIT_K
    return acc


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    args = (x_ptr, w_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_sn, pid_n, pid_k)
    if USE_DOT:
        acc = _dot_acc(*args, GROUP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    else:
        acc = _elementwise_acc(*args, GROUP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PREFETCH)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_load = rn % N  # rows past N re-read rows < N (unmasked, vectorized loads); not stored
    if not GROUP:
        acc *= tl.load(s_ptr + rn_load * stride_sn)[None, :]
    if HAS_BIAS:  # added by the first K split only
        bias = tl.load(bias_ptr + rn_load).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out_ptrs, acc, mask=ok, sem="relaxed")


def gemv_config(m: int, n: int, k: int) -> dict[str, int]:
    """The stored launch config for this (N, K) (else the default) and the smallest M bound
    that fits m: `{BLOCK_N, BLOCK_K, SPLIT_K, USE_DOT, PREFETCH, num_warps, num_stages}`."""
    return pick_config(CONFIG_FILE, m, n, k)


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int | None) -> None:
    m, k = x.shape
    n = weight.shape[0]
    scale_cols = 1 if group is None else triton.cdiv(k, group)
    if m > MAX_M or weight.shape[1] != k or scale.shape != (n, scale_cols):
        raise ValueError(
            f"fp8 GEMV shapes do not fit: x {tuple(x.shape)} (M <= {MAX_M}), weight "
            f"{tuple(weight.shape)}, scale {tuple(scale.shape)}, group {group}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8 GEMV needs activations and weight with contiguous rows")
    if group is not None and (group & (group - 1) or group < 16):
        raise ValueError(f"fp8 GEMV: scale group {group} must be a power of two >= 16")
    # (a K step wider than a group holds whole groups: BLOCK_K and group are powers of two)


def triton_fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, M <= MAX_M
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, K/G] float32 (row-expanded)
    bias: torch.Tensor | None = None,  # [N]
    group: int | None = None,  # columns per weight scale (block weights)
    config: dict[str, int] | None = None,  # sweeps force one
) -> torch.Tensor:  # [M, N] in x.dtype
    """`x @ (weight * weight_scale)^T (+ bias)`, the weight dequantized inside the kernel."""
    _check(x, weight, weight_scale, group)
    m, k = x.shape
    n = weight.shape[0]
    cfg = dict(config or gemv_config(m, n, k))
    block_n, block_k, split_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    use_dot, prefetch = bool(cfg.pop("USE_DOT")), bool(cfg.pop("PREFETCH"))
    if group is not None and use_dot:
        block_k = min(block_k, group)  # tl.dot: one block scale per K step
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    if split_k > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    _fp8_gemv_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP=group or 0, HAS_BIAS=bias is not None, EVEN_K=k % (block_k * split_k) == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_DOT=use_dot,
        PREFETCH=prefetch, **cfg,
    )  # fmt: skip
    return out if split_k == 1 else out.to(x.dtype)
