"""DeepSeek-V3 (and Kimi-K2, which ships the same `DeepseekV3ForCausalLM` architecture).

- Attention is multi-head latent attention with the compressed KV cache (worker/layers/mla.py,
  kernels/mla.py): a block holds `kv_lora_rank + qk_rope_head_dim` values per token and layer.
- The first `first_k_dense_replace` layers have a dense SwiGLU MLP; the others route each token
  to `num_experts_per_tok` of `n_routed_experts` (our `FusedMoE`) and add `n_shared_experts`
  always-on experts (one SwiGLU MLP `n_shared_experts` times as wide).
- Routing (`topk_method: noaux_tc`, `scoring_func: sigmoid`): sigmoid scores; the choice adds
  `e_score_correction_bias`, keeps the `topk_group` best of `n_group` expert groups (a group
  scores the sum of its best two) and the top k within them; the weights are the chosen plain
  scores, renormalized (`norm_topk_prob`) and times `routed_scaling_factor`.
- FP8 block checkpoints (`weight_block_size [128, 128]`, `weight_scale_inv` per block): the
  linear layers run FP8 as for dense models; the routed experts load fp8 with their block scales
  and stay FP8 on a GPU or are dequantized elsewhere (worker/layers/fp8_moe.py).

The multi-token-prediction layers (`num_nextn_predict_layers`, stored as `model.layers.<N>.*`
past the decoder) are skipped by name: speculative decoding with them is not implemented.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.mla import ABSORB_MAX_TOKENS, triton_mla_enabled
from pagedserve.parallel.state import tp_all_reduce
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.fp8_moe import Fp8BlockMoE, expert_scale_name, expert_scale_param
from pagedserve.worker.layers.mla import MLAttention
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    ModelOptions,
)

logger = logging.getLogger(__name__)


def check_deepseek_config(hf: dict[str, Any]) -> None:
    """Refuse by name what this implementation does not run."""
    wanted = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    for key, value in wanted.items():
        if hf.get(key, value) != value:
            raise ValueError(f"DeepseekV3: {key}={hf[key]!r} is not supported (only {value!r})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DeepseekV3: hidden_act {hf['hidden_act']!r} is not supported")
    if hf["n_routed_experts"] % hf.get("n_group", 1):
        raise ValueError("DeepseekV3: n_group does not divide n_routed_experts")


class GroupedTopkRouter(nn.Module):
    """`weight [E, H]` and `e_score_correction_bias [E]`, both float32 (as the checkpoints)."""

    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        num_experts = hf["n_routed_experts"]
        self.weight = nn.Parameter(
            torch.empty(num_experts, hf["hidden_size"], dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )
        self.top_k, self.num_groups = hf["num_experts_per_tok"], hf.get("n_group") or 1
        self.topk_group = hf.get("topk_group") or 1
        self.renormalize = bool(hf.get("norm_topk_prob", True))
        self.scaling = float(hf.get("routed_scaling_factor") or 1.0)

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> [T, K] fp32 weights, [T, K] ids
        scores = torch.sigmoid(F.linear(x.float(), self.weight))  # [T, E]
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(x.shape[0], self.num_groups, -1)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekV3MoE(Fp8BlockMoE):
    """Routed experts (grouped top-k) plus the shared experts, all-reduced across TP ranks."""

    def __init__(self, hf: dict[str, Any], quant: Fp8Scheme | None) -> None:
        hidden, inter = hf["hidden_size"], hf["moe_intermediate_size"]
        super().__init__(
            hf["n_routed_experts"], hf["num_experts_per_tok"], hidden, inter, True, quant,
            "DeepseekV3",
        )  # fmt: skip
        self.gate = GroupedTopkRouter(hf)
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = (
            LlamaMLP({**hf, "intermediate_size": inter * shared}, quant) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        out = tp_all_reduce(self.routed(x, weights, ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # (its down projection all-reduces)
        return out


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its forward) with latent attention and a dense or MoE block."""

    def __init__(self, hf: dict[str, Any], layer_idx: int, backend: Any, opts: ModelOptions):
        nn.Module.__init__(self)
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAttention(hf, opts.quant)
        dense = layer_idx < (hf.get("first_k_dense_replace") or 0) or not hf["n_routed_experts"]
        self.mlp = LlamaMLP(hf, opts.quant) if dense else DeepseekV3MoE(hf, opts.quant)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
        if opts.quant is not None and dense:  # the dense MLP may take FP8 rows from the norm
            self.post_attention_layernorm.fp8_consumer = self.mlp.gate_up_proj.takes_fp8_rows


class DeepseekV3Model(LlamaModel):
    decoder_layer = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The Llama serving interface over MLA layers: the KV cache is latent (`kv_block_shape`)."""

    model_class = DeepseekV3Model

    @property
    def mixed_cuda_graphs(self) -> int | bool:
        """Mixed-step graphs up to ABSORB_MAX_TOKENS tokens where MLA attends in Triton from the
        device layout alone (kernels/mla.py); else decode graphs only (the torch prefill reads
        host lengths)."""
        return ABSORB_MAX_TOKENS if triton_mla_enabled() else False

    def __init__(
        self,
        hf: dict[str, Any],
        backend: Any,
        layer_range: tuple[int, int] | None = None,
        opts: ModelOptions | None = None,
    ) -> None:
        check_deepseek_config(hf)
        if opts is not None and opts.kv_fp8:
            raise ValueError(
                "--kv-cache-dtype fp8 is not supported for DeepseekV3 (MLA's latent cache) yet"
            )
        super().__init__(hf, backend, layer_range, opts)
        self.latent_width = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
        self.num_layers_total = hf["num_hidden_layers"]
        self.num_mtp_layers = int(hf.get("num_nextn_predict_layers") or 0)
        if self.num_mtp_layers:
            n = hf["num_hidden_layers"]
            logger.info(
                "the checkpoint's %d MTP layer(s) (num_nextn_predict_layers: model.layers.%d.*) "
                "are not loaded: speculative decoding with them is not implemented",
                self.num_mtp_layers, n,
            )  # fmt: skip

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One latent row per token: `[1, block_size, 1, kv_lora_rank + qk_rope_head_dim]`."""
        return (1, block_size, 1, self.latent_width)

    def checkpoint_name_wanted(self, name: str) -> bool:
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index >= self.num_layers_total:
                return False  # an MTP layer (logged once at start-up)
        return super().checkpoint_name_wanted(name)

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        scale = expert_scale_param(name)
        if scale is not None:
            return scale
        if ".self_attn.q_proj." in name:  # q_lora_rank null: one plain matrix, no q/k/v
            return name.replace("_scale_inv", "_scale"), None
        return super().checkpoint_to_param(name)

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        return expert_scale_name(param_name, shard_id) or super().checkpoint_name(
            param_name, shard_id
        )
