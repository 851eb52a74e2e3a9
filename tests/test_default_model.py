"""The model shipped in frontend/default_model/ loads with plain transformers and is not noise."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import pagedserve.frontend

MODEL_DIR = Path(os.path.dirname(pagedserve.frontend.__file__)) / "default_model"
STDLIB_DIR = Path(os.path.dirname(os.__file__))
# train.py trains on top-level Lib/*.py files only, so a sub-package's module is unseen text.
HELD_OUT = STDLIB_DIR / "json" / "decoder.py"
CONTEXT = 256  # the training context; RoPE positions beyond it were never trained


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def test_directory_is_small_and_complete() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]:
        assert name in names, f"{name} missing from {MODEL_DIR}"
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size < 6 * 2**20, f"default model dir is {size / 2**20:.1f} MiB"


def test_config(model) -> None:
    cfg = model.config
    assert model.dtype == torch.bfloat16
    assert cfg.tie_word_embeddings
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert model.generation_config.eos_token_id == cfg.eos_token_id


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x ** 2  # square\n",
        "class A(B, metaclass=M):\n\tpass\r\n\n\n   trailing   \n",
        's = f"{name!r:>10}" + \'\\n\' + """doc"""',
        "naïve = 'héllo wörld 日本語 🐍'\x00\x7f",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer(text)["input_ids"]
    assert with_bos == [tokenizer.bos_token_id, *ids]
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "print hello"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>\nprint hello\n<|assistant|>\n"
    history = [*messages, {"role": "assistant", "content": "print('hello')"}]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert rendered.endswith("<|assistant|>\nprint('hello')</s>")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    for role in ["<|user|>", "<|assistant|>"]:  # each role marker is one special token
        assert tokenizer.convert_tokens_to_ids(role) in ids


def test_held_out_loss_is_far_below_uniform(tokenizer, model) -> None:
    assert HELD_OUT.parent != STDLIB_DIR
    ids = tokenizer(HELD_OUT.read_text(encoding="utf-8"))["input_ids"]
    num_windows = min(4, len(ids) // CONTEXT)
    assert num_windows >= 1
    windows = torch.tensor(ids[: num_windows * CONTEXT]).view(num_windows, CONTEXT)  # [W, S]
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.float().item()
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.6 * uniform, f"held-out loss {loss:.2f} vs uniform {uniform:.2f}"
