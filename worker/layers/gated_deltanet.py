"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: per request, a causal
conv1d over the last `K` q/k/v inputs and a `[Dk, Dv]` state matrix per value head, updated by the
gated delta rule (kernels/gated_delta.py), instead of a KV cache that grows with the context.

The states live in this layer, one row per state slot (`allocate_states`); the core gives every
running request one slot (core/state_pool.py) and the step's metadata names each row's slot
(`AttentionMetadata.state_slots`; in a decode CUDA graph only on the device, where every row
continues by one token). A row whose context starts in this step starts from zeros.

Tensor parallel: key and value heads split across ranks in contiguous ranges (value head `j`
reads key head `j // (Hv / Hk)`, so a rank's value heads read only its own key heads); the
projections are column-parallel, `out_proj` row-parallel (one all-reduce). The conv channels are
q | k | v, each part split like its heads. Qwen3-Next fuses q, k, v, z (and b, a) per key head in
one matrix (`in_proj_qkvz`, `in_proj_ba`): a contiguous range of key heads is a contiguous range
of its rows, so it splits as one column-parallel matrix.

FP8 checkpoints (`quant`): the q/k/v(/z) and output projections are FP8; the b/a projections
(`2 x Hv` rows, fewer than a 128-row block) stay in the model dtype, as the published FP8
checkpoints leave them (`modules_to_not_convert`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.gated_delta import StateLayout, causal_conv1d, gated_delta_rule
from pagedserve.parallel.state import tp_rank, tp_size
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    _copy,
    _param,
    divide,
    expect_shape,
    load_full,
    narrow,
)


class GatedDeltaNet(nn.Module):
    def __init__(
        self, hf: dict[str, Any], fused_projections: bool, quant: Fp8Scheme | None = None
    ) -> None:
        super().__init__()
        tp = tp_size()
        hidden = hf["hidden_size"]
        num_k_heads, num_v_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        self.head_k_dim, self.head_v_dim = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"{num_v_heads} linear value heads are not a multiple of {num_k_heads}"
            )
        self.num_k_heads = divide(num_k_heads, tp, "number of linear-attention key heads")
        self.num_v_heads = divide(num_v_heads, tp, "number of linear-attention value heads")
        self.key_dim = self.num_k_heads * self.head_k_dim  # this rank's
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel_size = hf.get("linear_conv_kernel_dim", 4)
        self.eps = hf.get("rms_norm_eps", 1e-6)
        self.fused_projections = fused_projections
        key_all, value_all = num_k_heads * self.head_k_dim, num_v_heads * self.head_v_dim
        if fused_projections:  # Qwen3-Next: [q k v z] and [b a] grouped per key head
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, 2 * key_all + 2 * value_all, quant=quant
            )
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * num_v_heads)
        else:  # Qwen3.5
            self.in_proj_qkv = MergedColumnParallelLinear(
                hidden, [key_all, key_all, value_all], quant=quant
            )
            self.in_proj_z = ColumnParallelLinear(hidden, value_all, quant=quant)
            self.in_proj_b = ColumnParallelLinear(hidden, num_v_heads)
            self.in_proj_a = ColumnParallelLinear(hidden, num_v_heads)
        self.conv_parts = [self.key_dim, self.key_dim, self.value_dim]  # q | k | v channels
        conv_dim = sum(self.conv_parts)
        self.conv_weight = _param(conv_dim, 1, self.kernel_size, loader=self._load_conv)
        self.dt_bias = _param(self.num_v_heads, loader=self._load_heads)
        self.A_log = _param(self.num_v_heads, loader=self._load_heads)
        self.norm_weight = _param(self.head_v_dim, loader=load_full)  # replicated
        self.out_proj = RowParallelLinear(value_all, hidden, quant=quant)
        # [S, conv_dim, K - 1] and [S, Hv, Dk, Dv]: allocate_states
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def _load_conv(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The checkpoint's `[q | k | v, 1, K]`: this rank's channels of each part."""
        expect_shape(loaded, (sum(self.conv_parts) * tp_size(), 1, self.kernel_size))
        dst, src = 0, 0
        for size in self.conv_parts:
            part = narrow(loaded, 0, src + tp_rank() * size, size)
            _copy(param.data.narrow(0, dst, size), part)
            dst, src = dst + size, src + size * tp_size()

    def _load_heads(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expect_shape(loaded, (self.num_v_heads * tp_size(),))
        _copy(param.data, narrow(loaded, 0, tp_rank() * self.num_v_heads, self.num_v_heads))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: the conv state and the delta rule's state."""
        conv = (sum(self.conv_parts), self.kernel_size - 1)
        return conv, (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def allocate_states(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        conv, ssm = self.state_shapes()
        self.conv_state = torch.zeros((num_slots, *conv), dtype=dtype, device=device)
        self.ssm_state = torch.zeros((num_slots, *ssm), dtype=dtype, device=device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, H] -> qkv [T, 2 key_dim + value_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        num_tokens = x.shape[0]
        if not self.fused_projections:
            z = self.in_proj_z(x).view(num_tokens, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        reps = self.num_v_heads // self.num_k_heads
        per_head = [
            self.head_k_dim,
            self.head_k_dim,
            reps * self.head_v_dim,
            reps * self.head_v_dim,
        ]
        qkvz = self.in_proj_qkvz(x).view(num_tokens, self.num_k_heads, -1)
        q, k, v, z = qkvz.split(per_head, dim=-1)  # per key head
        b, a = self.in_proj_ba(x).view(num_tokens, self.num_k_heads, -1).split([reps, reps], -1)
        qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=-1)
        z = z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        return qkv, z, b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_states first"
        has_slots = meta.state_slots_cpu is not None or meta.state_slots is not None
        assert has_slots, "a model with linear attention needs state slots"
        num_tokens = x.shape[0]
        layout = meta.scratch.get("state_layout")  # built by the step's first linear layer
        if layout is None and meta.state_slots_cpu is None:  # a decode graph: slots on the device
            layout = meta.scratch["state_layout"] = StateLayout.decode(meta.state_slots)
        elif layout is None:
            layout = meta.scratch["state_layout"] = StateLayout.build(
                meta.state_slots_cpu.tolist(), meta.query_start_loc_cpu.tolist(),
                meta.seq_lens_cpu.tolist(), x.device, self.kernel_size - 1,
            )  # fmt: skip
        qkv, z, b, a = self.project(x)
        weight = self.conv_weight[:, 0]  # [C, K]
        qkv = causal_conv1d(qkv, weight, self.conv_state, layout)
        q, k, v = qkv.split(self.conv_parts, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        out = gated_delta_rule(
            q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(num_tokens, self.num_v_heads, self.head_v_dim),
            g, beta, self.ssm_state, layout,
        )  # fmt: skip
        out = self.gated_norm(out, z)  # [T, Hv, Dv]
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per value head (weight `w`, not `1 + w`), then times SiLU(gate)."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm_weight * x32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)
