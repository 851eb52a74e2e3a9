"""Routed experts from a block-FP8 checkpoint (HF `quant_method: fp8`, `weight_block_size`):
each expert's `gate_proj` / `up_proj` / `down_proj` is fp8 with a `weight_scale_inv` per block
(a dequantization scale despite its name: `w = w_fp8 * scale`), as DeepSeek-V3, Qwen3-Next-FP8
and Qwen3.5-MoE-FP8 publish them.

`Fp8BlockMoE` is `FusedMoE` whose stacked weights load fp8 (no transient model-dtype copies:
22.5 GB per layer at DeepSeek-V3's shapes) plus each expert's whole block-scale grid. After
loading they stay FP8 on a GPU, this rank's block scales stacked as its weights are
(`stack_expert_scales`, for the grouped Triton kernel, kernels/triton_moe.py, which scales each
tile by its block), or are dequantized to the model dtype elsewhere (`dequantize_experts`).
Without an FP8 scheme it is plain `FusedMoE`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.backend import triton_available
from pagedserve.kernels.fp8 import FP8
from pagedserve.kernels.moe import fused_moe, select_experts
from pagedserve.parallel.state import tp_all_reduce, tp_rank
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.linear import _param, expect_shape, read_all
from pagedserve.worker.layers.moe import PROJECTIONS, FusedMoE

# a routed expert's block scale: `...mlp.experts.<e>.<proj>.weight_scale_inv`
EXPERT_SCALE = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight_scale_inv$")
EXPERT_PROJECTION = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_scale_param(name: str) -> tuple[str, Any] | None:
    """(our stacked scale parameter, (expert, projection)) for an expert's block-scale tensor
    `<prefix>.experts.<e>.<proj>.weight_scale_inv`; None for any other name."""
    scale = EXPERT_SCALE.search(name)
    if scale is None:
        return None
    projection = EXPERT_PROJECTION[scale[2]]
    return f"{name[: scale.start()]}.{projection}_weight_scale", (int(scale[1]), projection)


def expert_scale_name(param_name: str, shard_id: Any) -> str | None:
    """`expert_scale_param`'s inverse (for error messages); None if not an expert scale."""
    if not (param_name.endswith("_weight_scale") and isinstance(shard_id, tuple)):
        return None
    expert, projection = shard_id
    theirs = {v: k for k, v in EXPERT_PROJECTION.items()}[projection]
    return f"{param_name.rsplit('.', 1)[0]}.experts.{expert}.{theirs}.weight_scale_inv"


