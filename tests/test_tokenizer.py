"""The API server's torch-free tokenizer gives exactly what transformers' AutoTokenizer gives, on
every tokenizer the tests and benchmarks use, and loading it imports neither torch nor the model
half of transformers."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import pagedserve.frontend
from pagedserve.frontend.tokenizer import FastTokenizer, load_tokenizer

from tiny_models import tiny_model_dir

DEFAULT = os.path.join(os.path.dirname(pagedserve.frontend.__file__), "default_model")
BENCH_TOKENIZER = {  # a word-level tokenizer like ../shared/bench/make_model_dir.py writes
    "version": "1.0",
    "added_tokens": [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(["<unk>", "<s>", "</s>"])
    ],
    "normalizer": None,
    "pre_tokenizer": {"type": "WhitespaceSplit"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "unk_token": "<unk>",
              "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 300)}}},
}  # fmt: skip
TEXTS = [
    "hello world",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x ** 2  # comment\n",
    "<s> special </s> tokens in text <|user|>",
    "unicode: héllo wörld, 日本語, emoji 🙂🚀",
    "punctuation , . ! ? don't can't I'm",
    "",
    "w3 w4 w17 w299 unknownword",
]
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi <s> there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again", "name": None},
]


@pytest.fixture(scope="module", params=["default", "tiny-llama", "bench"])
def path(request, tmp_path_factory):
    if request.param == "default":
        return DEFAULT
    if request.param == "tiny-llama":
        return tiny_model_dir("llama", str(tmp_path_factory.getbasetemp()))
    import json

    d = tmp_path_factory.mktemp("bench-tokenizer")
    (d / "tokenizer.json").write_text(json.dumps(BENCH_TOKENIZER))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


def test_fast_tokenizer_equals_transformers(path):
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(ours, FastTokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert len(ours) == len(theirs)
    for text in TEXTS:
        for special in (True, False):
            got = ours(text, add_special_tokens=special)["input_ids"]
            assert got == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    if theirs.chat_template:
        for gen in (True, False):
            kw = dict(tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(CONVERSATION, **kw) == theirs.apply_chat_template(
                CONVERSATION, **kw
            )
    custom = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ x }}"
    )
    kw = dict(tokenize=False, chat_template=custom, x="!")
    assert ours.apply_chat_template(CONVERSATION, **kw) == theirs.apply_chat_template(
        CONVERSATION, **kw
    )


def test_tokenizers_with_python_behaviour_go_to_transformers(tmp_path):
    path = tiny_model_dir("llama", str(tmp_path))
    import json

    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["add_bos_token"] = False
    with open(config_file, "w") as f:
        json.dump(config, f)
    tok = load_tokenizer(path)
    assert not isinstance(tok, FastTokenizer)
    assert tok("hi")["input_ids"] == AutoTokenizer.from_pretrained(path)("hi")["input_ids"]


def test_loading_imports_no_torch():
    code = (
        "import sys; from pagedserve.frontend.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({DEFAULT!r}); t.apply_chat_template([{{'role': 'user', "
        "'content': 'hi'}], tokenize=False); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
