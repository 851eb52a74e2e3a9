"""gpt-oss's MoE block: a biased top-k router and tensor-parallel experts with biases
(kernels/gpt_oss_moe.py computes them; on CUDA the grouped kernel of kernels/triton_moe.py with
its bias and clamped SwiGLU, or for a few tokens the two GEMVs of kernels/triton_moe_decode.py:
no host sync, CUDA-graph safe).

Checkpoint tensors per layer, under `mlp.experts.`, in one of two forms:
- plain (transformers' `save_pretrained` of a dequantized model): `gate_up_proj [E, H, 2I]` and
  `down_proj [E, I, H]` (input dimension first);
- MXFP4 (the released checkpoints, `quant_method: mxfp4`): `gate_up_proj_blocks [E, 2I, H/32, 16]`
  with `gate_up_proj_scales [E, 2I, H/32]`, `down_proj_blocks [E, H, I/32, 16]` with
  `down_proj_scales`: dequantized at load (kernels/mxfp4.py) once both halves have arrived;
  with `PAGEDSERVE_MXFP4_EXPERTS=packed` on a CUDA device, kept as stored (`w13_weight` /
  `w2_weight` hold the blocks, buffers `w13_scales` / `w2_scales` the scales; the kernels
  decode them, kernels/triton_moe_mxfp4.py: a quarter of bf16's bytes);
plus `gate_up_proj_bias [E, 2I]` and `down_proj_bias [E, H]`. Gate and up rows interleave (gate
of unit i at row 2i, up at 2i + 1), so rank r's units `[r I/tp, (r + 1) I/tp)` are one contiguous
range of 2I/tp rows; the loader reads that range and splits it into our gate | up halves.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pagedserve import settings
from pagedserve.kernels.backend import triton_available, use_triton
from pagedserve.kernels.gpt_oss_moe import (
    clamped_swiglu,
    down_bias_sum,
    gpt_oss_experts_ref,
    route,
)
from pagedserve.kernels.mxfp4 import BLOCK, DUMMY_EXPONENT, dequantize_mxfp4
from pagedserve.parallel.state import tp_all_reduce, tp_rank, tp_size
from pagedserve.worker.layers.linear import _copy, _param, divide, expect_shape, load_full, narrow

MXFP4_PARTS = ("blocks", "scales")


def keep_mxfp4(device: torch.device) -> bool:
    """Whether MXFP4 experts on `device` stay packed (the Triton kernels decode them): CUDA with
    Triton and `PAGEDSERVE_MXFP4_EXPERTS=packed` (opt-in: on an H100 they win ~6% at batch 1 and
    lose at larger batches to the bf16 kernels, docs/gpt-oss.md; they need a quarter of the
    memory)."""
    packed = settings.current().mxfp4_experts == "packed"
    return packed and device.type == "cuda" and triton_available()


def _split_gate_up(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up rows along `dim` -> all gate rows, then all up rows."""
    pairs = rows.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssExperts(nn.Module):
    """`w13_weight [E, 2I/tp, H]`, `w13_bias [E, 2I/tp]`, `w2_weight [E, H, I/tp]`, `w2_bias
    [E, H]` (replicated: added once, after the all-reduce). Packed MXFP4 (`self.packed_mxfp4`): the
    weights are the blocks `[E, 2I/tp, H/32, 16]`, `[E, H, I/tp/32, 16]` uint8, with the scales
    `w13_scales [E, 2I/tp, H/32]`, `w2_scales [E, H, I/tp/32]` as buffers (filled by the blocks'
    loader, shard "scales"; `--load-format dummy` draws random codes under 2^-7 scales)."""

    def __init__(self, hf: dict[str, Any], mxfp4: bool) -> None:
        super().__init__()
        num_experts, hidden = hf["num_local_experts"], hf["hidden_size"]
        self.inter = hf["intermediate_size"]
        self.inter_per_rank = divide(self.inter, tp_size(), "gpt-oss intermediate size")
        if mxfp4 and self.inter_per_rank % BLOCK:
            raise ValueError(
                f"MXFP4 experts: {self.inter_per_rank} intermediate units per rank is not a "
                f"multiple of {BLOCK} (the down projection's scale blocks); choose another "
                "--tensor-parallel-size"
            )
        self.alpha = float(hf.get("swiglu_alpha", 1.702))
        self.limit = float(hf.get("swiglu_limit", 7.0))
        shards = MXFP4_PARTS if mxfp4 else (None,)
        i_rank = self.inter_per_rank
        self.packed_mxfp4 = mxfp4 and keep_mxfp4(torch.get_default_device())
        shapes = [(num_experts, 2 * i_rank, hidden), (num_experts, hidden, i_rank)]
        if self.packed_mxfp4:  # [E, N, K] -> scales [E, N, K/32], blocks [E, N, K/32, 16]
            shapes = [(*shape[:2], shape[2] // BLOCK) for shape in shapes]
            for name, shape in zip(("w13_scales", "w2_scales"), shapes, strict=True):
                self.register_buffer(name, torch.full(shape, DUMMY_EXPONENT, dtype=torch.uint8))
            shapes = [(*shape, BLOCK // 2) for shape in shapes]
        dtype = torch.uint8 if self.packed_mxfp4 else None
        self.w13_weight = _param(*shapes[0], loader=self._load, shard_ids=shards, dtype=dtype)
        self.w2_weight = _param(*shapes[1], loader=self._load, shard_ids=shards, dtype=dtype)
        self.w13_bias = _param(num_experts, 2 * i_rank, loader=self._load_w13_bias)
        self.w2_bias = _param(num_experts, hidden, loader=load_full)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # MXFP4 halves seen so far

    def _load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        num_experts, rows, cols = param.shape[:3]
        is_w13 = param is self.w13_weight
        if self.packed_mxfp4:
            cols *= BLOCK
        if shard_id is None:  # plain: [E, in, out], the input dimension first
            full = (
                (num_experts, cols, 2 * self.inter) if is_w13 else (num_experts, self.inter, rows)
            )
            expect_shape(loaded, full)
            start = tp_rank() * (rows if is_w13 else cols)
            part = narrow(loaded, 2 if is_w13 else 1, start, rows if is_w13 else cols)
            self._store(param, part.transpose(1, 2), is_w13)
            return
        in_dim = cols if is_w13 else self.inter
        out_dim = 2 * self.inter if is_w13 else rows
        full = (num_experts, out_dim, in_dim // BLOCK)
        expect_shape(loaded, (*full, BLOCK // 2) if shard_id == "blocks" else full)
        if is_w13:  # this rank's rows
            part = narrow(loaded, 1, tp_rank() * rows, rows)
        else:  # this rank's columns: whole scale blocks
            part = narrow(loaded, 2, tp_rank() * cols // BLOCK, cols // BLOCK)
        if self.packed_mxfp4:
            scales = self.w13_scales if is_w13 else self.w2_scales
            self._store(param if shard_id == "blocks" else scales, part, is_w13)
            return
        pending = self._pending.setdefault(id(param), {})
        pending[shard_id] = part.to(param.device)
        if len(pending) == len(MXFP4_PARTS):
            del self._pending[id(param)]
            weight = dequantize_mxfp4(pending["blocks"], pending["scales"], param.dtype)
            self._store(param, weight, is_w13)

    def _store(self, param: torch.Tensor, weight: torch.Tensor, is_w13: bool) -> None:
        _copy(param.data, _split_gate_up(weight, 1) if is_w13 else weight)

    def _load_w13_bias(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expect_shape(loaded, (param.shape[0], 2 * self.inter))
        rows = param.shape[1]
        _copy(param.data, _split_gate_up(narrow(loaded, 1, tp_rank() * rows, rows), 1))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, K] float32
        ids: torch.Tensor,  # [T, K] int64
    ) -> torch.Tensor:  # [T, H]
        if self.packed_mxfp4:
            out = self._mxfp4(x, weights, ids)
        elif use_triton(x):
            out = self._triton(x, weights, ids)
        else:
            out = gpt_oss_experts_ref(
                x, self.w13_weight, self.w13_bias, self.w2_weight, weights, ids, self.alpha,
                self.limit,
            )  # fmt: skip
        out = tp_all_reduce(out)
        return out + down_bias_sum(self.w2_bias, weights, ids).to(out.dtype)

    def _triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A few tokens: two GEMVs; more: the grouped kernel, one launch per projection."""
        from pagedserve.kernels.triton_moe import triton_fused_moe
        from pagedserve.kernels.triton_moe_decode import triton_moe_decode, use_moe_decode

        if use_moe_decode(*ids.shape):
            return triton_moe_decode(
                x, self.w13_weight, self.w2_weight, weights, ids, w13_bias=self.w13_bias,
                clamp=(self.alpha, self.limit),
            )  # fmt: skip
        act = functools.partial(clamped_swiglu, alpha=self.alpha, limit=self.limit)
        return triton_fused_moe(
            x, self.w13_weight, self.w2_weight, weights, ids, w13_bias=self.w13_bias,
            activation=act,
        )  # fmt: skip

    def _mxfp4(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same two paths over the packed weights."""
        from pagedserve.kernels.triton_moe_decode import use_moe_decode
        from pagedserve.kernels.triton_moe_mxfp4 import triton_fused_moe_mxfp4
        from pagedserve.kernels.triton_moe_mxfp4_decode import triton_moe_mxfp4_decode

        w13, w2 = (self.w13_weight, self.w13_scales), (self.w2_weight, self.w2_scales)
        if use_moe_decode(*ids.shape):
            return triton_moe_mxfp4_decode(
                x, w13, w2, weights, ids, w13_bias=self.w13_bias, clamp=(self.alpha, self.limit)
            )
        act = functools.partial(clamped_swiglu, alpha=self.alpha, limit=self.limit)
        return triton_fused_moe_mxfp4(
            x, w13, w2, weights, ids, w13_bias=self.w13_bias, activation=act
        )


class GptOssMoE(nn.Module):
    """Router (`router.weight [E, H]`, `router.bias [E]`, replicated) plus experts."""

    def __init__(self, hf: dict[str, Any], mxfp4: bool) -> None:
        super().__init__()
        self.top_k = hf["num_experts_per_tok"]
        self.router = nn.Linear(hf["hidden_size"], hf["num_local_experts"], bias=True)
        self.experts = GptOssExperts(hf, mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route(self.router(x), self.top_k)
        return self.experts(x, weights, ids)
