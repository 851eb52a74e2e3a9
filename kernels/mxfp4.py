"""MXFP4 weights (the OCP microscaling format gpt-oss's experts are stored in), dequantized.

A checkpoint stores a `[..., N, K]` weight as `*_blocks [..., N, K / 32, 16]` uint8 (two FP4
e2m1 values a byte, the low nibble first) and `*_scales [..., N, K / 32]` uint8 (one power-of-two
exponent per 32 values, biased by 127). We dequantize once at load time to the model dtype
(`w = fp4 * 2 ** (scale - 127)`, exact in bfloat16 and float32), so the experts then run as any
other stacked weights; transformers' `Mxfp4Dequantize` is the oracle its test compares against.
On CUDA the experts stay packed instead and the Triton kernels decode them
(kernels/triton_moe_mxfp4.py): this function is their reference.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# `--load-format dummy`'s scale for packed experts (2^-7): random codes then have an RMS of
# ~0.023, about the 0.02 of the other dummy weights
DUMMY_EXPONENT = 120
# e2m1 code -> value: sign bit 3, exponent bits 1-2, mantissa bit 0.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., N, G, 16] uint8
    scales: torch.Tensor,  # [..., N, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., N, G * 32] in `dtype`
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(blocks must be [..., N, G, {BLOCK // 2}], scales [..., N, G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., N, G, 32]: low nibble, high nibble, ...
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2).to(dtype)
