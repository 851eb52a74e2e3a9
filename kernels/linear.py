"""The model-dtype matmul of every linear layer and the LM head: `F.linear`, except that on CUDA
a few rows (a decode batch of <= 8) take the Triton GEMV (kernels/triton_gemv.py), which reads
the weight once at full bandwidth without cuBLAS' split-K reduce kernel. The row count is a host
int, fixed per CUDA-graph bucket, so a captured graph always holds the same kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.backend import fusion_enabled, use_triton

GEMV_MAX_M = 8  # kernels/triton_gemv.py's limit, kept here so CPU runs never import triton


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        0 < x.shape[0] <= GEMV_MAX_M
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and use_triton(x)
        and fusion_enabled("gemv")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [M, K], weight [N, K] -> [M, N]."""
    if use_gemv(x, weight) and x.stride(1) == 1:
        from pagedserve.kernels.triton_gemv import triton_gemv

        return triton_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight, bias)`: x [M, 2K] (gate | up) -> [M, N]; at GEMV sizes
    the activation happens inside the GEMV's loads (one kernel instead of two)."""
    if use_gemv(x, weight) and x.stride(1) == 1 and fusion_enabled("gated-gemv"):
        from pagedserve.kernels.triton_gemv import triton_gemv

        return triton_gemv(x, weight, bias, gated=True)
    return linear(silu_and_mul(x), weight, bias)
