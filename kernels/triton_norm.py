"""RMSNorm, optionally fused with the residual add before it, in Triton.

One program normalizes one row of `H` features held whole in registers (`BLOCK = next_pow2(H)`,
4096 for Llama-3-8B): the row is read once, reduced in float32, and written once, instead of the
reference's several passes over memory. The rounding follows the reference step by step (the add
in the model dtype, the normalized value cast back to it before the weight multiply) so the fast
path matches it to the last bit in most elements.

`quantize=True` (an FP8 linear layer with per-token activation scales comes next) writes the
normalized row as float8_e4m3fn with one float32 scale instead of in the model dtype: the same
values `triton_quantize_rows` would make of the model-dtype output (it is rounded to the model
dtype first), without writing that output and reading it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import FP8, Fp8Rows, Normed
from pagedserve.kernels.triton_fp8 import quantize_row


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds like torch's
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = normed * w
    if QUANTIZE:  # triton_fp8's per-token quantization of the model-dtype output
        q, scale = quantize_row(y.to(x.dtype).to(tl.float32))
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:  # [..., H] -> [N, H], unit col stride
    x2 = x.reshape(-1, hidden)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def triton_rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    quantize: bool = False,
) -> Normed | tuple[Normed, torch.Tensor]:
    """`rms_norm(x, weight, eps)`, or with a residual `(rms_norm(x + residual), x + residual)`;
    with `quantize` the normed part is `Fp8Rows` of a 2-D x (see the module doc)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if weight.stride(0) != 1 or hidden > 65536:
        raise ValueError(f"weight must be contiguous and hidden <= 65536 (got {hidden})")
    if quantize and (x.dim() != 2 or weight.dtype != x.dtype):
        raise ValueError("the quantizing RMSNorm takes [T, H] rows and a weight of their dtype")
    x2 = _rows(x, hidden)
    r2 = _rows(residual, hidden) if residual is not None else x2
    out_dtype = FP8 if quantize else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r_out = torch.empty_like(x2) if residual is not None else x2
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if quantize else out
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r_out, scale,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    normed = Fp8Rows(out, scale, x.dtype) if quantize else out.view(x.shape)
    return normed if residual is None else (normed, r_out.view(x.shape))
