"""Models: `build_model` picks the architecture from config.json and loads weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.kernels.attention.selection import select_backend
from pagedserve.kernels.fp8 import require_fp8_device
from pagedserve.worker.gguf_weights import gguf_weights
from pagedserve.worker.loader import (
    after_loading,
    init_dummy_weights,
    iter_checkpoint,
    load_weights,
)
from pagedserve.worker.models.bert import BertModel
from pagedserve.worker.models.deepseek_v3 import DeepseekV3ForCausalLM
from pagedserve.worker.models.gemma import GemmaForCausalLM
from pagedserve.worker.models.gpt_oss import GptOssForCausalLM
from pagedserve.worker.models.llama import LlamaForCausalLM, ModelOptions
from pagedserve.worker.models.qwen3_next import Qwen3NextForCausalLM
from pagedserve.worker.pooler import pooling_weights, prepare_model

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    # the multimodal checkpoints' language model, served text-only
    "Qwen3_5ForConditionalGeneration": Qwen3NextForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3NextForCausalLM,
    # pooling models (pooling_config.py): base models (embedders) and sequence classifiers
    **{
        f"{family}{kind}": LlamaForCausalLM
        for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
        for kind in ("Model", "ForSequenceClassification")
    },
    **{
        f"{family}{kind}": BertModel
        for family in ("Bert", "Roberta", "XLMRoberta")
        for kind in ("Model", "ForSequenceClassification")
    },
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # and Kimi-K2 (model_type kimi_k2)
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def model_class(hf: dict) -> type[nn.Module]:
    names = list(hf.get("architectures") or [])
    if not names and hf.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[hf["model_type"]]]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"model architecture {names or hf.get('model_type')} is not supported "
        f"(supported: {', '.join(ARCHITECTURES)})"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in `dtype`; restored after so nothing else sees it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    layer_range: tuple[int, int] | None = None,
    kv_fp8: bool = False,
    show_progress: bool = False,
) -> nn.Module:
    """Build the model for `config` on `device` in `dtype` and fill its weights.

    `layer_range` `[start, end)` is this pipeline stage's decoder layers (default: all). Weights
    come from the safetensors or GGUF file `config.model` names, or are random for
    `load_format="dummy"`; `show_progress` draws a bar per shard file on a terminal.
    `config.quant` makes the linear layers FP8; `kv_fp8` gives attention FP8 cache scales.
    """
    cls = model_class(config.hf)
    device = torch.device(device)
    if config.quant is not None:
        require_fp8_device(device, "FP8 weights (--quantization fp8 or an FP8 checkpoint)")
    if kv_fp8:
        require_fp8_device(device, "--kv-cache-dtype fp8")
    opts = ModelOptions(quant=config.quant, kv_fp8=kv_fp8)
    with _default_dtype(dtype), torch.device(device):
        sinks = getattr(cls, "attention_sinks", False)  # gpt-oss
        backend = select_backend(device, config.attention_backend, kv_fp8, dtype, sinks)
        model = cls(config.hf, backend, layer_range, opts)
        prepare_model(model, config.pooling)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    elif config.gguf_file is not None:
        weights = gguf_weights(config.gguf_file, config.hf_dir, dtype)
        load_weights(model, weights, config.gguf_file)
    else:
        weights = pooling_weights(iter_checkpoint(config.model, show_progress), config.pooling)
        load_weights(model, weights, config.model)
    after_loading(model)
    return model.eval()
