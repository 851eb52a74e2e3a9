"""Rotary position embedding, neox style (transformers' Llama `rotate_half`), with a cos/sin cache.

Rope settings live in two spellings of config.json: transformers 5 writes
`rope_parameters: {rope_type, rope_theta, ...}`; older configs write `rope_theta` plus
`rope_scaling: {rope_type | type, ...}`. `rope_config` reads both into one `RopeConfig`; Gemma 3
keeps one set per layer type (`rope_parameters: {"full_attention": {...}, ...}`).

Types that transformers rescales at run time by the sequence length (`dynamic`, `longrope`) get, at
position p, the frequencies transformers uses for a sequence that ends at p: what its incremental
decode computes token by token. A prompt prefilled whole by transformers past the threshold uses
its length's frequencies for all of its positions instead; below it both agree exactly. `dynamic`
changes nothing below `max_position_embeddings`, which `max_model_len` never exceeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kernels.backend import use_triton

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    scaling: dict[str, Any] = field(default_factory=dict)  # type-specific keys (factor, ...)
    max_position_embeddings: int = 2048


def rope_config(hf: dict[str, Any], layer_type: str | None = None) -> RopeConfig:
    """Normalize both config.json spellings of the rope settings; reject unsupported types.
    `layer_type` picks a per-layer-type set where the config has them (Gemma 3)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, scaling = dict(params[layer_type]), {}
    elif layer_type == "sliding_attention":  # older Gemma 3 configs: a local base, no scaling
        params, scaling = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}, {}
    merged = {**params, **scaling}
    if "original_max_position_embeddings" in hf:
        merged.setdefault(
            "original_max_position_embeddings", hf["original_max_position_embeddings"]
        )
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (choose {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    max_position = int(hf.get("max_position_embeddings") or 2048)
    return RopeConfig(float(theta), rope_type, float(partial), merged, max_position)


def inv_frequencies(rotary_dim: int, cfg: RopeConfig) -> torch.Tensor:  # [rotary_dim / 2] fp32
    """Inverse frequencies per rotated pair, after the rope type's rescaling (for `longrope`, the
    short factors used up to `original_max_position_embeddings`)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (cfg.theta**exponents)
    if cfg.rope_type == "linear":
        return inv_freq / float(cfg.scaling["factor"])
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, cfg.scaling)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, cfg)
    if cfg.rope_type == "longrope":
        return inv_freq / torch.tensor(cfg.scaling["short_factor"], dtype=torch.float32)
    return inv_freq  # default, and dynamic below max_position_embeddings


def cos_sin_cache(max_position: int, rotary_dim: int, cfg: RopeConfig) -> torch.Tensor:
    """`[P, R]` float32: cos then sin of every position's angles, times the attention factor."""
    t = torch.arange(max_position, dtype=torch.float32)  # [P]
    freqs = torch.outer(t, inv_frequencies(rotary_dim, cfg))  # [P, R / 2]
    if cfg.rope_type == "longrope":  # long factors from the original context length on
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        long_factor = torch.tensor(cfg.scaling["long_factor"], dtype=torch.float32)
        long_freqs = torch.outer(t, 1.0 / (long_factor * cfg.theta**exponents))
        is_long = t >= _original_max_position(cfg)
        freqs = torch.where(is_long[:, None], long_freqs, freqs)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor(cfg)


def _original_max_position(cfg: RopeConfig) -> int:
    return int(cfg.scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _factor(cfg: RopeConfig) -> float:
    """`factor`, or (YaRN, longrope) the context extension the config implies."""
    factor = cfg.scaling.get("factor")
    if factor is None:
        return cfg.max_position_embeddings / _original_max_position(cfg)
    return float(factor)


def attention_factor(cfg: RopeConfig) -> float:
    """YaRN's and longrope's scale on cos and sin (1.0 for the other types)."""
    if cfg.rope_type not in ("yarn", "longrope"):
        return 1.0
    if cfg.scaling.get("attention_factor") is not None:
        return float(cfg.scaling["attention_factor"])
    factor = _factor(cfg)
    if cfg.rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(_original_max_position(cfg)))
    mscale, mscale_all_dim = cfg.scaling.get("mscale"), cfg.scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, cfg: RopeConfig) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, with a
    linear ramp between the dimensions that turn `beta_slow` and `beta_fast` times over the
    original context (transformers' `_compute_yarn_parameters`)."""
    s = cfg.scaling
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_len = _original_max_position(cfg)

    def correction_dim(num_rotations: float) -> float:
        return (
            rotary_dim
            * math.log(old_len / (num_rotations * 2 * math.pi))
            / (2 * math.log(cfg.theta))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [R / 2]: 1 keeps the frequency, 0 interpolates it
    return inv_freq / _factor(cfg) * (1 - extrapolation) + inv_freq * extrapolation


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


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [P, R] float32
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` features of each query and key head by position (the rest
    pass through): Triton on CUDA, rotating in place (query/key are views of the fresh qkv
    output); `rotary_embedding_ref` elsewhere."""
    if rotary_dim == 0:
        return query, key
    if use_triton(query):
        from pagedserve.kernels.triton_rotary import triton_rotary_embedding

        return triton_rotary_embedding(positions, query, key, cos_sin_cache, head_dim)
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, head_dim, rotary_dim)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [P, R] float32
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation in float32, then cast back."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, R / 2]
    # Query and key heads rotate as one tensor: half the ops (host time is most of a small
    # model's step on a CPU), the same arithmetic.
    q_size = query.shape[1]
    both = rotate(torch.cat([query, key], dim=-1), cos, sin, head_dim, rotary_dim)
    return both[:, :q_size], both[:, q_size:]  # [T, Hq * D], [T, Hkv * D]


def rotate(
    x: torch.Tensor,  # [T, H * D]
    cos: torch.Tensor,  # [T, R / 2]
    sin: torch.Tensor,  # [T, R / 2]
    head_dim: int,
    rotary_dim: int,
) -> torch.Tensor:  # [T, H * D]
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_dim)  # [T, H, D]
    rot = x[..., :rotary_dim].float()  # [T, H, R]
    x1, x2 = rot.chunk(2, dim=-1)  # [T, H, R / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R / 2]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim < head_dim:
        rotated = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)  # [T, H, D]
    return rotated.reshape(num_tokens, -1)
