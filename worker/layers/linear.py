"""Tensor-parallel layers, Megatron style, each with per-parameter weight loaders.

Column-parallel layers split output features across TP ranks (no communication); row-parallel
layers split input features and all-reduce once. Every parameter carries
`weight_loader(param, loaded_weight, shard_id=None)` that copies only this rank's shard.
`loaded_weight` is a torch tensor or a safetensors slice (`safe_open(...).get_slice(name)`), so
with slices no rank ever reads a full weight into memory. Each loader first checks the whole
(unsharded) checkpoint tensor's shape against the one the config gives (`expect_shape`): cutting
this rank's rows out of an oversized tensor would load another model without a word.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.activation import silu_and_mul
from pagedserve.kernels.cpu_linear import pack_weight, packed_linear
from pagedserve.kernels.linear import linear
from pagedserve.kernels.swiglu_gemm import swiglu_gemm_applies, swiglu_linear
from pagedserve.parallel.state import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.quant_linear import (
    FusedShards,
    LinearBase,
    OutPart,
    expect_shape,
    make_param,
    shape_of,
)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor parallel size {denominator}"
        )
    return numerator // denominator


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """`loaded.narrow(dim, start, length)` for a tensor or a lazily read safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(shape_of(loaded))
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def read_all(loaded: Any) -> torch.Tensor:
    """The whole of a tensor or safetensors slice (0-d ones too)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


class RowRange:
    """Rows `[start, start + length)` of a tensor or lazy slice, itself read lazily."""

    def __init__(self, loaded: Any, start: int, length: int) -> None:
        self.loaded, self.start, self.length = loaded, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *shape_of(self.loaded)[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0]
        lo = self.start + (rows.start or 0)
        hi = self.start + (self.length if rows.stop is None else rows.stop)
        return narrow(self.loaded, 0, lo, hi - lo)[(slice(None), *index[1:])]


def load_fused(
    loader: Any, param: nn.Parameter, loaded: Any, fused: FusedShards, sizes: list[int]
) -> None:
    """Hand each part of a fused checkpoint tensor (full, unsharded `sizes` rows) to `loader`."""
    expect_shape(loaded, (sum(sizes), *param.shape[1:]))
    start = 0
    for shard_id, size in zip(fused.ids, sizes, strict=True):
        loader(param, RowRange(loaded, start, size), shard_id)
        start += size


def load_full(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Loader for replicated parameters (norms, biases of row-parallel layers)."""
    assert shard_id is None
    expect_shape(loaded, tuple(param.shape))
    _copy(param.data, read_all(loaded))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"weight shape {tuple(src.shape)} does not fit parameter {tuple(dst.shape)}"
        )
    dst.copy_(src)


_param = make_param


