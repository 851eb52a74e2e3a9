"""SiLU-and-mul (`[T, 2I] -> [T, I]`), in Triton.

The reference reads the gate and up halves, writes silu(gate), reads it back and writes the
product; this kernel reads each input element once and writes each output once. Program
(row, column block) handles `BLOCK` outputs of one row. Rounding follows the reference: silu is
rounded to the model dtype before the multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_mul(gate, up):
    """`silu(gate) * up` in float32, silu rounded to the inputs' dtype first (as the reference)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return silu * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    out = silu_mul(gate, up)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """`silu_and_mul(x)`: the gate half is x[..., :I], the up half x[..., I:]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} must be even (gate and up halves)")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)