class Fp8BlockMoE(FusedMoE):
    """`FusedMoE` with fp8 experts and block scales when `quant` is a serialized FP8 scheme."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quant: Fp8Scheme | None,
        owner: str,
    ) -> None:
        fp8 = quant is not None and quant.serialized
        with torch.device("meta") if fp8 else contextlib.nullcontext():
            super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize)
        self.dtype = torch.get_default_dtype()  # the model dtype the experts run in
        self.block: tuple[int, int] | None = None
        self.w13_scale: torch.Tensor | None = None  # FP8 experts kept (stack_expert_scales)
        self.w2_scale: torch.Tensor | None = None
        if fp8:
            if quant.block is None:
                raise ValueError(f"{owner}: FP8 experts need block scales (weight_block_size)")
            self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # not on meta
            self.block = quant.block
            self._fp8_expert_params(num_experts, hidden_size, intermediate_size)

    def _fp8_expert_params(self, num_experts: int, hidden: int, inter: int) -> None:
        """fp8 stacked weights (this rank's shard) and each expert's whole block-scale grid."""
        w13, w2 = self.w13_weight, self.w2_weight
        self.w13_weight = _param(*w13.shape, loader=self.weight_loader, dtype=FP8,
                                 shard_ids=w13.shard_ids)  # fmt: skip
        self.w2_weight = _param(*w2.shape, loader=self.weight_loader, dtype=FP8,
                                shard_ids=w2.shard_ids)  # fmt: skip
        b0, b1 = self.block  # type: ignore[misc]
        for proj in PROJECTIONS:
            rows, cols = (hidden, inter) if proj == "w2" else (inter, hidden)
            shape = (num_experts, -(-rows // b0), -(-cols // b1))
            ids = tuple((e, proj) for e in range(num_experts))
            scale = _param(*shape, loader=self._scale_loader, shard_ids=ids, dtype=torch.float32)
            setattr(self, f"{proj}_weight_scale", scale)

    def _scale_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expect_shape(loaded, tuple(param.shape[1:]))
        param.data[shard_id[0]].copy_(read_all(loaded))

    def after_loading(self) -> None:
        if self.block is None:
            return
        b0, b1 = self.block
        on_gpu = self.w13_weight.is_cuda and triton_available()
        if on_gpu and b0 == b1 >= 16 and b0 & (b0 - 1) == 0 and self.inter_per_rank % b0 == 0:
            self.stack_expert_scales()
        else:
            self.dequantize_experts()

    def stack_expert_scales(self) -> None:
        """Keep the experts in FP8 for the grouped kernel (kernels/triton_moe.py): this rank's
        block scales stacked as its weights are, `w13_scale [E, 2I/tp/B, H/B]` (w1's, then
        w3's) and `w2_scale [E, H/B, I/tp/B]`."""
        b = self.block[0]  # type: ignore[index]
        mine = slice(
            tp_rank() * self.inter_per_rank // b, (tp_rank() + 1) * self.inter_per_rank // b
        )
        scales = {p: getattr(self, f"{p}_weight_scale").data for p in PROJECTIONS}
        self.w13_scale = torch.cat([scales["w1"][:, mine], scales["w3"][:, mine]], 1).contiguous()
        self.w2_scale = scales["w2"][:, :, mine].contiguous()
        for proj in PROJECTIONS:
            delattr(self, f"{proj}_weight_scale")
        self.block = None

    def dequantize_experts(self) -> None:
        """fp8 experts -> the model dtype, `w = w_fp8 * scale` of each element's block, one
        expert at a time (this rank's rows of w1/w3, columns of w2)."""
        size, start = self.inter_per_rank, tp_rank() * self.inter_per_rank
        b0, b1 = self.block  # type: ignore[misc]
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        dev = w13.device
        mine = torch.arange(start, start + size, device=dev)  # global intermediate indices
        cols = torch.arange(w13.shape[2], device=dev)  # hidden
        new13 = torch.empty(w13.shape, dtype=self.dtype, device=dev)
        new2 = torch.empty(w2.shape, dtype=self.dtype, device=dev)
        scales = {p: getattr(self, f"{p}_weight_scale").data for p in PROJECTIONS}
        for e in range(w13.shape[0]):
            for offset, proj in ((0, "w1"), (size, "w3")):
                s = scales[proj][e][mine // b0][:, cols // b1]  # [I/tp, H]
                part = w13[e, offset : offset + size].float() * s
                new13[e, offset : offset + size] = part.to(self.dtype)
            s = scales["w2"][e][cols // b0][:, mine // b1]  # [H, I/tp]
            new2[e] = (w2[e].float() * s).to(self.dtype)
        self.w13_weight = nn.Parameter(new13, requires_grad=False)
        self.w2_weight = nn.Parameter(new2, requires_grad=False)
        for proj in PROJECTIONS:
            delattr(self, f"{proj}_weight_scale")
        self.block = None

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the experts' output (before the all-reduce): `[T, H]`."""
        if self.w13_scale is None:
            return fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        from pagedserve.kernels.triton_moe import triton_fused_moe

        return triton_fused_moe(
            x, self.w13_weight, self.w2_weight, weights, ids, w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return tp_all_reduce(self.routed(x, weights, ids))
