"""Tiny random-weight models in Hugging Face format, for tests that need real checkpoints.

API (stable; the engine tests use it too):
- `TINY_KINDS`: the kinds `make_tiny_model` builds.
- `make_tiny_model(kind, path, dtype=torch.float32) -> path`: writes config.json,
  generation_config.json, model.safetensors and a real tokenizer (byte-level BPE, vocab
  `VOCAB_SIZE`, `<s>`=0 bos, `</s>`=1 eos, `<pad>`=2, a jinja `chat_template`) to `path`.
  Memoized: a directory already holding the same kind and dtype is returned as is, so a test
  session can share one directory per kind (e.g. under `tmp_path_factory.getbasetemp()`).
- `tiny_model_dir(kind, base_dir) -> path`: `make_tiny_model` into `base_dir/tiny-<kind>`.

Every kind: hidden 64, 2 layers, 4 heads, 2 kv heads (GQA), max_position_embeddings 512, weights
from `torch.manual_seed(SEED)` with norms and biases randomized too (so a skipped norm or bias
shows up in equivalence tests).

`FAMILY_KINDS` are the further families, each bending what matters about it: Mixtral (4 experts,
top 2, renormalized, an 8-token window on every layer); Qwen3-MoE (a dense layer 0 by
`mlp_only_layers`, 8 experts without `norm_topk_prob`, YaRN rope); Gemma 2 and Gemma 3 (an
8-token window on layer 0, strong soft-caps, Gemma 3 with linear-scaled global rope); Phi-3
(fused q/k/v and gate/up, longrope past position 32 on half of each head). `TINY_KINDS` does
not list them: the engine-wide suites run per kind.

`HYBRID_KINDS` interleave Gated DeltaNet (linear attention, recurrent state) with gated full
attention, 4 layers `[linear, full, linear, full]`, 2 key and 4 value heads in the linear layers
(value heads share key heads): Qwen3-Next (its fused `in_proj_qkvz`, experts with a shared expert
and a dense layer 1 by `mlp_only_layers`, half-rotary heads), Qwen3.5 dense (separate
projections, quarter-rotary), Qwen3.5-MoE (every layer routed, plus a shared expert), and a
Qwen3.5 multimodal checkpoint (`Qwen3_5ForConditionalGeneration`: a one-block vision tower,
the language model under `model.language_model.`).
"""

from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY_KINDS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3"]
FAMILY_KINDS = ["mixtral", "qwen3-moe", "gemma2", "gemma3", "phi3"]
HYBRID_KINDS = ["qwen3-next", "qwen3.5", "qwen3.5-moe", "qwen3.5-vl"]
VOCAB_SIZE = 512
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
SEED = 1234
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MARKER = "tiny_model.json"

TEXT = """\
The quick brown fox jumps over the lazy dog while the small cat sleeps in the warm sun.
A serving engine keeps many requests running at once, and each request grows its own cache of
keys and values, one block at a time, so that memory is shared fairly between the users.
Once upon a time there was a little town by the sea where fishermen sold their catch every morning
and children ran along the beach, looking for shells, stones and the shapes of strange animals.
The weather today is cloudy with a chance of rain in the afternoon; tomorrow will be bright.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are written in words.
What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.
Please write a short poem about the moon, the stars, the night, the river and the quiet mountains.
Hello, how are you? I am fine, thank you. Where are you going? I am going to the market to buy
bread, milk, apples, oranges, cheese, butter, eggs, rice, beans, tea and coffee for the family.
Science helps people understand the world: physics studies energy, chemistry studies matter,
biology studies living things, and mathematics studies patterns, numbers, shapes and proofs.
"""


def _configs() -> dict[str, tuple[type, object]]:
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    llama3_rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    tied = {**common, "tie_word_embeddings": True}
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**common, rope_parameters=llama3_rope)),
        "llama-tied": (LlamaForCausalLM, LlamaConfig(**tied)),
        "mistral": (MistralForCausalLM, MistralConfig(**common, sliding_window=None)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32)),
        **_family_configs(common),
        **_hybrid_configs(common),
    }


def _hybrid_configs(common: dict) -> dict[str, tuple[type, object]]:
    hybrid = dict(
        common, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )  # fmt: skip
    next_rope = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)
    dense = {k: v for k, v in hybrid.items() if k != "intermediate_size"}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
    )  # fmt: skip
    return {
        "qwen3-next": (
            Qwen3NextForCausalLM,
            Qwen3NextConfig(**hybrid, **moe, mlp_only_layers=[1], rope_parameters=next_rope),
        ),
        "qwen3.5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig(**hybrid)),
        "qwen3.5-moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**dense, **moe)),
        "qwen3.5-vl": (
            Qwen3_5ForConditionalGeneration,
            Qwen3_5Config(text_config=hybrid, vision_config=vision),
        ),
    }


def _family_configs(common: dict) -> dict[str, tuple[type, object]]:
    yarn = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=128)
    longrope = dict(
        rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.5,
        original_max_position_embeddings=32, short_factor=[1.0, 1.1, 1.3, 1.6],
        long_factor=[1.0, 2.0, 4.0, 8.0],
    )  # fmt: skip
    gemma = dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    gemma3_rope = {
        "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
    }
    moe = dict(num_experts_per_tok=2)
    qwen3_moe = dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False)
    return {
        "mixtral": (
            MixtralForCausalLM,
            MixtralConfig(**common, **moe, num_local_experts=4, sliding_window=8),
        ),
        "qwen3-moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **common, **moe, **qwen3_moe, head_dim=16, mlp_only_layers=[0], rope_parameters=yarn
            ),
        ),  # fmt: skip
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(
                **common, **gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
            ),
        ),
        "gemma3": (
            Gemma3ForCausalLM,
            Gemma3TextConfig(**common, **gemma, rope_parameters=gemma3_rope),
        ),
        "phi3": (
            Phi3ForCausalLM,
            Phi3Config(**common, rope_parameters=longrope, original_max_position_embeddings=32),
        ),
    }


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `TEXT`, exactly `VOCAB_SIZE` tokens (asserted)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, f"tokenizer vocab {tok.get_vocab_size()}"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)


def make_tiny_model(kind: str, path: str, dtype: torch.dtype = torch.float32) -> str:
    """Write a tiny `kind` model with its tokenizer to `path` (built once per kind, path, dtype)."""
    kinds = TINY_KINDS + FAMILY_KINDS + HYBRID_KINDS
    if kind not in kinds:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {kinds}")
    stamp = {"kind": kind, "dtype": str(dtype)}
    marker = os.path.join(path, _MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == stamp:
                return path
    cls, config = _configs()[kind]
    torch.manual_seed(SEED)
    model = cls(config)
    _randomize_norms_and_biases(model)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(stamp, f)
    return path


def tiny_model_dir(kind: str, base_dir: str | os.PathLike[str]) -> str:
    return make_tiny_model(kind, os.path.join(os.fspath(base_dir), f"tiny-{kind}"))
