"""A tiny random gpt-oss checkpoint in the released format, for tests (no hub here).

`make_gpt_oss(path)`: transformers' `GptOssForCausalLM` (hidden 64, 2 layers `[sliding(8),
full]`, 4 query / 2 KV heads, 4 experts top 2, YaRN) with its experts written the way the
released checkpoints store them: MXFP4 `*_blocks` / `*_scales` (random codes, exponents near
2^-4) plus `quantization_config: {quant_method: mxfp4}`; `mxfp4=False` keeps transformers'
plain float tensors. The oracle is transformers' own load of the same directory (its
`Mxfp4Dequantize`: `load_oracle`). Sinks, biases and norms are randomized so none can be skipped.

The tokenizer is a byte-level BPE (tests/tiny_models.py's text, and harmony's words) plus the
harmony special tokens
(`<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`, `<|call|>`,
`<|constrain|>`; the model's vocabulary has one more, unused id, so --tp 2 divides it), with
`CHAT_TEMPLATE` below: the harmony format of gpt-oss's own template
(system and developer headers, tools as a TypeScript namespace, the analysis channel for
reasoning and commentary-channel tool calls), shortened; openai_harmony's tokenizer needs a
download this machine cannot make.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tiny_models import SEED, TEXT, VOCAB_SIZE

HARMONY_WORDS = (
    "analysis assistant commentary final functions.get_weather json city Paris weather Need "
    'the Say hello Hello there developer system user to=functions {"city": "Paris"}'
)

HARMONY_TOKENS = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
    "<|constrain|>",
)  # fmt: skip
_MARKER = "gpt_oss_model.json"

CHAT_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}\nCalls to these tools must go to the commentary channel: 'functions'."
    "{% endif %}<|end|>"
    "{% set sys = messages | selectattr('role', 'in', ['system', 'developer']) | list %}"
    "{% if sys or tools %}<|start|>developer<|message|>"
    "{% if sys %}# Instructions\n\n{{ sys[0]['content'] }}{% endif %}"
    "{% if tools %}{% if sys %}\n\n{% endif %}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}{% set f = t['function'] %}\n// {{ f.get('description', '') }}\n"
    "type {{ f['name'] }} = (_: {{ f.get('parameters', {}) | tojson }}) => any;\n"
    "{% endfor %}\n} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% for m in messages if m['role'] not in ['system', 'developer'] %}"
    "{% if m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "{% if m.get('reasoning_content') %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m['reasoning_content'] }}<|end|>{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<|start|>assistant to=functions."
    "{{ c['function']['name'] }}<|channel|>commentary json<|message|>"
    "{{ c['function']['arguments'] if c['function']['arguments'] is string "
    "else c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% if m['content'] %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
    "<|end|>{% endif %}"
    "{% elif m['role'] == 'tool' %}<|start|>functions.{{ m.get('name', 'tool') }} to=assistant"
    "<|channel|>commentary<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def _config() -> object:
    from transformers import GptOssConfig

    yarn = dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=128,
        beta_fast=32.0, beta_slow=1.0, truncate=False,
    )  # fmt: skip
    return GptOssConfig(
        vocab_size=VOCAB_SIZE + 8, hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=yarn, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip


def _to_mxfp4(path: str) -> None:
    """Replace the experts' float tensors by random MXFP4 codes, as the released files hold."""
    weights = load_file(os.path.join(path, "model.safetensors"))
    gen = torch.Generator().manual_seed(SEED)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(name).shape  # transformers' [E, in, out]
        groups = (experts, outputs, inputs // 32)
        weights[name + "_blocks"] = torch.randint(0, 256, (*groups, 16), generator=gen).byte()
        weights[name + "_scales"] = torch.randint(122, 126, groups, generator=gen).byte()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_tokenizer_with_harmony() -> object:
    """tests/tiny_models.py's BPE, trained with harmony's words too (so a reply is few tokens),
    plus the harmony special tokens after its `VOCAB_SIZE` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    harmony = HARMONY_WORDS.split() + [HARMONY_WORDS]  # each word bare (after a special token)
    bpe.train_from_iterator(TEXT.splitlines() * 4 + harmony * 40, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    assert len(tok) == VOCAB_SIZE + len(HARMONY_TOKENS)
    tok.eos_token = "<|return|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def harmony_id(name: str) -> int:
    return VOCAB_SIZE + HARMONY_TOKENS.index(name)


def make_gpt_oss(path: str, mxfp4: bool = True) -> str:
    """Write the tiny gpt-oss model and its tokenizer to `path` (once per path and form)."""
    from transformers import GenerationConfig, GptOssForCausalLM

    stamp = {"mxfp4": mxfp4, "version": 1}
    marker = os.path.join(path, _MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == stamp:
                return path
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    eos = [harmony_id("<|return|>"), harmony_id("<|call|>")]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    make_tokenizer_with_harmony().save_pretrained(path)
    if mxfp4:
        _to_mxfp4(path)
    with open(marker, "w") as f:
        json.dump(stamp, f)
    return path


def load_oracle(path: str) -> torch.nn.Module:
    """transformers' float32 model of `path`, MXFP4 experts dequantized by transformers."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    with open(os.path.join(path, "config.json")) as f:
        quantized = "quantization_config" in json.load(f)
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    return GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **extra
    ).eval()


def teach_replies(path: str, conversations: list[tuple[list, list | None, str]]) -> None:
    """Make greedy decoding of each `(messages, tools, reply)` conversation's rendered prompt
    produce `reply` (harmony text): the LM head is solved in closed form so that at each reply
    position the next reply token's logit is 10 and every other is 0. The decoder's hidden
    states depend only on the tokens so far, so a greedy decode follows them token for token.
    Cheap (two forwards), unlike training, and asserted with transformers' `generate`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = load_oracle(path)
    hidden, targets, prompts = [], [], []
    with torch.no_grad():
        for messages, tools, reply in conversations:
            text = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
            prompt = tok.encode(text, add_special_tokens=False)
            answer = tok.encode(reply, add_special_tokens=False)
            states = model.model(torch.tensor([prompt + answer])).last_hidden_state[0]
            hidden.append(states[len(prompt) - 1 : -1])
            targets += answer
            prompts.append((prompt, answer))
    h = torch.cat(hidden)  # [N, H]
    assert h.shape[0] <= h.shape[1], "more reply tokens than hidden units: no exact solution"
    want = torch.nn.functional.one_hot(torch.tensor(targets), model.config.vocab_size) * 10.0
    head = torch.linalg.lstsq(h.double(), want.double()).solution.t().float()  # [V, H]
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["lm_head.weight"] = head.contiguous()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model = load_oracle(path)
    for prompt, answer in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer), do_sample=False)
        assert out[0, len(prompt) :].tolist() == answer
