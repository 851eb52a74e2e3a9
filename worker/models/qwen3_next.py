"""Hybrid models: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (and the language model of the
`*ForConditionalGeneration` checkpoints, served text-only).

Layers follow `layer_types`: `linear_attention` layers mix tokens with Gated DeltaNet
(worker/layers/gated_deltanet.py: per-request recurrent state in state slots, no KV cache);
`full_attention` layers with gated attention: `q_proj` gives each head's query and an output gate
(`[q_h | gate_h]` per head), q and k are RMS-normed per head, rotary covers the first
`partial_rotary_factor` of each head, and the attention output is multiplied by `sigmoid(gate)`
before `o_proj`. Only the full-attention layers have KV cache (config.kv_cache_groups).

Norms are `(1 + w)` RMSNorms (Gemma's), the MLP dense SwiGLU or, on MoE layers, routed experts on
our `FusedMoE` plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`. Qwen3.5's rotary is
multimodal (mrope): with text positions (the same along t, h, w) it is the plain partial rotary.

The multi-token-prediction head (`mtp.*`) and the vision tower (`model.visual.*`) are skipped by
name while loading; images never reach the engine (chat content parts other than text are a 400).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve.hf_config import has_recurrent_state, layer_kv_slot
from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.rotary import rope_config
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.fp8_moe import Fp8BlockMoE, expert_scale_name, expert_scale_param
from pagedserve.worker.layers.gated_deltanet import GatedDeltaNet
from pagedserve.worker.layers.linear import FusedShards, QKVParallelLinear, RowParallelLinear
from pagedserve.worker.layers.norm import GemmaRMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.models.llama import (
    HiddenAndResidual,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    ModelOptions,
)

logger = logging.getLogger(__name__)

# checkpoint fragment -> ours (before the Llama mapping)
HYBRID_RENAMED = [
    ("model.language_model.", "model."),  # *ForConditionalGeneration
    (".linear_attn.conv1d.weight", ".linear_attn.conv_weight"),
    (".linear_attn.norm.weight", ".linear_attn.norm_weight"),
]
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "model.language_model.mtp.")


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate, q/k norms and partial rotary."""

    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__()
        hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        self.head_dim = hf.get("head_dim") or hidden // num_heads
        bias = bool(hf.get("attention_bias", False))
        # The query part holds [q_h | gate_h] per head: twice the heads of width head_dim.
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, 2 * num_heads, num_kv_heads, bias=bias, quant=opts.quant
        )
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, quant=opts.quant)
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        max_position = hf.get("max_position_embeddings") or 2048
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, rope_config(hf))
        self.attn = Attention(
            self.num_heads, self.qkv_proj.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
            kv_group=layer_kv_slot(hf, layer_idx)[0], backend=backend, kv_fp8=opts.kv_fp8,
        )  # fmt: skip

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q_gate = q_gate.view(num_tokens, self.num_heads, 2, self.head_dim)
        q, gate = q_gate[:, :, 0], q_gate[:, :, 1].reshape(num_tokens, -1)  # [T, Hq, D], [T, Hq*D]
        q = self.q_norm(q).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        out = self.attn(q, k, v, kv_cache, meta, self.rotary_emb, positions)  # [T, Hq * D]
        return self.o_proj(out * torch.sigmoid(gate))


class SharedExpertMoE(nn.Module):
    """Routed experts plus one shared expert gated per token (Qwen3-Next, Qwen3.5-MoE); from an
    FP8 checkpoint the experts (block scales) and the shared expert are FP8, the router and the
    shared expert's gate stay in the model dtype."""

    def __init__(self, hf: dict[str, Any], renormalize: bool, quant: Fp8Scheme | None) -> None:
        super().__init__()
        self.experts = Fp8BlockMoE(
            hf["num_experts"], hf["num_experts_per_tok"], hf["hidden_size"],
            hf["moe_intermediate_size"], renormalize, quant, hf.get("model_type", "hybrid"),
        )  # fmt: skip
        self.shared_expert = LlamaMLP(
            {**hf, "intermediate_size": hf["shared_expert_intermediate_size"]}, quant
        )
        self.shared_expert_gate = nn.Linear(hf["hidden_size"], 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x) + shared


