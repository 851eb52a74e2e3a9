"""A tiny random DeepSeek-V3 in Hugging Face format (transformers' `DeepseekV3ForCausalLM`), the
oracle for tests/test_deepseek_v3.py; `make_fp8_deepseek` rewrites it as a block-FP8 checkpoint.

Shapes bend what matters: 3 layers (layer 0 dense by `first_k_dense_replace`), q through a
low-rank pair, a 32-wide latent plus an 8-wide interleaved rope key, 8 routed experts in 4 groups
(the best 2 groups kept, top 2 experts, a random `e_score_correction_bias`, routed scaling 2.5)
and a shared expert, YaRN (factor 4) whose `mscale` and `mscale_all_dim` differ, so both the
cos/sin factor and the softmax scale move. Norm weights are random; one MTP layer is declared
and stored (`model.layers.3.*`), as the published checkpoints store theirs.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

from tiny_models import BOS_ID, EOS_ID, PAD_ID, SEED, VOCAB_SIZE, make_tokenizer

FP8 = torch.float8_e4m3fn


def tiny_config() -> DeepseekV3Config:
    yarn = dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=128,
        mscale=1.0, mscale_all_dim=0.7, beta_fast=32, beta_slow=1,
    )  # fmt: skip
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512,
        rope_parameters=yarn, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    )  # fmt: skip


def make_tiny_deepseek(path: str) -> str:
    """Write the tiny model, its tokenizer (tests/tiny_models.py's) and an MTP layer to `path`."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(tiny_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer's own
    weights["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(128, 32)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> fp8 `[N, K]` and float32 dequantization scales per `block` square."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, cols * block - k, 0, rows * block - n))
    scale = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w.float() / full).to(FP8), scale


def make_fp8_deepseek(src: str, dst: str, block: int = 16) -> str:
    """`src` as DeepSeek-V3 publishes FP8: every decoder linear weight (routed experts included)
    fp8 with `weight_scale_inv` per `block` x `block` (128 in the real ones: the tiny widths need
    smaller blocks to hold several), `quantization_config` saying so; router, norms, embeddings
    and LM head as they were."""
    os.makedirs(dst, exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, w in weights.items():
        is_linear = name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")
        if name.startswith("model.layers.") and is_linear and w.dim() == 2:
            out[name], out[name + "_scale_inv"] = _block_quantize(w, block)
        else:
            out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, f)):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst
