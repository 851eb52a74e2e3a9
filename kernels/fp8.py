"""FP8 (e4m3) linear layers: quantization helpers, the torch reference and the GPU dispatch.

Layout (one for every checkpoint format): a weight is float8_e4m3fn `[N, K]` with a float32
scale `[N, 1]` (per output channel; per-tensor scales are broadcast to rows) or `[N, ceil(K/G)]`
(block scales expanded to rows: row n, column group g holds its block's scale, so merged
q/k/v or gate/up parts and TP shards need no alignment of their row counts to the block).
Activations are quantized per token (`[M, 1]`), or per token and G-column group (`[M, K/G]`)
for block weights. `w = w_fp8 * scale`: scales are dequantization factors.

`fp8_linear` is the one entry. Up to `SMALL_M` rows (decode) a linear layer only streams its
weight, so activations are not quantized: the weight is dequantized inside our Triton kernel
(kernels/triton_fp8_gemv.py) and multiplied by the model-dtype activations. Above that, on CUDA,
activations are quantized per token and the GEMM is `torch._scaled_mm` (row-wise scales) for
per-channel weights or our Triton block GEMM for block weights. Elsewhere the reference
(quantize activations, dequantize both, matmul in float32) at every M: each row's result then
depends on that row alone, so a CPU run is batch-invariant (the engine tests compare a batched
run with a one-sequence one token for token); the GPU gives that up at M = SMALL_M for decode
speed, as GPU GEMMs already do by picking tiles by M. `fp8_weight_only_ref` is what the small-M
kernel is tested against. `fp8_silu_mul_linear` is a gated MLP's down projection: above
SMALL_M on CUDA with per-token activations, `silu(gate) * up` is quantized in the same kernel
that computes it (one pass over the gate/up product, no model-dtype intermediate); likewise
the RMSNorm before a per-token layer may hand it `Fp8Rows` (see `takes_fp8_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.backend import fusion_enabled, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
SMALL_M = 16  # up to this many rows: weight-only (kernels/triton_fp8_gemv.py's MAX_M)


class Fp8Rows(NamedTuple):
    """Activations already quantized per token, by the RMSNorm before the layer (kernels/
    triton_norm.py): what `fp8_linear`'s large-M path would make of the model-dtype rows."""

    q: torch.Tensor  # [M, K] fp8
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the model dtype, which the linear layer returns


Normed = torch.Tensor | Fp8Rows  # the normed rows: model dtype, or FP8 for an FP8 layer


def require_fp8_device(device: torch.device | str, what: str) -> None:
    """FP8 needs compute capability 8.9+ (Ada, Hopper) on NVIDIA GPUs; the CPU reference runs
    anywhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{what} needs a GPU with FP8 support (compute capability 8.9+: Ada, Hopper or "
            f"newer); {name} is {major}.{minor}"
        )


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K] -> (fp8 [M, K], float32 scales [M, 1] or [M, ceil(K/group)])`, symmetric."""
    m, k = x.shape
    if group is None:
        amax = x.abs().amax(dim=1, keepdim=True).float()  # [M, 1]
        scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp_min(_MIN_SCALE)  # [M, G]
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    """`fp8 [M, K]` with `[M, 1]` scales (group None) or `[M, ceil(K/group)]` -> float32."""
    if group is None:
        return q.float() * scale.float()
    return q.float() * scale.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]


def expand_block_scales(scale: torch.Tensor, block_rows: int, num_rows: int) -> torch.Tensor:
    """Checkpoint block scales `[ceil(N/bn), ceil(K/bk)]` -> row-expanded `[num_rows, ...]`."""
    return scale.float().repeat_interleave(block_rows, dim=0)[:num_rows]


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, K/G] float32
    bias: torch.Tensor | None,
    group: int | None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """The reference: quantize activations as the fast path does, dequantize both, matmul."""
    xq, x_scale = quantize_rows(x, group)
    return fp8_rows_ref(xq, x_scale, weight, weight_scale, bias, group, x.dtype)