def make_hybrid_mlp(hf: dict[str, Any], layer_idx: int, opts: ModelOptions) -> nn.Module:
    model_type = hf.get("model_type")
    if model_type == "qwen3_5_moe_text":
        return SharedExpertMoE(hf, True, opts.quant)
    if model_type == "qwen3_next" and hf.get("num_experts"):
        step = hf.get("decoder_sparse_step") or 1
        if layer_idx not in (hf.get("mlp_only_layers") or []) and (layer_idx + 1) % step == 0:
            return SharedExpertMoE(hf, bool(hf.get("norm_topk_prob", True)), opts.quant)
    return LlamaMLP(hf, opts.quant)


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.is_linear = hf["layer_types"][layer_idx] == "linear_attention"
        if self.is_linear:
            fused = hf["model_type"] == "qwen3_next"
            self.linear_attn = GatedDeltaNet(hf, fused_projections=fused, quant=opts.quant)
        else:
            self.self_attn = GatedAttention(hf, layer_idx, backend, opts)
        self.mlp = make_hybrid_mlp(hf, layer_idx, opts)
        self.input_layernorm = GemmaRMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = GemmaRMSNorm(hf["hidden_size"], eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H], None before the first layer
        kv_cache: torch.Tensor | None,  # None on linear-attention layers
        meta: AttentionMetadata,
    ) -> HiddenAndResidual:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(LlamaModel):
    decoder_layer = HybridDecoderLayer
    norm_class = GemmaRMSNorm


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next, Qwen3.5 (dense and MoE): the Llama serving interface plus recurrent state."""

    model_class = HybridModel

    def __init__(self, hf: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if not has_recurrent_state(hf):
            raise ValueError(f"{hf.get('model_type')}: config.json lists no linear_attention layer")
        if hf.get("mtp_num_hidden_layers"):
            logger.info("the checkpoint's MTP head (mtp.*) is not loaded: nothing here uses it")
        super().__init__(hf, *args, **kwargs)
        self.linear_layers = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def allocate_states(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Every linear-attention layer's recurrent state for `num_slots` requests."""
        for layer in self.linear_layers:
            layer.allocate_states(num_slots, dtype, device)

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        numel = 0
        for layer in self.linear_layers:
            numel += sum(int(torch.Size(shape).numel()) for shape in layer.state_shapes())
        return numel * dtype.itemsize

    @staticmethod
    def _ours(name: str) -> str:
        for theirs, ours in HYBRID_RENAMED:
            name = name.replace(theirs, ours)
        return name

    def checkpoint_name_wanted(self, name: str) -> bool:
        if name.startswith(SKIPPED_PREFIXES):
            return False
        return super().checkpoint_name_wanted(self._ours(name))

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        name = self._ours(name)
        scale = expert_scale_param(name.replace(".mlp.experts.", ".mlp.experts.experts.", 1))
        if scale is not None:  # FP8 checkpoints: an expert's block scales
            return scale
        if ".linear_attn.in_proj_qkv." in name:  # one tensor: q | k | v (and its FP8 scales)
            return name.replace(".weight_scale_inv", ".weight_scale"), FusedShards((0, 1, 2))
        name = name.replace(".mlp.experts.", ".mlp.experts.experts.", 1)
        name = name.replace(".mlp.gate.weight", ".mlp.experts.gate.weight")
        return super().checkpoint_to_param(name)

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        scale = expert_scale_name(param_name, shard_id)
        if scale is not None:
            return scale.replace(".experts.experts.", ".experts.")
        name = param_name.replace(".mlp.experts.experts.", ".mlp.experts.")
        name = name.replace(".mlp.experts.gate.", ".mlp.gate.")
        name = name.replace(".linear_attn.conv_weight", ".linear_attn.conv1d.weight")
        name = name.replace(".linear_attn.norm_weight", ".linear_attn.norm.weight")
        if isinstance(shard_id, tuple):
            theirs = super().checkpoint_name(param_name, shard_id)
            return theirs.replace(".experts.experts.", ".experts.")
        return super().checkpoint_name(name, shard_id)
