"""Tiny FP8 checkpoints with the tensor names, dtypes and scale layouts of published ones.

- `block`: HF `quant_method: fp8`, `weight_block_size: [128, 128]` (Qwen3-8B-FP8,
  DeepSeek-V3): every decoder linear `*.weight` is F8_E4M3 `[N, K]` with `*.weight_scale_inv`
  F32 `[ceil(N/128), ceil(K/128)]`; embeddings, norms and lm_head stay in the model dtype.
- `channel` / `tensor`: compressed-tensors `float-quantized` (llm-compressor FP8-dynamic / FP8):
  `*.weight` F8_E4M3 with `*.weight_scale` BF16 `[N, 1]` (channel) or F32 `[1]` (tensor),
  dynamic per-token input activations, `ignore: ["lm_head"]`.
- `kv_scales`: adds compressed-tensors' `kv_cache_scheme` and per-layer
  `model.layers.N.self_attn.k_scale` / `v_scale` F32 scalars.

`make_fp8_checkpoint` also writes `<dst>-dequant`: the same model with the fp8 weights
dequantized back to the source dtype, so the FP8 model and a plain one with identical effective
weights can be compared (they differ only by activation quantization).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, checkpoint scale, dequantized weight) for one `[N, K]` matrix."""
    w = w.float()
    if fmt == "block":
        n, k = w.shape
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.nn.functional.pad(w, (0, cols * 128 - k, 0, rows * 128 - n))
        blocks = padded.view(rows, 128, cols, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [rows, cols]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).to(FP8)
        return q, scale, q.float() * full
    if fmt == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)  # [N, 1]
        q = (w / scale.float()).to(FP8)
        return q, scale, q.float() * scale.float()
    scale = (w.abs().amax() / 448.0).reshape(1)  # tensor: F32 [1]
    q = (w / scale).to(FP8)
    return q, scale, q.float() * scale


def _quant_config(fmt: str, kv_scales: bool) -> dict:
    if fmt == "block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}  # fmt: skip
    group = {
        "input_activations": {"dynamic": True, "num_bits": 8, "observer": None,
                              "strategy": "token", "symmetric": True, "type": "float"},
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": fmt,
                    "symmetric": True, "type": "float"},
    }  # fmt: skip
    kv = {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True, "type": "float"}
    return {
        "config_groups": {"group_0": group}, "format": "float-quantized", "ignore": ["lm_head"],
        "kv_cache_scheme": kv if kv_scales else None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }  # fmt: skip


def make_fp8_checkpoint(src: str, dst: str, fmt: str, kv_scales: bool = False) -> str:
    """Quantize the plain checkpoint `src` into `dst` in `fmt` (see the module docstring)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            q, scale, deq = _quantize(t, fmt)
            quantized[name] = q
            suffix = "weight_scale_inv" if fmt == "block" else "weight_scale"
            quantized[name[: -len("weight")] + suffix] = scale
            dequantized[name] = deq.to(t.dtype)
        else:
            quantized[name] = dequantized[name] = t
    if kv_scales:
        layers = {".".join(n.split(".")[:3]) for n in tensors if n.startswith("model.layers.")}
        for i, layer in enumerate(sorted(layers)):
            quantized[f"{layer}.self_attn.k_scale"] = torch.tensor(0.5 + i, dtype=torch.float32)
            quantized[f"{layer}.self_attn.v_scale"] = torch.tensor(0.25, dtype=torch.float32)
    for out, weights in ((dst, quantized), (dst + "-dequant", dequantized)):
        shutil.copytree(src, out, dirs_exist_ok=True)
        save_file(weights, os.path.join(out, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _quant_config(fmt, kv_scales)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst
