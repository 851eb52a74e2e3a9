"""RMSNorm's torch references, computed in float32 like transformers (the layers, with the fused
residual add and the Triton kernel, are worker/layers/norm.py)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm: `weight * (x / rms(x))`, the statistics in float32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's one-op RMSNorm: the same float32 arithmetic as `rms_norm` for float32 inputs, in
    one dispatch instead of seven (host time is most of a small model's step on a CPU)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
