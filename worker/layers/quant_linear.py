"""The weight of a parallel linear layer, plain or FP8, and its matmul.

`LinearBase` owns `weight` (and `weight_scale` under an FP8 scheme) for the column- and
row-parallel layers in linear.py, which only say how a checkpoint tensor is sharded
(`weight_loader`). FP8 weights keep kernels/fp8.py's layout: fp8 `[N, K]` with float32 scales
`[N, 1]` or, for block checkpoints, `[N, K/G]` row-expanded. A checkpoint's scale is brought to
that layout over its whole part first (a per-tensor scale broadcast to rows, block rows repeated),
then sharded with the same loader as its weight, so TP shards scales exactly like weights.

With `--quantization fp8` on a plain checkpoint the weight loads in the model dtype and
`after_loading` replaces it by fp8 with per-channel scales.

`matmul` of an FP8 layer is `fp8_linear`: on a GPU, up to `SMALL_M` rows (decode batches) the
weight-only Triton kernel (no activation quantization; CUDA-graph safe), above that per-token
activation quantization and `torch._scaled_mm` (or the block GEMM). With `gated` it is
the same for a gated MLP's down projection, silu(gate) * up fused into the quantization. On a
CPU, `after_loading` packs a float32/bfloat16 weight in oneDNN's layout (kernels/cpu_linear.py)
and drops the plain copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.cpu_linear import pack_weight, packed_linear
from pagedserve.kernels.fp8 import (
    FP8,
    expand_block_scales,
    fp8_linear,
    fp8_silu_mul_linear,
    quantize_rows,
    takes_fp8_rows,
)
from pagedserve.kernels.linear import gated_linear, linear
from pagedserve.parallel.state import tp_rank, tp_size
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.lora.layer import LoRASlots, OutPart


@dataclass(frozen=True)
class FusedShards:
    """A shard id for a checkpoint tensor that is several parts concatenated along dim 0 (Phi-3's
    `qkv_proj`, `gate_up_proj`): each part loads as if it were its own tensor with its own id."""

    ids: tuple[Any, ...]


def shape_of(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def expect_shape(loaded: Any, expected: tuple[int, ...]) -> None:
    """Refuse a checkpoint tensor (or fused part) whose full, unsharded shape is not the one the
    config gives (the loader adds the tensor's name)."""
    shape = shape_of(loaded)
    if shape != tuple(expected):
        raise ValueError(f"shape {shape} does not match the model's {tuple(expected)}")


def make_param(
    *shape: int, loader: Any, shard_ids: tuple[Any, ...] = (None,), dtype: torch.dtype | None = None
) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.shard_ids = shard_ids  # type: ignore[attr-defined]  # what the loader must see to be complete
    return p


class LinearBase(nn.Module):
    """`weight [out_per_rank, in_per_rank]` (+ FP8 scales) and `matmul(x, bias)`."""

    def _init_weight(self, rows: int, cols: int, quant: Fp8Scheme | None) -> None:
        self.quant = quant
        # LoRA slots (worker/lora/layer.py), attached after building when --enable-lora
        self.lora: LoRASlots | None = None
        fp8 = quant is not None and quant.serialized
        self.weight_shape = (rows, cols)  # this rank's, kept: the weight may go to oneDNN's layout
        self.weight = make_param(rows, cols, loader=self.weight_loader, dtype=FP8 if fp8 else None)
        self.weight_scale = None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU), once loaded
        if fp8:
            scale_cols = 1 if quant.block is None else -(-cols // quant.block[1])
            self.weight_scale = make_param(
                rows, scale_cols, loader=self._scale_loader, dtype=torch.float32
            )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def _scale_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A checkpoint scale -> row layout over its whole part -> this rank's shard. Block
        scales are checked before their rows are repeated (a cut would hide extra rows)."""
        scale = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).float()
        assert self.quant is not None
        rows, cols = self.full_shape(param, shard_id)
        if self.quant.block is not None:
            expect_shape(scale, (-(-rows // self.quant.block[0]), cols))
            scale = expand_block_scales(scale, self.quant.block[0], rows)
        elif scale.numel() == 1:  # per tensor
            scale = scale.reshape(1, 1).expand(rows, 1)
        else:  # per channel [out] or [out, 1]: the shard's loader checks the rows
            scale = scale.reshape(-1, 1)
        self.shard_scale(param, scale, shard_id)

    def full_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """The whole (unsharded) checkpoint shape of `param`'s part `shard_id` (a weight, bias
        or scale); here column-parallel: rows split across ranks, a fused tensor's parts
        stacked."""
        if isinstance(shard_id, FusedShards):
            return (sum(self.part_rows(param, i) for i in shard_id.ids), *param.shape[1:])
        return (self.part_rows(param, shard_id), *param.shape[1:])

    def part_rows(self, param: nn.Parameter, shard_id: Any) -> int:
        """Rows of the whole checkpoint part `shard_id` (layers of several parts say which)."""
        return param.shape[0] * tp_size()

    def shard_scale(self, param: nn.Parameter, scale: torch.Tensor, shard_id: Any) -> None:
        """Column-parallel layers shard scale rows exactly as weight rows."""
        self.weight_loader(param, scale, shard_id)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
    ) -> torch.Tensor:
        """`x W^T + b`; `gated`: x is a merged gate/up output and `silu_and_mul(x)` goes in
        (fused into the GEMV, or into an FP8 layer's input quantization)."""
        if self.packed is not None:
            return packed_linear(silu_and_mul(x) if gated else x, self.packed, bias)
        if self.weight_scale is None:
            return (gated_linear if gated else linear)(x, self.weight, bias)
        group = self.quant.act_group if self.quant is not None else None
        if gated:
            return fp8_silu_mul_linear(x, self.weight, self.weight_scale, bias, group)
        return fp8_linear(x, self.weight, self.weight_scale, bias, group)

    def lora_matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
    ) -> torch.Tensor | None:
        """`matmul` plus the step's adapter deltas in one pass where LoRA's decode-size path
        takes this model-dtype weight (`LoRASlots.linear`); None elsewhere."""
        if self.lora is None or not self.lora.active or self.weight is None:
            return None
        if self.packed is not None or self.weight_scale is not None:
            return None
        return self.lora.linear(x, self.weight, bias, gated)

    def lora_parts(self) -> list[OutPart]:
        """This rank's output as LoRA parts (one here; merged layers list each)."""
        rows = self.weight_shape[0]
        return [OutPart(0, rows, rows * tp_size(), tp_rank() * rows)]

    def lora_in_shard(self) -> tuple[int, int]:
        """(start, size) of the columns of a LoRA A this rank keeps: all, column-parallel."""
        return 0, self.weight_shape[1]

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether the RMSNorm making x may hand it over quantized per token (`Fp8Rows`): what
        `matmul` would do with x itself (kernels/fp8.py)."""
        if self.weight_scale is None or self.quant is None:
            return False
        return takes_fp8_rows(x, self.quant.act_group)

    def after_loading(self) -> None:
        """Load-time quantization: the model-dtype weight -> fp8 + per-channel scales; on a CPU,
        a plain weight packed for oneDNN instead (the plain copy is freed)."""
        if self.quant is None:
            self.packed = pack_weight(self.weight)
            if self.packed is not None:
                self.weight = None
            return
        if self.quant.serialized:
            return
        with torch.no_grad():
            weight, scale = quantize_rows(self.weight.data)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
