"""gpt-oss's mixture of experts: its router and its experts' clamped SwiGLU, with biases.

Where it differs from `kernels/moe.py` (Mixtral, Qwen3-MoE):
- the router has a bias, keeps the top-k *logits* and softmaxes over those k only;
- each expert's gate and up projections have biases, and its activation is
  `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`
  (alpha 1.702, limit 7.0);
- the down projection has a bias, weighted by the routing weight like the rest of the output.

Weights as `kernels/moe.py` stacks them: `w13 [E, 2I, H]` (gate rows, then up rows: the
checkpoint interleaves them and the loader splits them apart), `w2 [E, H, I]`. Under tensor
parallelism a rank holds a slice of every expert's I: the output without the down bias is a
partial sum to all-reduce, and `down_bias_sum` adds the bias once after.
"""

from __future__ import annotations

import torch


def route(
    router_logits: torch.Tensor,  # [T, E], the router's bias included
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, K] float32 weights, [T, K] int64 expert ids
    """Top-k logits, then softmax over the k (transformers' `GptOssTopKRouter`)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids


def clamped_swiglu(
    gate_up: torch.Tensor,  # [N, 2I]: gate | up
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [N, I]
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def gpt_oss_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w13_bias: torch.Tensor,  # [E, 2I]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [T, H], without the down bias (a partial sum under TP)
    """One expert at a time over the tokens routed to it (transformers' loop)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token_idx, slot = torch.where(topk_ids == expert)  # [N], [N]
        gate_up = x[token_idx] @ w13[expert].t() + w13_bias[expert]  # [N, 2I]
        y = clamped_swiglu(gate_up, alpha, limit) @ w2[expert].t()  # [N, H]
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def down_bias_sum(
    w2_bias: torch.Tensor,  # [E, H]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:  # [T, H] float32: sum_k weight_k * bias[expert_k]
    return torch.einsum("tk,tkh->th", topk_weights, w2_bias[topk_ids].float())
