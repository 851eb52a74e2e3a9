"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences.

- The embedding is scaled by `sqrt(hidden_size)` (in the model dtype, as transformers rounds it).
- RMSNorms store `w` for `(1 + w)`; each layer has four: before and after attention, before and
  after the MLP (the "sandwich"), the residual added after the post-norms.
- The MLP is GeGLU (`gelu_pytorch_tanh(gate) * up`).
- Scores are scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`; Gemma 2
  soft-caps attention scores and final logits (`c * tanh(x / c)`).
- Layers alternate local (sliding-window) and global attention per `layer_types`; Gemma 3 normalizes
  q and k per head and gives local and global layers their own rope settings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.hf_config import attention_layer_type
from pagedserve.kernels.activation import gelu_tanh_and_mul
from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.rotary import RopeConfig, rope_config
from pagedserve.worker.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.norm import GemmaRMSNorm
from pagedserve.worker.models.llama import (
    HiddenAndResidual,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    ModelOptions,
)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, soft-capping, (1 + w) q/k norms (Gemma 3) and per
    layer-kind rope settings (Gemma 3's local and global bases)."""

    norm_class = GemmaRMSNorm
    default_max_position = 8192

    def has_qk_norm(self, hf: dict[str, Any]) -> bool:
        return _is_gemma3(hf)

    def rope(self, hf: dict[str, Any], layer_idx: int) -> RopeConfig:
        return rope_config(hf, attention_layer_type(hf, layer_idx) if _is_gemma3(hf) else None)

    def softmax_scale(self, hf: dict[str, Any]) -> float:
        return float(hf.get("query_pre_attn_scalar") or self.head_dim) ** -0.5

    def logit_softcap(self, hf: dict[str, Any]) -> float | None:
        return None if _is_gemma3(hf) else hf.get("attn_logit_softcapping")


def _is_gemma3(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") != "gemma2"


class GemmaMLP(nn.Module):
    def __init__(self, hf: dict[str, Any], opts: ModelOptions) -> None:
        super().__init__()
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], quant=opts.quant)
        self.down_proj = RowParallelLinear(inter, hidden, quant=opts.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms; (hidden, residual) flow as in Llama so pipeline stages hand off alike: the
    residual stream is `hidden + residual`, added inside the next pre-norm."""

    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.self_attn = GemmaAttention(hf, layer_idx, backend, opts)
        self.mlp = GemmaMLP(hf, opts)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H], None before the first layer
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> HiddenAndResidual:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(LlamaModel):
    decoder_layer = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, hf: dict[str, Any], *args: Any) -> None:
        super().__init__(hf, *args)
        self.embed_scale = float(hf["hidden_size"]) ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and 3 text models; ties the LM head to the embedding unless the config says not."""

    model_class = GemmaModel

    def __init__(self, hf: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__({"tie_word_embeddings": True, **hf}, *args, **kwargs)
        self.final_logit_softcap = hf.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        logits = self.lm_head(hidden, torch.float32)
        if self.final_logit_softcap is None:
            return logits
        return torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
