"""Activation layers over kernels/activation.py's functions."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
        return silu_and_mul(x)
