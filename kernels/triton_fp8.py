"""FP8 in Triton: dynamic activation quantization and the w8a8 block-scaled GEMM.

Quantization: program (row, column chunk) reads `GROUPS x GROUP` elements of one row, takes each
group's absolute max, and writes the fp8 values and one float32 scale per group (per token: one
group as wide as the row, held in registers up to 16384 columns, else walked twice in chunks).
Per token it can also take a gated MLP's `[M, 2I]` gate/up product and quantize
`silu(gate) * up` (rounded to the model dtype, as `silu_and_mul` writes it) without writing it:
one pass over the gate/up halves instead of silu_and_mul's write and the quantizer's read.

Block GEMM (the design DeepSeek-V3 and vLLM use for 128 x 128 block weights): `C[M, N] = sum_g
(A_g @ B_g^T) * a_scale[:, g] * b_scale[:, g]` where g runs over K in steps of the block width
`BLOCK_K` = G. Each program owns a `BLOCK_M x BLOCK_N` tile of C (grouped along M for L2
reuse), and per K step does one fp8 `tl.dot` into a float32 partial that is scaled and added to
the accumulator, so scales never touch the fp8 operands. B is `[N, K]` row-major (the
checkpoint's layout), read transposed; b_scale is row-expanded `[N, K/G]` (see kernels/fp8.py).
Launch configs per (N, K) and M range come from `fp8_block_configs.json` beside this file
(`python -m pagedserve.benchmarks.kernels.bench_fp8 --sweep` measures them).
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_activation import silu_mul

FP8_MAX = tl.constexpr(448.0)  # a constexpr: kernels may read it
ONE_PASS_COLS = 16384  # rows up to this width are quantized from registers in one read
CONFIG_FILE = os.path.join(os.path.dirname(__file__), "fp8_block_configs.json")


@triton.jit
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, num_cols, num_groups, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    ok = (g[:, None] < num_groups) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX, 1e-12)  # [GROUPS]
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g < num_groups)


@triton.jit
def _row_chunk(x_ptr, row_off, start, cols, num_cols, GATED: tl.constexpr):
    """Columns `start + cols` of one row as float32: the row itself, or for GATED rows
    `silu(gate) * up` of its two halves, rounded to the input dtype."""
    ok = start + cols < num_cols
    x = tl.load(x_ptr + row_off + start + cols, mask=ok, other=0.0)
    if GATED:
        up = tl.load(x_ptr + row_off + num_cols + start + cols, mask=ok, other=0.0)
        x = silu_mul(x, up).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def quantize_row(x):
    """One row held in registers (float32, zero where masked) -> (its values scaled into e4m3's
    range, still float32, and the scale): per-token quantization, shared with the quantizing
    RMSNorm (kernels/triton_norm.py) so the two agree to the bit."""
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, 1e-12)
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX), scale


@triton.jit
def _quant_token_kernel(
    x_ptr, q_ptr, s_ptr, num_cols, stride_x, stride_q,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_off, q_off = row * stride_x, row * stride_q
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in registers: one read (decode latency is what matters here)
        q, scale = quantize_row(_row_chunk(x_ptr, x_off, 0, cols, num_cols, GATED))
        tl.store(q_ptr + q_off + cols, q.to(q_ptr.dtype.element_ty), mask=cols < num_cols)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, num_cols, BLOCK):
            amax = tl.maximum(amax, tl.abs(_row_chunk(x_ptr, x_off, start, cols, num_cols, GATED)))
        scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, 1e-12)
        for start in range(0, num_cols, BLOCK):
            x = _row_chunk(x_ptr, x_off, start, cols, num_cols, GATED)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            ok = start + cols < num_cols
            tl.store(q_ptr + q_off + start + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def _quantize_tokens(
    x: torch.Tensor, num_cols: int, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    q = torch.empty((m, num_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(num_cols), ONE_PASS_COLS)
        warps = max(1, min(16, block // 1024))  # <= 32 fp32 values per thread
        _quant_token_kernel[(m,)](
            x, q, scale, num_cols, x.stride(0), q.stride(0),
            BLOCK=block, ONE_PASS=num_cols <= block, GATED=gated, num_warps=warps,
        )  # fmt: skip
    return q, scale


def triton_silu_mul_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(silu_and_mul(gate_up))` in one kernel: `[M, 2I] -> (fp8 [M, I],
    float32 [M, 1])`, gate half first."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(
            f"expected a [M, 2I] gate/up tensor with contiguous rows, got {tuple(gate_up.shape)}"
        )
    return _quantize_tokens(gate_up, gate_up.shape[1] // 2, gated=True)


def triton_quantize_rows(
    x: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows`' contract: `[M, K] -> (fp8 [M, K], float32 [M, 1] or [M, K/group])`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a [M, K] tensor with contiguous rows, got {tuple(x.shape)}")
    if group is None:
        return _quantize_tokens(x, x.shape[1], gated=False)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if group & (group - 1):
        raise ValueError(f"activation group {group} must be a power of two")
    num_groups = triton.cdiv(k, group)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    groups = max(1, min(triton.next_power_of_2(num_groups), 2048 // group))
    if m:
        grid = (m, triton.cdiv(num_groups, groups))
        _quant_groups_kernel[grid](
            x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=group, GROUPS=groups,
        )  # fmt: skip
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _w8a8_block_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # programs that share GROUP_M row tiles (L2 reuse of B)
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]  # [BM, BK]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + rk[:, None]  # [BK, BN] (B^T)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk + g * BLOCK_K < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptr + rm * stride_asm + g, mask=m_ok, other=0.0)  # [BM]
        b_s = tl.load(bs_ptr + rn * stride_bsn + g, mask=n_ok, other=0.0)  # [BN]
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _config_table(path: str) -> dict[str, list[list]]:
    with open(path) as f:
        return json.load(f)


def pick_config(path: str, m: int, n: int, k: int) -> dict[str, int]:
    """From a stored table of launch configs (`{"N,K" or "default": [[max_m, config], ...]}`):
    the entries for (N, K), else the default ones, and of those the first whose M bound fits m
    (the last one past every bound)."""
    table = _config_table(path)
    entries = table.get(f"{n},{k}") or table["default"]
    for max_m, config in entries:
        if m <= max_m:
            return dict(config)
    return dict(entries[-1][1])


def block_config(m: int, n: int, k: int) -> dict[str, int]:
    """The block GEMM's launch config: `{BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages}`."""
    return pick_config(CONFIG_FILE, m, n, k)


def triton_w8a8_block_matmul(
    a: torch.Tensor,  # [M, K] fp8
    a_scale: torch.Tensor,  # [M, K/G] float32
    b: torch.Tensor,  # [N, K] fp8
    b_scale: torch.Tensor,  # [N, K/G] float32 (row-expanded block scales)
    group: int,
    out_dtype: torch.dtype,
    config: dict[str, int] | None = None,  # sweeps force one
) -> torch.Tensor:  # [M, N]
    m, k = a.shape
    n = b.shape[0]
    num_groups = triton.cdiv(k, group)
    if b.shape[1] != k or a_scale.shape != (m, num_groups) or b_scale.shape != (n, num_groups):
        raise ValueError(
            f"block GEMM shapes do not fit: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, "
            f"b {tuple(b.shape)}, b_scale {tuple(b_scale.shape)}, group {group}"
        )
    if a.stride(1) != 1 or b.stride(1) != 1 or a_scale.stride(1) != 1 or b_scale.stride(1) != 1:
        raise ValueError("block GEMM operands and scales need contiguous rows")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    cfg = config or block_config(m, n, k)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k,
        a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0), b_scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group, **cfg,
    )  # fmt: skip
    return c
