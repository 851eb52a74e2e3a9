"""RMSNorm, optionally fused with the residual add before it, in Triton.

One program normalizes one row of `H` features held whole in registers (`BLOCK = next_pow2(H)`,
4096 for Llama-3-8B): the row is read once, reduced in float32, and written once, instead of the
reference's several passes over memory. The rounding follows the reference step by step (the add
in the model dtype, the normalized value cast back to it before the weight multiply) so the fast
path matches it to the last bit in most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
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
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:  # [..., H] -> [N, H], unit col stride
    x2 = x.reshape(-1, hidden)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def triton_rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(x, weight, eps)`, or with a residual `(rms_norm(x + residual), x + residual)`."""
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
    x2 = _rows(x, hidden)
    r2 = _rows(residual, hidden) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r_out,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), r_out.view(x.shape)
