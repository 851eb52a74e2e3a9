"""The rotary embedding layer: a layer's cos/sin cache and the rotation of kernels/rotary.py."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.rotary import RopeConfig, cos_sin_cache, rotary_embedding

_TABLES: dict[tuple, torch.Tensor] = {}


def shared_cos_sin_cache(max_position: int, rotary_dim: int, cfg: RopeConfig) -> torch.Tensor:
    """`cos_sin_cache`, built once for all the layers of a model that share its settings (it was
    built per layer: 30 times for SmolLM2 at start-up), on the current default device. The layers
    only read it. A few tables are kept (a process builds one model; tests build many)."""
    key = (max_position, rotary_dim, repr(cfg), str(torch.empty(0).device))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 4:
            _TABLES.clear()
        table = _TABLES[key] = cos_sin_cache(max_position, rotary_dim, cfg)
    return table


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of each head by position; the rest pass through.

    The cos/sin cache is float32 and the rotation runs in float32, then casts back.
    """

    def __init__(self, head_dim: int, max_position: int, cfg: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * cfg.partial_rotary_factor)
        assert self.rotary_dim % 2 == 0, "rotary_dim must be even"
        cache = shared_cos_sin_cache(max_position, self.rotary_dim, cfg)  # [P, R]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq * D]
        key: torch.Tensor,  # [T, Hkv * D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(
            positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim
        )
