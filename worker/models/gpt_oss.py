"""gpt-oss (20b, 120b): the Llama layout with gpt-oss's differences.

- Attention has biases on q/k/v/o and attention sinks: a learned logit per head that joins the
  softmax and attends to nothing (`self_attn.sinks [Hq]`, split by head across TP ranks, passed
  to the backend as `sinks`; a backend without them is refused when the model is built).
- Layers alternate sliding-window (128) and full attention per `layer_types`: two KV cache groups
  (config.kv_cache_groups), the windowed one freeing blocks behind its window.
- Rope is YaRN (`rope_parameters`, `truncate: false` in the released configs).
- Every layer's MLP is a mixture of experts with a biased top-k router (softmax after top-k),
  biased experts and a clamped SwiGLU (worker/layers/gpt_oss_moe.py); the released checkpoints
  store the experts in MXFP4, dequantized at load.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from pagedserve.kernels.attention.interface import PagedAttention
from pagedserve.parallel.state import tp_rank, tp_size
from pagedserve.worker.layers.gpt_oss_moe import GptOssMoE
from pagedserve.worker.layers.linear import _copy, _param, expect_shape, narrow
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    ModelOptions,
)

# checkpoint `mlp.experts.<name>` -> (our parameter, shard id)
EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")
OURS = {"gate_up_proj": "w13", "down_proj": "w2"}


def is_mxfp4(hf: dict[str, Any]) -> bool:
    return (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"


class GptOssAttention(LlamaAttention):
    """Llama's attention plus this rank's heads' sinks, handed to every backend call."""

    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        super().__init__(hf, layer_idx, backend, opts)
        self.attn.sinks = _param(self.attn.num_heads, loader=self._load_sinks)
        self.attn.backend_kwargs = {**self.attn.backend_kwargs, "sinks": self.attn.sinks}

    def _load_sinks(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        heads = param.shape[0]
        expect_shape(loaded, (heads * tp_size(),))
        _copy(param.data, narrow(loaded, 0, tp_rank() * heads, heads))


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its forward) with gpt-oss's attention and MoE block."""

    def __init__(
        self, hf: dict[str, Any], layer_idx: int, backend: PagedAttention, opts: ModelOptions
    ) -> None:
        nn.Module.__init__(self)
        eps = hf.get("rms_norm_eps", 1e-5)
        self.self_attn = GptOssAttention(hf, layer_idx, backend, opts)
        self.mlp = GptOssMoE(hf, is_mxfp4(hf))
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)


class GptOssModel(LlamaModel):
    decoder_layer = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    attention_sinks = True  # build_model picks a backend that has them (or refuses)

    def __init__(
        self,
        hf: dict[str, Any],
        backend: PagedAttention,
        layer_range: tuple[int, int] | None = None,
        opts: ModelOptions | None = None,
    ) -> None:
        if opts is not None and opts.quant is not None:
            raise ValueError("gpt-oss: FP8 weights are not supported (its experts load MXFP4)")
        super().__init__(hf, backend, layer_range, opts)

    def checkpoint_to_param(self, name: str) -> tuple[str, Any]:
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        expert = EXPERT_TENSOR.search(name)
        if expert is None:
            return super().checkpoint_to_param(name)
        ours, suffix = OURS[expert[1]], expert[2]
        stem = name[: expert.start()] + ".mlp.experts."
        if suffix == "_bias":
            return f"{stem}{ours}_bias", None
        return f"{stem}{ours}_weight", suffix[1:] if suffix else None

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        match = re.search(r"\.mlp\.experts\.(w13|w2)_(weight|bias)$", param_name)
        if match is None:
            return super().checkpoint_name(param_name, shard_id)
        theirs = {v: k for k, v in OURS.items()}[match[1]]
        suffix = "_bias" if match[2] == "bias" else (f"_{shard_id}" if shard_id else "")
        return f"{param_name[: match.start()]}.mlp.experts.{theirs}{suffix}"
