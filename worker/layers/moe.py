"""Tensor-parallel experts: every expert's weights stacked into two parameters, each rank holding
its slice of every expert's intermediate dimension (like a column- then row-parallel MLP), so one
all-reduce per layer combines the ranks, as for a dense MLP.

Checkpoints store one tensor per expert and projection; `weight_loader` copies expert `e`'s
`w1` (gate), `w3` (up) or `w2` (down) shard into its slot of the stacked parameter, reading only
this rank's rows or columns, once the whole tensor's shape is checked against the config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels.moe import fused_moe, select_experts
from pagedserve.parallel.state import tp_all_reduce, tp_rank, tp_size
from pagedserve.worker.layers.linear import _copy, _param, divide, expect_shape, narrow

PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down: the shard ids' second part


class FusedMoE(nn.Module):
    """Router plus experts: `[T, H] -> [T, H]`, all-reduced across TP ranks.

    Parameters: `gate.weight [E, H]` (the router, replicated), `w13_weight [E, 2I/tp, H]` and
    `w2_weight [E, H, I/tp]`."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter_per_rank = divide(intermediate_size, tp_size(), "moe intermediate size")
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, replicated
        shard_ids = [(e, p) for e in range(num_experts) for p in PROJECTIONS]
        self.w13_weight = _param(
            num_experts,
            2 * self.inter_per_rank,
            hidden_size,
            loader=self.weight_loader,
            shard_ids=tuple(s for s in shard_ids if s[1] != "w2"),
        )
        self.w2_weight = _param(
            num_experts,
            hidden_size,
            self.inter_per_rank,
            loader=self.weight_loader,
            shard_ids=tuple(s for s in shard_ids if s[1] == "w2"),
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expert, projection = shard_id
        size = self.inter_per_rank
        start = tp_rank() * size
        hidden, full = self.w2_weight.shape[1], size * tp_size()
        expect_shape(loaded, (hidden, full) if projection == "w2" else (full, hidden))
        if projection == "w2":  # [H, I]: this rank's columns
            _copy(param.data[expert], narrow(loaded, 1, start, size))
            return
        offset = 0 if projection == "w1" else size
        _copy(param.data[expert].narrow(0, offset, size), narrow(loaded, 0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.gate(x)  # [T, E]
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return tp_all_reduce(out)