def fp8_rows_ref(
    xq: torch.Tensor,  # [M, K] fp8
    x_scale: torch.Tensor,  # [M, 1] or [M, K/G] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, K/G] float32
    bias: torch.Tensor | None,
    group: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in dtype
    """The reference matmul of rows quantized already: dequantize both, matmul in float32."""
    out = dequantize(xq, x_scale, group) @ dequantize(weight, weight_scale, group).t()
    if bias is not None:
        out += bias.float()
    return out.to(dtype)


def fp8_weight_only_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, K/G] float32
    bias: torch.Tensor | None,
    group: int | None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """The small-M reference: dequantize the weight, matmul with unquantized activations."""
    out = x.float() @ dequantize(weight, weight_scale, group).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_linear(
    x: torch.Tensor | Fp8Rows,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, K/G] float32
    bias: torch.Tensor | None = None,
    group: int | None = None,  # activation / weight column group (block weights)
) -> torch.Tensor:  # [M, N]
    if isinstance(x, Fp8Rows):  # quantized per token by the norm before (never block weights)
        if not x.q.is_cuda:
            return fp8_rows_ref(x.q, x.scale, weight, weight_scale, bias, None, x.dtype)
        out = scaled_mm_rowwise(x.q, x.scale, weight, weight_scale, x.dtype)
        return out + bias if bias is not None else out
    if not use_triton(x):
        return fp8_linear_ref(x, weight, weight_scale, bias, group)
    if x.shape[0] <= SMALL_M:
        from pagedserve.kernels.triton_fp8_gemv import triton_fp8_gemv

        return triton_fp8_gemv(x, weight, weight_scale, bias, group)
    from pagedserve.kernels.triton_fp8 import triton_quantize_rows, triton_w8a8_block_matmul

    xq, x_scale = triton_quantize_rows(x, group)
    if group is not None:
        out = triton_w8a8_block_matmul(xq, x_scale, weight, weight_scale, group, x.dtype)
    else:
        out = scaled_mm_rowwise(xq, x_scale, weight, weight_scale, x.dtype)
    return out + bias if bias is not None else out


def takes_fp8_rows(x: torch.Tensor, group: int | None) -> bool:
    """Whether `fp8_linear(x, ...)` of a per-channel layer (group None) would quantize x per token
    and run `_scaled_mm`, so that the norm producing x may quantize instead (fusion
    `norm-quant`)."""
    return (
        group is None
        and use_triton(x)
        and x.dim() == 2
        and x.shape[0] > SMALL_M
        and fusion_enabled("norm-quant")
    )


def fp8_silu_mul_linear(
    gate_up: torch.Tensor,  # [M, 2I]
    weight: torch.Tensor,  # [N, I] fp8
    weight_scale: torch.Tensor,  # [N, 1] or [N, I/G] float32
    bias: torch.Tensor | None = None,
    group: int | None = None,
) -> torch.Tensor:  # [M, N]
    """`fp8_linear(silu_and_mul(gate_up), ...)`, fused where that pays (see the module doc)."""
    if group is not None or gate_up.shape[0] <= SMALL_M or not use_triton(gate_up):
        return fp8_linear(silu_and_mul(gate_up), weight, weight_scale, bias, group)
    from pagedserve.kernels.triton_fp8 import triton_silu_mul_quantize

    xq, x_scale = triton_silu_mul_quantize(gate_up)
    out = scaled_mm_rowwise(xq, x_scale, weight, weight_scale, gate_up.dtype)
    return out + bias if bias is not None else out


def scaled_mm_rowwise(
    xq: torch.Tensor,  # [M, K] fp8
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """`torch._scaled_mm` with one scale per row of each operand (bf16 out, cast if needed).
    Fast accumulation (Hopper's FP8 tensor cores add into their own reduced-precision accumulator
    rather than promoting to float32 every few K steps, as vLLM's CUTLASS FP8 kernels do) unless
    `PAGEDSERVE_DISABLE_FUSIONS=fp8-fast-accum`."""
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=torch.bfloat16,
        use_fast_accum=fusion_enabled("fp8-fast-accum"),
    )  # fmt: skip
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
