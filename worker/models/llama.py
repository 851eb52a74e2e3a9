"""The Llama family in one model: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm),
their mixture-of-experts variants Mixtral and Qwen3-MoE (`FusedMoE` in place of the MLP on sparse
layers), and Phi-3 (checkpoints with q/k/v and gate/up already fused).

Parameter names follow transformers' checkpoints except where two matrices run as one matmul
(`qkv_proj`, `gate_up_proj`); `STACKED_PARAMS` maps the checkpoint names onto those. A pipeline
stage holds the decoder layers `[start_layer, end_layer)` under their global indices (so the
checkpoint names match), the embedding only on the first stage and the final norm and LM head only
on the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.hf_config import MOE_MODEL_TYPES, layer_kv_slot, layer_sliding_window
from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.kernels.rotary import RopeConfig, rope_config
from pagedserve.parallel.state import tp_size
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.linear import (
    FusedShards,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.worker.layers.moe import FusedMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.layers.rotary import RotaryEmbedding

# (our param fragment, checkpoint fragment, shard id)
STACKED_PARAMS = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]
# checkpoint suffix -> ours: block-FP8 scales, KV-cache scales (compressed-tensors and older)
RENAMED = [
    (".weight_scale_inv", ".weight_scale"),
    (".self_attn.k_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_scale", ".self_attn.attn.v_scale"),
    (".self_attn.k_proj.output_scale", ".self_attn.attn.k_scale"),
    (".self_attn.v_proj.output_scale", ".self_attn.attn.v_scale"),
]
KV_SCALE_NAMES = tuple(theirs for theirs, ours in RENAMED if ".attn." in ours)
# Per-expert checkpoint tensors (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down) -> stacked params.
EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PROJECTION = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# Checkpoints that store the merged matrices already (Phi-3): one tensor, several shards.
FUSED_PARAMS = {".qkv_proj.": FusedShards(("q", "k", "v")), ".gate_up_proj.": FusedShards((0, 1))}

HiddenAndResidual = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelOptions:
    """How the layers store their state: FP8 weights (a scheme) and an FP8 KV cache."""

    quant: Fp8Scheme | None = None
    kv_fp8: bool = False


def make_mlp(hf: dict[str, Any], layer_idx: int, quant: Fp8Scheme | None = None) -> nn.Module:
    """The layer's feed-forward block: experts on MoE models' sparse layers, else a dense MLP.
    Qwen3-MoE keeps dense layers listed in `mlp_only_layers` or off `decoder_sparse_step`."""
    model_type = hf.get("model_type")
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    assert quant is None or model_type not in MOE_MODEL_TYPES, "ModelConfig refuses FP8 MoE"
    if model_type == "mixtral":
        return FusedMoE(
            num_experts, hf["num_experts_per_tok"], hf["hidden_size"], hf["intermediate_size"], True
        )
    if model_type == "qwen3_moe":
        step = hf.get("decoder_sparse_step") or 1
        sparse = layer_idx not in (hf.get("mlp_only_layers") or []) and (layer_idx + 1) % step == 0
        if num_experts > 0 and sparse:
            return FusedMoE(
                num_experts,
                hf["num_experts_per_tok"],
                hf["hidden_size"],
                hf["moe_intermediate_size"],
                bool(hf.get("norm_topk_prob", False)),
            )
    return LlamaMLP(hf, quant)


class LlamaAttention(nn.Module):
    """Self-attention of one layer. The hooks below are where other families differ (Gemma)."""

    norm_class: type[nn.Module] = RMSNorm  # q/k norms, when the family has them
    default_max_position = 2048

    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        self.head_dim = hf.get("head_dim") or hidden // num_heads
        model_type = hf.get("model_type")
        bias = bool(hf.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, num_heads, num_kv_heads, bias=bias or model_type == "qwen2",
            quant=opts.quant,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden, bias=bias, quant=opts.quant
        )
        eps = hf.get("rms_norm_eps", 1e-6)
        self.qk_norm = self.has_qk_norm(hf)
        if self.qk_norm:
            self.q_norm = self.norm_class(self.head_dim, eps)
            self.k_norm = self.norm_class(self.head_dim, eps)
        max_position = hf.get("max_position_embeddings") or self.default_max_position
        rope = self.rope(hf, layer_idx)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, rope)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            scale=self.softmax_scale(hf),
            sliding_window=layer_sliding_window(hf, layer_idx),
            kv_group=layer_kv_slot(hf, layer_idx)[0],
            backend=backend,
            logit_softcap=self.logit_softcap(hf),
            kv_fp8=opts.kv_fp8,
        )

    def has_qk_norm(self, hf: dict[str, Any]) -> bool:
        return hf.get("model_type") in QK_NORM_TYPES

    def rope(self, hf: dict[str, Any], layer_idx: int) -> RopeConfig:
        return rope_config(hf)

    def softmax_scale(self, hf: dict[str, Any]) -> float:
        return self.head_dim**-0.5

    def logit_softcap(self, hf: dict[str, Any]) -> float | None:
        return None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        return self.attn.forward_layer(
            hidden, positions, kv_cache, meta, self.qkv_proj, self.o_proj, self.rotary_emb,
            self.norm_qk if self.qk_norm else None,
        )  # fmt: skip

    def norm_qk(
        self,
        q: torch.Tensor,  # [T, Hq * D]
        k: torch.Tensor,  # [T, Hkv * D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's and Gemma 3's per-head RMSNorms of q and k, before rotary."""
        q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, hf: dict[str, Any], quant: Fp8Scheme | None) -> None:
        super().__init__()
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        bias = bool(hf.get("mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=bias, quant=quant
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        activated = self.gate_up_proj.swiglu(x)  # a prompt-sized batch on Hopper, else None
        if activated is not None:
            return self.down_proj(activated)
        return self.down_proj(self.gate_up_proj(x), gated=True)  # silu_and_mul inside


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(hf, layer_idx, backend, opts)
        self.mlp = make_mlp(hf, layer_idx, opts.quant)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
        if opts.quant is not None:  # FP8 layers take their input quantized by the norm before
            self.input_layernorm.fp8_consumer = self.self_attn.qkv_proj.takes_fp8_rows
            if isinstance(self.mlp, LlamaMLP):
                self.post_attention_layernorm.fp8_consumer = self.mlp.gate_up_proj.takes_fp8_rows

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
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, this stage's decoder layers, final norm. Variants (Gemma) swap the layer and
    norm types and the embedding through the class attributes and `embed`."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        hf: dict[str, Any],
        start_layer: int,
        end_layer: int,
        backend: PagedAttention,
        opts: ModelOptions,
    ) -> None:
        super().__init__()
        num_layers = hf["num_hidden_layers"]
        self.is_first = start_layer == 0
        self.is_last = end_layer == num_layers
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(hf["vocab_size"], hf["hidden_size"])
        # Keyed by the global layer index so parameter names match the checkpoint on every stage.
        self.layers = nn.ModuleDict(
            {
                str(i): self.decoder_layer(hf, i, backend, opts)
                for i in range(start_layer, end_layer)
            }
        )
        if self.is_last:
            self.norm = self.norm_class(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer of this stage
        meta: AttentionMetadata,
        intermediate: HiddenAndResidual | None = None,
    ) -> torch.Tensor | HiddenAndResidual:
        if self.is_first:
            hidden, residual = self.embed(input_ids), None
        else:
            assert intermediate is not None, (
                "a later pipeline stage needs the previous one's output"
            )
            hidden, residual = intermediate
        assert len(kv_caches) == len(self.layers), "one kv cache per decoder layer of this stage"
        for layer, kv_cache in zip(self.layers.values(), kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.is_last:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The serving interface: `forward` to hidden states, `compute_logits` on the rows to sample.

    On a stage that is not the last, `forward` returns `(hidden, residual)` for the next stage,
    which passes them back in as `intermediate`.
    """

    model_class: type[LlamaModel] = LlamaModel

    def __init__(
        self,
        hf: dict[str, Any],
        backend: PagedAttention,
        layer_range: tuple[int, int] | None = None,
        opts: ModelOptions | None = None,
    ) -> None:
        super().__init__()
        self.opts = opts = opts or ModelOptions()
        total = hf["num_hidden_layers"]
        self.start_layer, self.end_layer = layer_range or (0, total)
        if not 0 <= self.start_layer < self.end_layer <= total:
            raise ValueError(f"layer range {layer_range} is outside the model's {total} layers")
        self.model = self.model_class(hf, self.start_layer, self.end_layer, backend, opts)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.model.is_last:
            self.lm_head = ParallelLMHead(hf["vocab_size"], hf["hidden_size"])
            if self.tie_word_embeddings and self.model.is_first:
                self.lm_head.tie(self.model.embed_tokens)
        # (a hybrid model's stage may hold only linear-attention layers: then no KV cache)
        attn = next((m for m in self.model.modules() if isinstance(m, Attention)), None)
        self.head_dim = attn.head_dim if attn is not None else 0
        self.num_kv_heads_per_rank = attn.num_kv_heads if attn is not None else 0
        self.num_layers = self.end_layer - self.start_layer
        self.vocab_size = hf["vocab_size"]
        self.tp_size = tp_size()
        self.hf_model_type = hf.get("model_type")

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: HiddenAndResidual | None = None,
    ) -> torch.Tensor | HiddenAndResidual:  # [T, H] on the last stage
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    @property
    def layers(self) -> nn.ModuleDict:
        """This stage's decoder layers, keyed by global index (len == num_layers)."""
        return self.model.layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head(hidden, torch.float32)

    def checkpoint_name_wanted(self, name: str) -> bool:
        """Whether this stage loads checkpoint tensor `name` (False: it belongs to another stage,
        or is a tied/derived weight we do not keep)."""
        if "rotary_emb.inv_freq" in name:
            return False
        if name.endswith(KV_SCALE_NAMES) and not self.opts.kv_fp8:
            return False  # the cache stays in the model dtype
        if name.startswith("model.layers."):
            return self.start_layer <= int(name.split(".")[2]) < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.is_first or (self.tie_word_embeddings and self.model.is_last)
        if name.startswith("lm_head."):
            return self.model.is_last and not self.tie_word_embeddings
        return self.model.is_last  # model.norm.*

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        """The checkpoint tensor that fills `param_name`'s `shard_id` (for error messages)."""
        model_type = self.hf_model_type
        if isinstance(shard_id, tuple):  # an expert: (index, "w1" | "w3" | "w2")
            expert, projection = shard_id
            stacked = param_name.rsplit(".", 1)[0]
            if model_type == "mixtral":
                stacked = stacked.replace(".mlp", ".block_sparse_moe")
                return f"{stacked}.experts.{expert}.{projection}.weight"
            theirs = {v: k for k, v in EXPERT_PROJECTION.items()}[projection]
            return f"{stacked}.experts.{expert}.{theirs}.weight"
        if shard_id is None or model_type == "phi3":
            return param_name
        for ours, theirs, sid in STACKED_PARAMS:
            if ours in param_name and sid == shard_id:
                return param_name.replace(ours, theirs)
        return param_name

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        """Map a checkpoint tensor name to (our parameter name, shard id)."""
        if name.startswith("model.embed_tokens.") and not self.model.is_first:
            return name.replace("model.embed_tokens.", "lm_head."), None  # tied, later stage
        for theirs, ours in RENAMED:  # before the stacking: k_proj.output_scale is a KV scale
            if name.endswith(theirs):
                name = name[: -len(theirs)] + ours
                break
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral
        expert = EXPERT_WEIGHT.search(name)
        if expert is not None:
            projection = EXPERT_PROJECTION.get(expert[2], expert[2])
            stacked = ".w2_weight" if projection == "w2" else ".w13_weight"
            return name[: expert.start()] + stacked, (int(expert[1]), projection)
        for ours, theirs, shard_id in STACKED_PARAMS:
            if theirs in name:
                return name.replace(theirs, ours), shard_id
        for fragment, fused in FUSED_PARAMS.items():
            if fragment in name:
                return name, fused
        return name, None
