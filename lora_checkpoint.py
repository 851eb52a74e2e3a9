"""PEFT LoRA checkpoints (`adapter_config.json` + `adapter_model.safetensors`): read and checked
against the base model, without torch, so an API server refuses a bad adapter at load time (a
400 naming the adapter) and the workers only ever load adapters that fit.

What we serve: `peft_type` LORA on the attention projections (q/k/v/o) and the MLP ones
(gate/up/down), or the fused `qkv_proj` / `gate_up_proj` of checkpoints that store them merged,
with `r <= --max-lora-rank`, `lora_alpha` scaling (`alpha / r`, or `alpha / sqrt(r)` with
rsLoRA). Anything else (DoRA, embedding or lm_head targets, `modules_to_save`, per-module rank or
alpha patterns, biases, modules the model lacks) is refused by name, with the adapter's name in
the message. A leaf: imports nothing from pagedserve.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# module -> its part of our merged layer (qkv_proj / gate_up_proj) or itself
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_MAX_HEADER = 100 << 20


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter."""


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what the workers load. `tensors`: (layer, module) -> the checkpoint
    names of its A and B."""

    name: str
    path: str
    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[str, str]] = field(repr=False)

    @property
    def weights_file(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)


def module_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of every module an adapter may target, for this model."""
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
    }
    if not (hf.get("num_experts") or hf.get("num_local_experts")):  # MoE MLPs are experts
        inter = int(hf["intermediate_size"])
        shapes.update(
            gate_proj=(inter, hidden),
            up_proj=(inter, hidden),
            gate_up_proj=(2 * inter, hidden),
            down_proj=(hidden, inter),
        )
    return shapes


def read_adapter(name: str, path: str, hf: dict[str, Any], max_rank: int) -> AdapterSpec:
    """The adapter at `path` checked against the model's config; LoRAAdapterError otherwise."""

    def fail(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {why}")

    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise fail(f"{config_path} not found")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise fail(f"{config_path} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise fail(f"{config_path} is not a JSON object")
    rank, scaling = _check_config(config, max_rank, fail)
    shapes = module_shapes(hf)
    header = _safetensors_header(os.path.join(path, WEIGHTS_FILE), fail)
    tensors: dict[tuple[int, str], dict[str, str]] = {}
    num_layers = int(hf["num_hidden_layers"])
    for tensor_name, meta in header.items():
        if tensor_name == "__metadata__":
            continue
        match = _TENSOR.match(tensor_name)
        if match is None:
            raise fail(f"tensor {tensor_name!r} is not a LoRA weight of a module we serve")
        layer, module, which = int(match[1]), match[3], match[4]
        if module not in shapes:
            raise fail(f"target module {module!r} is not supported (supported: "
                       f"{', '.join(shapes)})")  # fmt: skip
        if layer >= num_layers:
            raise fail(f"tensor {tensor_name!r}: the model has {num_layers} layers")
        out, inp = shapes[module]
        want = (rank, inp) if which == "A" else (out, rank)
        got = tuple(meta.get("shape", ()))
        if got != want:
            raise fail(f"tensor {tensor_name!r} has shape {got}; the base model needs {want}")
        tensors.setdefault((layer, module), {})[which] = tensor_name
    if not tensors:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for key, ab in tensors.items():
        if set(ab) != {"A", "B"}:
            missing = "A" if "A" not in ab else "B"
            raise fail(f"layer {key[0]} {key[1]}: lora_{missing} is missing")
        pairs[key] = (ab["A"], ab["B"])
    return AdapterSpec(name, os.path.abspath(path), rank, scaling, pairs)


def _check_config(config: dict[str, Any], max_rank: int, fail: Any) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config; the first feature we lack is refused by name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise fail("use_dora (DoRA) is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if config.get(key):
            raise fail(f"{key} is not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if t not in SUPPORTED_MODULES:
                raise fail(f"target module {t!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_MODULES)})")  # fmt: skip
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise fail(f"r must be a positive integer (got {rank!r})")
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a number (got {alpha!r})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _safetensors_header(path: str, fail: Any) -> dict[str, Any]:
    """A safetensors file's JSON header: 8 bytes of length, then the JSON (no tensor read)."""
    if not os.path.isfile(path):
        raise fail(f"{path} not found (only safetensors adapters are served)")
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise fail(f"{path} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise fail(f"{path} is not a safetensors file")
    return header
