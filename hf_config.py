"""What a model's HF `config.json` says, read and interpreted: the file itself, the defaults
transformers derives for hybrid models, each layer's attention kind and window, and the KV cache
groups those make (one block table per group, see `KVCacheGroup`).

Pure Python (json only), like config.py, which builds `ModelConfig` on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.quant_config import Fp8Scheme

MOE_MODEL_TYPES = (
    "mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "deepseek_v3", "kimi_k2", "gpt_oss",
)  # fmt: skip
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # latent attention; FP8 experts dequantize at load
LINEAR_ATTENTION = "linear_attention"  # a `layer_types` entry: recurrent state, no KV cache


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model {model_dir!r}: no config.json there (expected an HF model dir or a GGUF file)"
        )
    with open(path) as f:
        return json.load(f)


def read_generation_config(directory: str) -> dict[str, Any]:
    """A directory's generation_config.json ({} where it has none)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# generation_config.json keys that become sampling defaults, as vLLM takes them (max_new_tokens is
# SamplingParams' max_tokens).
GENERATION_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
)  # fmt: skip


HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    text = hf.get("text_config") or hf
    if text.get("model_type") in HYBRID_MODEL_TYPES:
        text = _hybrid_defaults(text)
    return text


def _hybrid_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """What transformers derives for Qwen3-Next / Qwen3.5 configs that leave it out: the layer
    kinds from `full_attention_interval` (every 4th layer full attention), a quarter of each
    head rotated."""
    hf = dict(hf)
    if not hf.get("layer_types"):
        interval = int(hf.get("full_attention_interval", 4))
        hf["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(int(hf["num_hidden_layers"]))
        ]
    if "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        hf.setdefault("partial_rotary_factor", 0.25)
    return hf


def attention_layer_type(hf: dict[str, Any], layer_idx: int) -> str:
    """`sliding_attention` or `full_attention`: from `layer_types`, else the older spellings
    (Gemma 2: even layers local; Gemma 3: every `sliding_window_pattern`-th layer global; Qwen2/3:
    `use_sliding_window` from `max_window_layers` on; Mistral, Mixtral, Phi-3: every layer once
    `sliding_window` is set)."""
    if hf.get("layer_types"):
        return hf["layer_types"][layer_idx]
    model_type = hf.get("model_type")
    if model_type == "gemma2":
        local = layer_idx % 2 == 0
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        local = (layer_idx + 1) % pattern != 0
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        local = bool(hf.get("use_sliding_window")) and layer_idx >= hf.get("max_window_layers", 0)
    else:
        local = model_type in ("mistral", "mixtral", "phi3")
    return "sliding_attention" if local else "full_attention"


def layer_sliding_window(hf: dict[str, Any], layer_idx: int) -> int | None:
    """The layer's attention window in tokens (None: it attends to the whole context)."""
    window = hf.get("sliding_window")
    if window is None or attention_layer_type(hf, layer_idx) != "sliding_attention":
        return None
    return int(window)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request: same window (None: global attention).

    A model whose layers all attend alike has one group. One that mixes windowed and global layers
    (Gemma 2/3) has several, as in vLLM: each kind's layers split into groups of `size` layers
    (the smallest kind's count), so layer `i` of every group can share one KV tensor (`slot`) and
    a block is the same number of bytes whichever group owns it. The core then keeps a windowed
    group's blocks to its window while the global groups keep every block."""

    window: int | None
    layer_ids: tuple[int, ...]


def has_recurrent_state(hf: dict[str, Any]) -> bool:
    """Whether some layer keeps per-request recurrent state (linear attention: Qwen3-Next,
    Qwen3.5) in a state slot (core/state_pool.py) instead of KV blocks."""
    return LINEAR_ATTENTION in (hf.get("layer_types") or [])


def check_fp8_model(hf: dict[str, Any], quant: Fp8Scheme, requested: str | None) -> None:
    """Refuse by name the FP8 weights a model family does not run: MoE experts take FP8 only
    with block scales (DeepSeek-V3 / Kimi-K2, and the hybrids); hybrid models only from a
    block-FP8 checkpoint (no load-time `--quantization fp8`, no per-tensor/channel scales)."""
    model_type = hf.get("model_type")
    source = "--quantization fp8" if requested else "an FP8 checkpoint"
    if has_recurrent_state(hf):
        if not quant.serialized or quant.block is None:
            raise ValueError(
                f"{source}: FP8 weights for hybrid linear-attention models ({model_type}) are "
                "supported from block-FP8 checkpoints only (quant_method fp8 with "
                "weight_block_size, as Qwen publishes them); serve such a checkpoint or bf16"
            )
    elif model_type in MOE_MODEL_TYPES and model_type not in MLA_MODEL_TYPES:
        raise ValueError(
            f"{source}: FP8 weights are not supported for MoE models ({model_type}) yet; "
            "serve the bf16 checkpoint"
        )


def kv_cache_groups(hf: dict[str, Any]) -> list[KVCacheGroup]:
    """The model's KV cache groups, in a fixed order (global kinds first, then by window).
    Linear-attention layers have no KV cache and are in no group."""
    num_layers = int(hf["num_hidden_layers"])
    kinds: dict[int | None, list[int]] = {}
    for i in range(num_layers):
        if has_recurrent_state(hf) and attention_layer_type(hf, i) == LINEAR_ATTENTION:
            continue
        kinds.setdefault(layer_sliding_window(hf, i), []).append(i)
    if len(kinds) == 1:
        ((window, layer_ids),) = kinds.items()
        return [KVCacheGroup(window, tuple(layer_ids))]
    size = min(len(ids) for ids in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):
        ids = kinds[window]
        groups += [KVCacheGroup(window, tuple(ids[j : j + size])) for j in range(0, len(ids), size)]
    return groups


def layer_kv_slot(hf: dict[str, Any], layer_idx: int) -> tuple[int, int]:
    """(group, slot) of a layer: which block table it reads and which shared KV tensor it uses."""
    for g, group in enumerate(kv_cache_groups(hf)):
        if layer_idx in group.layer_ids:
            return g, group.layer_ids.index(layer_idx)
    raise ValueError(f"layer {layer_idx} is not in the model's {hf['num_hidden_layers']} layers")
