"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`: the gate and up halves of a merged matmul."""
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
        return silu_and_mul(x)
