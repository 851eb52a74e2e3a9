"""Llama-family models: `build_model` picks the architecture from config.json and loads weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.kernels.attention import select_backend
from pagedserve.worker.loader import init_dummy_weights, load_weights
from pagedserve.worker.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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
    show_progress: bool = False,
) -> nn.Module:
    """Build the model for `config` on `device` in `dtype` and fill its weights.

    `layer_range` `[start, end)` is this pipeline stage's decoder layers (default: all). Weights
    come from the safetensors in `config.model`, or are random for `load_format="dummy"`;
    `show_progress` draws a bar per shard file on a terminal.
    """
    cls = model_class(config.hf)
    device = torch.device(device)
    with _default_dtype(dtype), torch.device(device):
        model = cls(config.hf, select_backend(device), layer_range)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, config.model, show_progress)
    return model.eval()
