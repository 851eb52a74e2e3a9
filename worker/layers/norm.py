"""RMSNorm layers: a residual add fused in, Triton on CUDA, the reference functions of
kernels/norm.py elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels.backend import use_triton
from pagedserve.kernels.fp8 import Normed
from pagedserve.kernels.norm import fused_rms_norm, gemma_rms_norm, rms_norm


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
        norm = fused_rms_norm if x.dtype == torch.float32 else rms_norm
        return norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, `(1 + w) * x / rms(x)`, and
    the multiply runs in float32 before the cast (transformers' Gemma order). On CUDA the Llama
    kernel runs with `1 + w`, which rounds the normalized value to the model dtype first."""

    def kernel_weight(self) -> torch.Tensor:
        return 1.0 + self.weight

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)