class ColumnParallelLinear(LinearBase):
    """`y = x W^T + b` with W's rows (output features) split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        quant: Fp8Scheme | None = None,
    ) -> None:
        super().__init__()
        self.output_size_per_rank = divide(output_size, tp_size(), "output size")
        self.gather_output = gather_output
        self._init_weight(self.output_size_per_rank, input_size, quant)
        self.bias = _param(self.output_size_per_rank, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert shard_id is None
        expect_shape(loaded, self.full_shape(param, shard_id))
        size = param.shape[0]
        _copy(param.data, narrow(loaded, 0, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp] or [T, out]
        y = self.lora_matmul(x, self.bias)
        if y is None:
            y = self.matmul(x, self.bias)
            if self.lora is not None:
                self.lora.add(x, y)
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices (gate and up) in one matmul; `shard_id` is the index of the
    checkpoint matrix being loaded. Each rank holds its slice of every part, parts concatenated."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant: Fp8Scheme | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        self.part_sizes = [divide(s, tp_size(), "intermediate size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, quant=quant)
        for p in self.parameters():
            p.shard_ids = tuple(range(len(output_sizes)))  # type: ignore[attr-defined]

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu_and_mul(self(x))` from one GEMM with the activation in its epilogue, where that
        runs (kernels/swiglu_gemm.py: prompt-sized x on Hopper, model-dtype weights, no bias),
        or with adapter rows above GEMV sizes, the GEMM then the activation with the deltas in
        its loads; None elsewhere, and the caller applies the activation its own way."""
        if self.bias is not None or self.weight_scale is not None or self.weight is None:
            return None
        if self.lora is not None and self.lora.active:  # the deltas inside the activation
            return self.lora.swiglu(x, lambda: self.matmul(x, None))
        if not swiglu_gemm_applies(x, self.weight):
            return None
        return swiglu_linear(x, self.weight)

    def part_rows(self, param: nn.Parameter, shard_id: Any) -> int:
        return self.output_sizes[shard_id]

    def lora_parts(self) -> list[OutPart]:
        offsets = [sum(self.part_sizes[:i]) for i in range(len(self.part_sizes))]
        return [
            OutPart(offset, size, full, tp_rank() * size)
            for offset, size, full in zip(offsets, self.part_sizes, self.output_sizes, strict=True)
        ]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if isinstance(shard_id, FusedShards):
            load_fused(self.weight_loader, param, loaded, shard_id, self.output_sizes)
            return
        expect_shape(loaded, self.full_shape(param, shard_id))
        size = self.part_sizes[shard_id]
        offset = sum(self.part_sizes[:shard_id])
        _copy(param.data.narrow(0, offset, size), narrow(loaded, 0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads split across ranks; kv heads split too,
    or replicated when there are fewer kv heads than ranks (each rank keeps the one it needs)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant: Fp8Scheme | None = None,
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "number of key/value heads")
            self.kv_head_start = tp_rank() * self.num_kv_heads
        else:
            divide(tp, num_kv_heads, "(replicated kv heads) tp size vs kv heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank() // (tp // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = (self.q_size + 2 * self.kv_size) * tp
        super().__init__(hidden_size, out, bias, quant=quant)
        for p in self.parameters():
            p.shard_ids = ("q", "k", "v")  # type: ignore[attr-defined]

    def part_rows(self, param: nn.Parameter, shard_id: Any) -> int:
        return self.full_sizes[("q", "k", "v").index(shard_id)]

    def lora_parts(self) -> list[OutPart]:
        q, kv, full_q, full_kv = self.q_size, self.kv_size, self.full_sizes[0], self.full_sizes[1]
        kv_start = self.kv_head_start * self.head_dim
        return [
            OutPart(0, q, full_q, tp_rank() * q),
            OutPart(q, kv, full_kv, kv_start),
            OutPart(q + kv, kv, full_kv, kv_start),
        ]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if isinstance(shard_id, FusedShards):
            load_fused(self.weight_loader, param, loaded, shard_id, self.full_sizes)
            return
        expect_shape(loaded, self.full_shape(param, shard_id))
        if shard_id == "q":
            dst = param.data.narrow(0, 0, self.q_size)
            start = tp_rank() * self.q_size
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            assert shard_id in ("k", "v"), shard_id
            dst = param.data.narrow(0, offset, self.kv_size)
            start = self.kv_head_start * self.head_dim
        _copy(dst, narrow(loaded, 0, start, dst.shape[0]))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[T, q + 2kv] -> [T, q], [T, kv], [T, kv]` (this rank's heads)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """`y = x W^T + b` with W's columns (input features) split across ranks: each rank computes a
    partial sum from its slice of x; one all-reduce adds them; the bias is added once after."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        quant: Fp8Scheme | None = None,
    ) -> None:
        super().__init__()
        self.input_size_per_rank = divide(input_size, tp_size(), "input size")
        self.reduce_results = reduce_results
        block = quant.block if quant is not None else None
        if block is not None and tp_size() > 1 and self.input_size_per_rank % block[1]:
            raise ValueError(
                f"FP8 block scales: this rank's {self.input_size_per_rank} input columns are not "
                f"a multiple of the {block[1]}-column block (use a smaller --tp)"
            )
        self._init_weight(output_size, self.input_size_per_rank, quant)
        self.bias = _param(output_size, loader=load_full) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert shard_id is None
        expect_shape(loaded, self.full_shape(param, shard_id))
        size = param.shape[1]
        _copy(param.data, narrow(loaded, 1, tp_rank() * size, size))

    def lora_parts(self) -> list[OutPart]:
        rows = self.weight_shape[0]
        return [OutPart(0, rows, rows, 0)]

    def lora_in_shard(self) -> tuple[int, int]:
        return tp_rank() * self.input_size_per_rank, self.input_size_per_rank

    def full_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """Rows whole, columns (block-scale columns too: they align) split across ranks."""
        return (param.shape[0], param.shape[1] * tp_size())

    def shard_scale(self, param: nn.Parameter, scale: torch.Tensor, shard_id: Any) -> None:
        """Rows are not split here; block scales split by column blocks, which must align."""
        assert shard_id is None and self.quant is not None
        if self.quant.block is None:
            _copy(param.data, scale)
            return
        _copy(param.data, narrow(scale, 1, tp_rank() * param.shape[1], param.shape[1]))

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """[T, in / tp] -> [T, out]; `gated`: x is [T, 2 in / tp], gate | up, activated here
        (before the matmul when adapters need the activated rows too)."""
        y = self.lora_matmul(x, None, gated)  # with the deltas, a partial sum like x W^T
        if y is None:
            y = self._matmul_then_lora(x, gated)
        if self.reduce_results:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def _matmul_then_lora(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        lora = self.lora if self.lora is not None and self.lora.active else None
        if lora is not None and gated and not lora.fuses_gate(x):
            x, gated = silu_and_mul(x), False  # the adapters read the activated rows too
        y = self.matmul(x, None, gated)
        return lora.add(x, y, gated) if lora is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in contiguous ranges across ranks: each rank looks up
    the ids it owns, zeros the rest, and an all-reduce assembles the rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.vocab_per_rank = divide(num_embeddings, tp_size(), "vocab size")
        self.vocab_start = tp_rank() * self.vocab_per_rank
        self.weight = _param(self.vocab_per_rank, embedding_dim, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert shard_id is None
        expect_shape(loaded, (self.num_embeddings, param.shape[1]))
        _copy(param.data, narrow(loaded, 0, self.vocab_start, self.vocab_per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split like the embedding so the two can share one
    parameter when embeddings are tied; logits are all-gathered so every rank holds all of them."""

    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU), once loaded
    tied = False

    def forward(
        self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:  # [N, H] -> [N, V] in out_dtype (None: hidden's)
        if self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
            return tp_all_gather(logits if out_dtype is None else logits.to(out_dtype), dim=-1)
        return tp_all_gather(linear(hidden, self.weight, None, out_dtype), dim=-1)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def after_loading(self) -> None:
        """On a CPU, the weight packed for the matmul; the plain copy stays only when tied (the
        embedding reads it)."""
        self.packed = pack_weight(self.weight)
        if self.packed is not None and not self.tied:
            self.weight = None
