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
  and stay FP8 on a GPU (the grouped Triton kernel scales each tile by its block:
  `stack_expert_scales`), or are dequantized to the model dtype after loading elsewhere
  (`dequantize_experts`).

The multi-token-prediction layers (`num_nextn_predict_layers`, stored as `model.layers.<N>.*`
past the decoder) are skipped by name: speculative decoding with them is not implemented.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.backend import triton_available
from pagedserve.kernels.fp8 import FP8
from pagedserve.kernels.moe import fused_moe
from pagedserve.parallel.state import tp_all_reduce, tp_rank
from pagedserve.quant_config import Fp8Scheme
from pagedserve.worker.layers.linear import _param, expect_shape, read_all
from pagedserve.worker.layers.mla import MLAttention
from pagedserve.worker.layers.moe import PROJECTIONS, FusedMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    ModelOptions,
)

logger = logging.getLogger(__name__)

# a routed expert's block scale: `...mlp.experts.<e>.<proj>.weight_scale_inv`
EXPERT_SCALE = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight_scale_inv$")
EXPERT_PROJECTION = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


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


class DeepseekV3MoE(FusedMoE):
    """Routed experts (grouped top-k) plus the shared experts, all-reduced across TP ranks."""

    def __init__(self, hf: dict[str, Any], quant: Fp8Scheme | None) -> None:
        hidden, inter = hf["hidden_size"], hf["moe_intermediate_size"]
        num_experts = hf["n_routed_experts"]
        fp8 = quant is not None and quant.serialized
        # FP8 experts replace the stacked weights: no transient model-dtype copies (22.5 GB per
        # layer at DeepSeek-V3's shapes) before them
        with torch.device("meta") if fp8 else contextlib.nullcontext():
            super().__init__(num_experts, hf["num_experts_per_tok"], hidden, inter, True)
        self.gate = GroupedTopkRouter(hf)
        self.dtype = torch.get_default_dtype()  # the model dtype the experts run in
        self.block: tuple[int, int] | None = None
        self.w13_scale: torch.Tensor | None = None  # FP8 experts kept (stack_expert_scales)
        self.w2_scale: torch.Tensor | None = None
        if fp8:
            if quant.block is None:
                raise ValueError("DeepseekV3: FP8 experts need block scales (weight_block_size)")
            self.block = quant.block
            self._fp8_expert_params(num_experts, hidden, inter)
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = (
            LlamaMLP({**hf, "intermediate_size": inter * shared}, quant) if shared else None
        )

    def _fp8_expert_params(self, num_experts: int, hidden: int, inter: int) -> None:
        """fp8 stacked weights (this rank's shard) and each expert's whole block-scale grid."""
        w13, w2 = self.w13_weight, self.w2_weight
        self.w13_weight = _param(*w13.shape, loader=self.weight_loader, dtype=FP8,
                                 shard_ids=w13.shard_ids)  # fmt: skip
        self.w2_weight = _param(*w2.shape, loader=self.weight_loader, dtype=FP8,
                                shard_ids=w2.shard_ids)  # fmt: skip
        b0, b1 = self.block  # type: ignore[misc]
        for proj in PROJECTIONS:
            rows, cols = (hidden, inter) if proj == "w2" else (inter, hidden)
            shape = (num_experts, -(-rows // b0), -(-cols // b1))
            ids = tuple((e, proj) for e in range(num_experts))
            scale = _param(*shape, loader=self._scale_loader, shard_ids=ids, dtype=torch.float32)
            setattr(self, f"{proj}_weight_scale", scale)

    def _scale_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        expect_shape(loaded, tuple(param.shape[1:]))
        param.data[shard_id[0]].copy_(read_all(loaded))

    def after_loading(self) -> None:
        if self.block is None:
            return
        b0, b1 = self.block
        on_gpu = self.w13_weight.is_cuda and triton_available()
        if on_gpu and b0 == b1 >= 16 and b0 & (b0 - 1) == 0 and self.inter_per_rank % b0 == 0:
            self.stack_expert_scales()
        else:
            self.dequantize_experts()

    def stack_expert_scales(self) -> None:
        """Keep the experts in FP8 for the grouped kernel (kernels/triton_moe.py): this rank's
        block scales stacked as its weights are, `w13_scale [E, 2I/tp/B, H/B]` (w1's, then
        w3's) and `w2_scale [E, H/B, I/tp/B]`."""
        b = self.block[0]  # type: ignore[index]
        mine = slice(
            tp_rank() * self.inter_per_rank // b, (tp_rank() + 1) * self.inter_per_rank // b
        )
        scales = {p: getattr(self, f"{p}_weight_scale").data for p in PROJECTIONS}
        self.w13_scale = torch.cat([scales["w1"][:, mine], scales["w3"][:, mine]], 1).contiguous()
        self.w2_scale = scales["w2"][:, :, mine].contiguous()
        for proj in PROJECTIONS:
            delattr(self, f"{proj}_weight_scale")
        self.block = None

    def dequantize_experts(self) -> None:
        """fp8 experts -> the model dtype, `w = w_fp8 * scale` of each element's 128 x 128
        block, one expert at a time (this rank's rows of w1/w3, columns of w2)."""
        size, start = self.inter_per_rank, tp_rank() * self.inter_per_rank
        b0, b1 = self.block  # type: ignore[misc]
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        dev = w13.device
        mine = torch.arange(start, start + size, device=dev)  # global intermediate indices
        cols = torch.arange(w13.shape[2], device=dev)  # hidden
        new13 = torch.empty(w13.shape, dtype=self.dtype, device=dev)
        new2 = torch.empty(w2.shape, dtype=self.dtype, device=dev)
        scales = {p: getattr(self, f"{p}_weight_scale").data for p in PROJECTIONS}
        for e in range(w13.shape[0]):
            for offset, proj in ((0, "w1"), (size, "w3")):
                s = scales[proj][e][mine // b0][:, cols // b1]  # [I/tp, H]
                part = w13[e, offset : offset + size].float() * s
                new13[e, offset : offset + size] = part.to(self.dtype)
            s = scales["w2"][e][cols // b0][:, mine // b1]  # [H, I/tp]
            new2[e] = (w2[e].float() * s).to(self.dtype)
        self.w13_weight = nn.Parameter(new13, requires_grad=False)
        self.w2_weight = nn.Parameter(new2, requires_grad=False)
        for proj in PROJECTIONS:
            delattr(self, f"{proj}_weight_scale")
        self.block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        if self.w13_scale is not None:  # FP8 experts (stack_expert_scales)
            from pagedserve.kernels.triton_moe import triton_fused_moe

            out = triton_fused_moe(
                x, self.w13_weight, self.w2_weight, weights, ids, w13_scale=self.w13_scale,
                w2_scale=self.w2_scale,
            )  # fmt: skip
        else:
            out = fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        out = tp_all_reduce(out)
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
    # Decode graphs only: kernels/mla.py's decode reads device lengths, its prefill host ones.
    mixed_cuda_graphs = False

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
        scale = EXPERT_SCALE.search(name)
        if scale is not None:
            projection = EXPERT_PROJECTION[scale[2]]
            return f"{name[: scale.start()]}.{projection}_weight_scale", (int(scale[1]), projection)
        if ".self_attn.q_proj." in name:  # q_lora_rank null: one plain matrix, no q/k/v
            return name.replace("_scale_inv", "_scale"), None
        return super().checkpoint_to_param(name)

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        if param_name.endswith("_weight_scale") and isinstance(shard_id, tuple):
            expert, projection = shard_id
            theirs = {v: k for k, v in EXPERT_PROJECTION.items()}[projection]
            stacked = param_name.rsplit(".", 1)[0]
            return f"{stacked}.experts.{expert}.{theirs}.weight_scale_inv"
        return super().checkpoint_name(param_name, shard_id)
