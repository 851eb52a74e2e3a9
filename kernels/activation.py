"""Gated activations: `x [..., 2I] -> act(gate) * up`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`: the gate and up halves of a merged matmul.

    Triton on CUDA; `silu_and_mul_ref` elsewhere (and as the test oracle)."""
    if use_triton(x):
        from pagedserve.kernels.triton_activation import triton_silu_and_mul

        return triton_silu_and_mul(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:]`: Gemma's GeGLU (`gelu_pytorch_tanh`)."""
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.gelu(gate, approximate="tanh") * up
