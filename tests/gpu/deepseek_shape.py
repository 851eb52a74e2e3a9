"""DeepSeek-V3's shape cut to LAYERS decoder layers (3 dense), FP8 block weights, as an HF dir.

Usage: python tests/gpu/deepseek_shape.py DIR LAYERS [v3|small]  (small: a CPU dry run)
"""

import sys

sys.path.insert(0, "tests")
from transformers import DeepseekV3Config

from tiny_models import make_tokenizer

path, layers = sys.argv[1], int(sys.argv[2])
shape = sys.argv[3] if len(sys.argv) > 3 else "v3"
yarn = dict(
    rope_type="yarn",
    rope_theta=1e4,
    factor=40.0,
    original_max_position_embeddings=4096,
    mscale=1.0,
    mscale_all_dim=1.0,
    beta_fast=32,
    beta_slow=1,
)
dims = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    q_lora_rank=1536,
    kv_lora_rank=512,
    vocab_size=129280,
)
if shape == "small":  # a CPU dry run of this script
    dims = dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=16,
        q_lora_rank=128,
        kv_lora_rank=64,
        vocab_size=4096,
    )
config = DeepseekV3Config(
    **dims,
    num_hidden_layers=layers,
    first_k_dense_replace=3,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_parameters=yarn,
    num_nextn_predict_layers=1,
    dtype="bfloat16",
)
config.architectures = ["DeepseekV3ForCausalLM"]
config.quantization_config = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
config.save_pretrained(path)
make_tokenizer().save_pretrained(path)  # ids < 512: enough for random prompts
