"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), one decoder layer's self-attention.

Projections: the query through a low-rank pair (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`;
`q_proj` when `q_lora_rank` is null), K/V through `kv_a_proj_with_mqa` into the latent `c`
(`kv_lora_rank`, normed by `kv_a_layernorm`) plus one shared rope key `k_pe`. The paged cache
keeps only `[c | k_pe]` per token (kernels/mla.py): `kv_b_proj` never runs as a layer; after
loading its weight is split per head into `W_UK` and `W_UV` (dequantized from FP8 block weights),
which decode absorbs and prefill expands with.

Tensor parallel: heads split across ranks (`q_b_proj`, `W_UK`/`W_UV` by heads, `o_proj` row
parallel); the latent projections are replicated and every rank caches the same latent, as vLLM
does for MLA. Rope: DeepSeek's checkpoints rotate interleaved pairs (`rope_interleave`, the
default); de-interleaving q_pe and k_pe first makes that the usual half-split rotation, the
layout the cache stores. YaRN's `mscale_all_dim` scales the softmax by `mscale^2`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.fp8 import dequantize
from pagedserve.kernels.mla import mla_attention, write_latent_cache
from pagedserve.kernels.rotary import RopeConfig, rope_config
from pagedserve.parallel.state import tp_size
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
    _copy,
    _param,
    divide,
    expect_shape,
    read_all,
)
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding


class ReplicatedLinear(LinearBase):
    """`y = x W^T + b`, the whole weight on every rank (MLA's small latent projections)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quant: Fp8Scheme | None = None
    ) -> None:
        super().__init__()
        self._init_weight(output_size, input_size, quant)
        self.bias = _param(output_size, loader=self.weight_loader) if bias else None

    def part_rows(self, param: nn.Parameter, shard_id: Any) -> int:
        return param.shape[0]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expect_shape(loaded, tuple(param.shape))
        _copy(param.data, read_all(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


def mla_softmax_scale(hf: dict[str, Any], rope: RopeConfig) -> float:
    """`qk_head_dim^-0.5`, times YaRN's `mscale(factor, mscale_all_dim)^2` (transformers'
    `yarn_apply_mscale`)."""
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    mscale_all_dim = rope.scaling.get("mscale_all_dim")
    factor = float(rope.scaling.get("factor") or 1.0)
    if rope.rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, hf: dict[str, Any], quant: Fp8Scheme | None) -> None:
        super().__init__()
        hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
        self.nope, self.rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim, self.rank = hf["v_head_dim"], hf["kv_lora_rank"]
        self.num_heads = divide(num_heads, tp_size(), "attention heads")
        qk_dim, eps = self.nope + self.rope, hf.get("rms_norm_eps", 1e-6)
        bias = bool(hf.get("attention_bias", False))
        q_rank = hf.get("q_lora_rank")
        if q_rank:
            self.q_a_proj = ReplicatedLinear(hidden, q_rank, bias=bias, quant=quant)
            self.q_a_layernorm = RMSNorm(q_rank, eps)
            self.q_b_proj = ColumnParallelLinear(q_rank, num_heads * qk_dim, quant=quant)
        else:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk_dim, quant=quant)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.rank + self.rope, bias=bias, quant=quant
        )
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.rank, num_heads * (self.nope + self.v_dim), quant=quant
        )
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias=bias, quant=quant)
        rope = rope_config(hf)
        self.rotary_emb = RotaryEmbedding(
            self.rope, hf.get("max_position_embeddings") or 2048, rope
        )
        self.scale = mla_softmax_scale(hf, rope)
        self.interleaved = bool(hf.get("rope_interleave", True))
        self.w_uk: torch.Tensor | None = None  # [H, N, R], after loading
        self.w_uv: torch.Tensor | None = None  # [H, V, R]

    def after_loading(self) -> None:
        """`kv_b_proj`'s weight -> per-head `W_UK`, `W_UV` in the model dtype; the layer goes
        (runs before the children's hooks: `modules()` visits a parent first)."""
        proj = self.kv_b_proj
        weight = proj.weight.data
        if proj.weight_scale is not None:
            group = proj.quant.act_group if proj.quant is not None else None
            weight = dequantize(weight, proj.weight_scale.data, group)
        w = weight.to(self.kv_a_layernorm.weight.dtype).view(
            self.num_heads, self.nope + self.v_dim, self.rank
        )
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv = w[:, self.nope :].contiguous()
        self.kv_b_proj = None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, R + P]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens, heads = hidden.shape[0], self.num_heads
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(num_tokens, heads, -1).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())  # [T, R]
        if self.interleaved:  # pairs (x0, x1), (x2, x3), ... -> halves
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        q_pe, k_pe = self.rotary_emb(
            positions, q_pe.reshape(num_tokens, -1).contiguous(), k_pe.contiguous()
        )  # [T, H * P], [T, P]
        write_latent_cache(torch.cat([c, k_pe], dim=-1), kv_cache, meta.slot_mapping)
        assert self.w_uk is not None and self.w_uv is not None, "after_loading has not run"
        out = mla_attention(
            q_nope, q_pe.view(num_tokens, heads, self.rope), kv_cache, meta, self.w_uk,
            self.w_uv, self.scale,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, heads * self.v_dim))
