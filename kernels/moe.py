"""Mixture-of-experts compute: top-k routing and the experts' gated MLPs over stacked weights.

Expert weights are stacked per layer: `w13 [E, 2I, H]` (each expert's gate rows, then its up
rows) and `w2 [E, H, I]`. A token's output is the routing-weighted sum of its top-k experts'
`down(silu(gate(x)) * up(x))`. `fused_moe` runs the Triton kernel (tokens sorted by expert, one
grouped GEMM per projection) on CUDA and `fused_moe_ref` elsewhere; the reference is also the
oracle the kernel's test compares against. Under tensor parallelism every rank holds a slice of
every expert's intermediate dimension, so the result is a partial sum the caller all-reduces.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.activation import silu_and_mul_ref
from pagedserve.kernels.backend import use_triton


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, K] float32 weights, [T, K] int64 expert ids
    """Softmax over all experts in float32, keep the top k; `renormalize` (Mixtral, Qwen3-MoE's
    `norm_topk_prob`) rescales the kept weights to sum to one."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:  # [T, H]
    if use_triton(x):
        from pagedserve.kernels.triton_moe import triton_fused_moe
        from pagedserve.kernels.triton_moe_decode import triton_moe_decode, use_moe_decode

        if use_moe_decode(*topk_ids.shape):  # a few tokens: two GEMVs, no sort by expert
            return triton_moe_decode(x, w13, w2, topk_weights, topk_ids)
        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:  # [T, H]
    """One expert at a time over the tokens routed to it (transformers' loop), summed in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token_idx, slot = torch.where(topk_ids == expert)  # [N], [N]
        hidden = silu_and_mul_ref(x[token_idx] @ w13[expert].t())  # [N, I]
        y = (hidden @ w2[expert].t()).float() * topk_weights[token_idx, slot, None]  # [N, H]
        out.index_add_(0, token_idx, y)
    return out.to(x.dtype)
