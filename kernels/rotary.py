"""Rotary position embedding, neox style (transformers' Llama `rotate_half`), with a cos/sin cache.

Rope settings live in two spellings of config.json: transformers 5 writes
`rope_parameters: {rope_type, rope_theta, ...}`; older configs write `rope_theta` plus
`rope_scaling: {rope_type | type, ...}`. `rope_config` reads both into one `RopeConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.backend import use_triton

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    scaling: dict[str, Any] = field(default_factory=dict)  # type-specific keys (factor, ...)


def rope_config(hf: dict[str, Any]) -> RopeConfig:
    """Normalize both config.json spellings of the rope settings; reject unsupported types."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (choose {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return RopeConfig(float(theta), rope_type, float(partial), merged)


def inv_frequencies(rotary_dim: int, cfg: RopeConfig) -> torch.Tensor:  # [rotary_dim / 2] fp32
    """Inverse frequencies per rotated pair, after the rope type's rescaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (cfg.theta**exponents)
    if cfg.rope_type == "linear":
        return inv_freq / float(cfg.scaling["factor"])
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, cfg.scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rescaling: long wavelengths divided by `factor`, short ones kept, a smooth
    interpolation between (transformers' `_compute_llama3_parameters`)."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of each head by position; the rest pass through.

    The cos/sin cache is float32 and the rotation runs in float32, then casts back.
    """

    def __init__(self, head_dim: int, max_position: int, cfg: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * cfg.partial_rotary_factor)
        assert self.rotary_dim % 2 == 0, "rotary_dim must be even"
        inv_freq = inv_frequencies(self.rotary_dim, cfg)  # [R / 2]
        t = torch.arange(max_position, dtype=torch.float32)  # [P]
        freqs = torch.outer(t, inv_freq)  # [P, R / 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, R]
        self.register_buffer("cos_sin_cache", cache.to(torch.float32), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq * D]
        key: torch.Tensor,  # [T, Hkv * D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == 0:
            return query, key
        if use_triton(query):  # rotates in place (query/key are views of the fresh qkv output)
            from pagedserve.kernels.triton_rotary import triton_rotary_embedding

            return triton_rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim)
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, R / 2]
        # Query and key heads rotate as one tensor: half the ops (host time is most of a small
        # model's step on a CPU), the same arithmetic.
        q_size = query.shape[1]
        both = self._rotate(torch.cat([query, key], dim=-1), cos, sin)  # [T, (Hq + Hkv) * D]
        return both[:, :q_size], both[:, q_size:]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)  # [T, H, D]
        rot = x[..., : self.rotary_dim].float()  # [T, H, R]
        x1, x2 = rot.chunk(2, dim=-1)  # [T, H, R / 2]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R / 2]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)  # [T, H, D]
        return rotated.reshape(num_tokens, -1)
