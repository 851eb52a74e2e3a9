"""RMSNorm with an optional fused residual add, computed in float32 like transformers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels.backend import use_triton
from pagedserve.kernels.fp8 import Fp8Rows

Normed = torch.Tensor | Fp8Rows  # the normed rows: model dtype, or FP8 for an FP8 layer


class RMSNorm(nn.Module):
    """`forward(x)` returns the normed x; `forward(x, residual)` adds first, returns both.

    The add happens in the model dtype (as transformers does), so the new residual is bit-equal to
    the unfused `x + residual`; only the normalization runs in float32.

    `fp8_consumer`, set by a decoder layer whose next linear layer is FP8 with per-token
    activation scales, is that layer's `takes_fp8_rows`: where it says yes for x, the Triton
    kernel returns the normed rows quantized (`Fp8Rows`) instead of in the model dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fp8_consumer: Callable[[torch.Tensor], bool] | None = None

    def forward(
        self,
        x: torch.Tensor,  # [..., H]
        residual: torch.Tensor | None = None,  # [..., H]
    ) -> Normed | tuple[Normed, torch.Tensor]:
        if use_triton(x):
            from pagedserve.kernels.triton_norm import triton_rms_norm

            weight = self.kernel_weight()
            quantize = (
                self.fp8_consumer is not None and weight.dtype == x.dtype and self.fp8_consumer(x)
            )
            return triton_rms_norm(x, weight, self.eps, residual, quantize)
        if residual is not None:
            x = x + residual
            return self.reference(x), x
        return self.reference(x)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the Triton kernel multiplies by."""
        return self.weight

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        norm = _fused_rms_norm if x.dtype == torch.float32 else rms_norm
        return norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm: `weight * (x / rms(x))`, the statistics in float32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, `(1 + w) * x / rms(x)`, and
    the multiply runs in float32 before the cast (transformers' Gemma order). On CUDA the Llama
    kernel runs with `1 + w`, which rounds the normalized value to the model dtype first."""

    def kernel_weight(self) -> torch.Tensor:
        return 1.0 + self.weight

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's one-op RMSNorm: the same float32 arithmetic as `rms_norm` for float32 inputs, in
    one dispatch instead of seven (host time is most of a small model's step on a CPU)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
